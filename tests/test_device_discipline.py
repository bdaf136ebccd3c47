"""Device discipline, checked on a CPU, statically and at run time.

Statically, over every package the training step runs (SCANNED), in *step code*: every
function there except those OFF_STEP names (build, checkpoint, export, generation: each
with the reason it runs outside the step). Three rules:

- a tensor factory names its device: `torch.zeros(n)` or a bare imported `zeros(n)`
  (`from torch import zeros`) without `device=` is flagged (`*_like` and `Tensor.new_*`
  take their argument's device); FACTORIES_ALLOWED says why where one may not;
- no literal CPU device: `device="cpu"`, `torch.device("cpu")` in a call, `.to("cpu")` --
  host memory is named once, as a module constant saying why (ps/worker.py WIRE);
- no host sync: `.item()`, `.tolist()`, `.cpu()`, `.numpy()`, `synchronize()`, and
  `bool`/`float`/`int` of a tensor expression (one that names torch or calls a tensor
  reduction: all, any, sum, mean, norm, isfinite, max, min) -- except the calls
  shardtrain/train/syncs.py STEP_SYNCS lists, each with its reason (docs/performance.md).

Every allow-list entry must match a call (or, OFF_STEP, a flagged function): a stale entry
is an error, so the lists stay true. At run time, each collective refuses a tensor not on
its group's device (comm/dispatch.py `placed`), on every call.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

import shardtrain
from shardtrain.comm import Communicator, CommLedger, build_mesh
from shardtrain.mesh import MeshShape
from shardtrain.train.syncs import STEP_SYNCS

ROOT = Path(shardtrain.__file__).parent
SCANNED = ("comm", "parallel", "model", "train", "quant", "ckpt")
FACTORIES = frozenset({
    "empty", "zeros", "ones", "full", "tensor", "as_tensor", "arange", "linspace",
    "logspace", "eye", "randn", "rand", "randint", "randperm", "normal", "empty_strided",
    "frombuffer", "from_numpy", "from_file", "scalar_tensor", "sparse_coo_tensor"})
SYNCS = frozenset({"item", "tolist", "cpu", "numpy", "synchronize"})
REDUCTIONS = frozenset({"all", "any", "sum", "mean", "norm", "isfinite", "max", "min"})

# (file under shardtrain/, function; "*": the whole file) -> why it runs outside the step.
OFF_STEP = {
    ("comm/dispatch.py", "agreed_link"): "a communicator's construction (the link it prices)",
    ("ckpt/dcp.py", "*"): "checkpoint save and load (a save's snapshot copy is its own sync)",
    ("ckpt/files.py", "*"): "checkpoint reads",
    ("model/generate.py", "*"): "text generation after training (train/sample.py)",
    ("model/hf.py", "*"): "Hugging Face weights in and out, at start and end",
    ("model/moe.py", "__init__"): "parameters built on the meta device, materialised by "
                                  "parallel/build.py on the rank's device",
    ("model/positions.py", "*"): "rotary tables built once, moved with the module",
    ("model/transformer.py", "init_tensor"): "start values drawn on the host from (seed, "
                                             "name) alone, copied into the built shards",
    ("model/transformer.py", "init_expert"): "as init_tensor, per expert",
    ("parallel/pieces.py", "*"): "checkpoint pieces (save and load)",
    ("parallel/pipeline/state.py", "all_gather_objects"): "full state dicts and checkpoint "
                                                          "metadata: host bytes by nature",
    ("parallel/pipeline/stage.py", "__init__"): "placeholder rotary buffers, moved with the "
                                                "module (.to(device)) and filled by "
                                                "init_weights",
    ("parallel/zero/offload.py", "__init__"): "ZeRO-Offload's host copies of the master, "
                                              "made once at build",
    ("parallel/zero/offload.py", "load_shard_state"): "checkpoint load",
    ("parallel/zero/offload.py", "_map"): "the NVMe file mapped once (host memory by nature)",
    ("parallel/zero/offload.py", "_write_file"): "the NVMe file written once at build",
    ("parallel/pipeline/runtime.py", "evaluate"): "evaluation (forward only), after the "
                                                  "logged step's flush",
    ("parallel/ps/server.py", "*"): "the parameter server: a host process by design "
                                    "(parallel/ps/groups.py)",
    ("quant/blockwise.py", "dynamic_map"): "a code table built once (functools.cache)",
    ("quant/blockwise.py", "_zero_code"): "a code table index, built once (functools.cache)",
    ("quant/blockwise.py", "_boundaries"): "bucket bounds built once (functools.cache)",
    ("quant/nf4.py", "nf4_levels"): "NF4's 16 levels, built once",
    ("train/adam8bit.py", "load_canonical"): "checkpoint load",
    ("train/calibrate.py", "*"): "`shardtrain calibrate`: a measurement, no training step",
    ("train/export.py", "*"): "export after training",
    ("train/metrics.py", "measure_matmul_flops"): "the CPU's peak, measured once per process",
    ("train/metrics.py", "clock"): "a wall clock for the benchmarks, not called in the step",
    ("train/peft_format.py", "*"): "adapter files written after training",
    ("train/ps_server.py", "*"): "the parameter server's loop: a host process by design",
    ("train/trainer.py", "evaluate"): "periodic evaluation: a logged step, after the flush",
}
# (file, function, factory) -> why this factory in step code names no device.
FACTORIES_ALLOWED = {
    ("train/adam8bit.py", "step", "zeros"):
        "the step count is a host scalar on purpose, as torch.optim.AdamW's "
        "(non-capturable) one: read every step with no device sync",
}
# (file, function) -> why step code names the CPU literally.
CPU_ALLOWED = {
    ("parallel/zero/offload.py", "fetch"): "ZeRO-Offload's pinned host side of an NVMe read",
    ("parallel/zero/offload.py", "_read"): "ZeRO-Offload: a shard's state read from its files "
                                           "into host memory",
}


def _functions(tree: ast.Module):
    """(name, node) for the module body and every function, nested ones on their own."""
    yield "<module>", tree
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node.name, node


def _own_calls(func: ast.AST):
    """The calls in `func`'s body, not in functions nested in it (those are scanned
    under their own name); a lambda's calls are its enclosing function's."""
    stack = list(ast.iter_child_nodes(func))
    while stack:
        node = stack.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if isinstance(node, ast.Call):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _is_cpu(node: ast.AST) -> bool:
    """"cpu" (or "cpu:0"), or torch.device("cpu")."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value.split(":")[0] == "cpu"
    return (isinstance(node, ast.Call) and _dotted(node.func) == "torch.device"
            and bool(node.args) and _is_cpu(node.args[0]))


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _tensor_expr(node: ast.AST) -> bool:
    """Detectably a tensor: names torch, or calls a tensor reduction."""
    return any((isinstance(n, ast.Name) and n.id == "torch") or
               (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                and n.func.attr in REDUCTIONS) for n in ast.walk(node))


def _findings(call: ast.Call, bare: dict[str, str], func_name: str) -> list[tuple[str, str]]:
    """(rule, name) for each rule `call` breaks: factory, cpu, sync."""
    f, out = call.func, []
    name = f.attr if isinstance(f, ast.Attribute) and _dotted(f.value) == "torch" else \
        bare.get(f.id) if isinstance(f, ast.Name) else None
    if name in FACTORIES and not any(k.arg == "device" for k in call.keywords):
        out.append(("factory", name))
    if func_name == "<module>":
        pass  # a module constant naming host memory is the sanctioned form (module doc)
    elif any(k.arg == "device" and _is_cpu(k.value) for k in call.keywords) or \
            (_dotted(f) == "torch.device" and call.args and _is_cpu(call.args[0])) or \
            (isinstance(f, ast.Attribute) and f.attr == "to" and call.args
             and isinstance(call.args[0], ast.Constant) and _is_cpu(call.args[0])):
        out.append(("cpu", "cpu"))
    if isinstance(f, ast.Attribute) and f.attr in SYNCS:
        out.append(("sync", f.attr))
    if isinstance(f, ast.Name) and f.id in ("bool", "float", "int") and call.args and \
            _tensor_expr(call.args[0]):
        out.append(("sync", f.id))
    return out


def _scan(root: Path = ROOT, folders: tuple[str, ...] = SCANNED, *, off_step=OFF_STEP,
          syncs=STEP_SYNCS, factories=FACTORIES_ALLOWED, cpu=CPU_ALLOWED):
    """(unexplained findings as 'path:line rule name (in function)', the allow-list keys
    that matched something)."""
    found, used = [], set()
    lists = {"off": off_step, "sync": syncs, "factory": factories, "cpu": cpu}
    for folder in folders:
        for file in sorted((root / folder).rglob("*.py")):
            rel = file.relative_to(root).as_posix()
            tree = ast.parse(file.read_text())
            bare = {a.asname or a.name: a.name for n in ast.walk(tree)  # local -> torch's
                    if isinstance(n, ast.ImportFrom) and n.module == "torch"
                    for a in n.names if a.name in FACTORIES}
            for func_name, func in _functions(tree):
                for call in _own_calls(func):
                    for rule, name in _findings(call, bare, func_name):
                        own = (rel, func_name) if rule == "cpu" else (rel, func_name, name)
                        keys = [("off", (rel, "*")), ("off", (rel, func_name)), (rule, own)]
                        hit = [(kind, key) for kind, key in keys if key in lists[kind]]
                        if hit:
                            used.update(hit)
                        else:
                            found.append(f"{rel}:{call.lineno} {rule} {name} (in {func_name})")
    return found, used


def test_step_code_names_devices_and_makes_only_the_listed_syncs():
    found, used = _scan()
    assert not found, ("step code breaks a device rule (fix it, or add an entry saying why "
                       "to OFF_STEP, FACTORIES_ALLOWED, CPU_ALLOWED or train/syncs.py "
                       "STEP_SYNCS):\n" + "\n".join(found))
    every = {("off", k) for k in OFF_STEP} | {("sync", k) for k in STEP_SYNCS} | \
        {("factory", k) for k in FACTORIES_ALLOWED} | {("cpu", k) for k in CPU_ALLOWED}
    assert used == every, f"entries that match no call: {sorted(every - used)}"


def test_the_docs_list_every_step_sync():
    doc = (ROOT.parent / "docs" / "performance.md").read_text()
    rows = set(re.findall(r"^\| `([^`]+)` \| `([^`]+)` \| `([^`]+)` \|", doc, re.M))
    assert rows == set(STEP_SYNCS), "docs/performance.md's table and STEP_SYNCS differ"


PLANTED = {  # rule -> (source, the finding it must make)
    "torch factory": ("import torch\ndef f(n):\n    return torch.zeros(n)\n",
                      "step/bad.py:3 factory zeros (in f)"),
    "bare factory": ("from torch import empty as e\ndef f(n):\n    return e(n)\n",
                     "step/bad.py:3 factory empty (in f)"),
    "cpu literal": ("import torch\ndef f(n):\n    return torch.ones(n, device='cpu')\n",
                    "step/bad.py:3 cpu cpu (in f)"),
    "cpu device": ("import torch\ndef f(x):\n    return x.to(torch.device('cpu'))\n",
                   "step/bad.py:3 cpu cpu (in f)"),
    "to cpu": ("def f(x):\n    return x.to('cpu')\n", "step/bad.py:2 cpu cpu (in f)"),
    "item": ("def f(x):\n    return x.sum().item()\n", "step/bad.py:2 sync item (in f)"),
    "tolist": ("def f(x):\n    return x.tolist()\n", "step/bad.py:2 sync tolist (in f)"),
    "cpu()": ("def f(x):\n    return x.cpu()\n", "step/bad.py:2 sync cpu (in f)"),
    "numpy": ("def f(x):\n    return x.numpy()\n", "step/bad.py:2 sync numpy (in f)"),
    "synchronize": ("import torch\ndef f():\n    torch.cuda.synchronize()\n",
                    "step/bad.py:3 sync synchronize (in f)"),
    "bool of a tensor": ("import torch\ndef f(x):\n    return bool(torch.isfinite(x))\n",
                         "step/bad.py:3 sync bool (in f)"),
    "float of a reduction": ("def f(x):\n    return float(x.norm())\n",
                             "step/bad.py:2 sync float (in f)"),
}


NONE = dict(off_step={}, syncs={}, factories={}, cpu={})  # empty allow-lists
LIST_OF = {"factory": "factories", "cpu": "cpu", "sync": "syncs"}  # rule -> its list


@pytest.mark.parametrize("rule", PLANTED)
def test_each_rule_fails_on_a_planted_violation(tmp_path, rule):
    """One file per rule, one violation each: the scan names it; the entry that explains
    it silences it and counts as used (not stale)."""
    source, finding = PLANTED[rule]
    (tmp_path / "step").mkdir()
    (tmp_path / "step" / "bad.py").write_text(source)
    assert _scan(tmp_path, ("step",), **NONE)[0] == [finding]
    kind, name = finding.split()[1:3]
    key = ("step/bad.py", "f") if kind == "cpu" else ("step/bad.py", "f", name)
    found, used = _scan(tmp_path, ("step",), **(NONE | {LIST_OF[kind]: {key: "why"}}))
    assert not found and used == {(kind, key)}


def test_the_scan_leaves_alone_what_is_fine(tmp_path):
    """Not flagged: device=, *_like, new_*, a module constant for host memory, float of a
    plain number, nested functions under their own name, OFF_STEP functions."""
    (tmp_path / "step").mkdir()
    (tmp_path / "step" / "ok.py").write_text(
        "import torch\nWIRE = torch.device('cpu')\n\n"
        "def f(n, x, ratio):\n"
        "    a = torch.zeros(n, device=x.device), torch.zeros_like(x), x.new_empty(n)\n"
        "    b = torch.empty(n, device=WIRE), float(ratio), int(n)\n"
        "    def setup():\n"
        "        return x.item()\n"
        "    return a, b\n")
    found, used = _scan(tmp_path, ("step",), **(NONE | {"off_step": {("step/ok.py", "setup"):
                                                                       "why"}}))
    assert not found and used == {("off", ("step/ok.py", "setup"))}


def test_the_scan_reads_every_step_package():
    for folder in SCANNED:
        assert len(list((ROOT / folder).rglob("*.py"))) >= 3, folder


def test_a_collective_refuses_a_tensor_off_its_groups_device():
    """Every op checks each tensor's device against the group's before anything moves,
    world size 1 included; the error names the op and both devices."""
    comm = Communicator(None, name="dp", ranks=[0], ledger=CommLedger())  # a CPU group
    on_meta = torch.empty(4, device="meta")
    calls = {"all_reduce": lambda: comm.all_reduce(on_meta),
             "broadcast": lambda: comm.broadcast(on_meta),
             "all_gather": lambda: comm.all_gather(torch.empty(4), on_meta),
             "reduce_scatter": lambda: comm.reduce_scatter(on_meta, torch.empty(4)),
             "all_to_all": lambda: comm.all_to_all(torch.empty(4), on_meta),
             "isend": lambda: comm.isend(on_meta, 0)}
    for op, call in calls.items():
        with pytest.raises(ValueError, match=rf"^{op} on group dp: a tensor on meta, but the "
                                             r"group's payload lives on cpu"):
            call()
    comm.all_reduce(torch.ones(4))  # the right device passes
    gpu = Communicator(None, name="tp", ranks=[0], ledger=CommLedger(), device="cuda:1")
    with pytest.raises(ValueError, match="all_reduce on group tp: a tensor on cpu, .* on cuda:1"):
        gpu.all_reduce(torch.ones(2))


def test_a_communicator_knows_its_device_and_refuses_our_algorithms_on_cuda():
    mesh = build_mesh(MeshShape(), device=torch.device("cpu"))
    assert mesh.comm("dp").device == torch.device("cpu")
    with pytest.raises(ValueError, match="algorithm='ring'.*on CUDA use comm.algorithm=native"):
        Communicator(None, name="dp", ranks=[0], ledger=CommLedger(), algorithm="ring",
                     device="cuda")
    comm = Communicator(None, name="dp", ranks=[0], ledger=CommLedger(), device="cuda")
    assert comm.device.type == "cuda" and comm.algorithm == "native"

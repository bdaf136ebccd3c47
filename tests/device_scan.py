"""The static half of tests/test_device_discipline.py: the scan of step code and its
allow-lists (that file's docstring states the rules)."""

from __future__ import annotations

import ast
from pathlib import Path

import shardtrain
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
    ("model/generate.py", "*"): "text generation after training (train/finetune/sample.py)",
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
    ("train/start/calibrate.py", "*"): "`shardtrain calibrate`: a measurement, no training step",
    ("train/finetune/export.py", "*"): "export after training",
    ("train/observe/metrics.py", "measure_matmul_flops"): "the CPU's peak, measured once per process",
    ("train/observe/metrics.py", "clock"): "a wall clock for the benchmarks, not called in the step",
    ("train/finetune/peft_format.py", "*"): "adapter files written after training",
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
    # A module constant naming host memory is the sanctioned form (module doc): only calls
    # inside functions are held to the cpu rule.
    in_function = func_name != "<module>"
    if in_function and (
            any(k.arg == "device" and _is_cpu(k.value) for k in call.keywords)
            or (_dotted(f) == "torch.device" and call.args and _is_cpu(call.args[0]))
            or (isinstance(f, ast.Attribute) and f.attr == "to" and call.args
                and isinstance(call.args[0], ast.Constant) and _is_cpu(call.args[0]))):
        out.append(("cpu", "cpu"))
    if isinstance(f, ast.Attribute) and f.attr in SYNCS:
        out.append(("sync", f.attr))
    if isinstance(f, ast.Name) and f.id in ("bool", "float", "int") and call.args and \
            _tensor_expr(call.args[0]):
        out.append(("sync", f.id))
    return out


def scan(root: Path = ROOT, folders: tuple[str, ...] = SCANNED, *, off_step=OFF_STEP,
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

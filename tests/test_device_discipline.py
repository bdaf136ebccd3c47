"""Device discipline, checked on a CPU, statically and at run time.

Statically, over every package the training step runs (SCANNED), in *step code*: every
function there except those OFF_STEP names (build, checkpoint, export, generation: each
with the reason it runs outside the step). Four rules:

- a tensor factory names its device: `torch.zeros(n)` or a bare imported `zeros(n)`
  (`from torch import zeros`) without `device=` is flagged (`*_like` and `Tensor.new_*`
  take their argument's device); FACTORIES_ALLOWED says why where one may not;
- no blocking copy between host and device: a factory from Python data onto a device
  (`torch.tensor(list, device=d)`, `as_tensor`, `x.new_tensor(v)`: a copy from pageable
  memory the host waits for; `new_full` fills on the device instead), and a move
  (`.to(device)`, `.to(device=...)`, `.cuda()`) that does not say `non_blocking=True`
  (from pinned memory: parallel/pipeline/feed.py `Feed`); COPIES_ALLOWED says why
  where one may. A factory onto a module constant naming host memory makes no copy;
- no literal CPU device: `device="cpu"`, `torch.device("cpu")` in a call, `.to("cpu")` --
  host memory is named once, as a module constant saying why (ps/worker.py WIRE);
- no host sync: `.item()`, `.tolist()`, `.cpu()`, `.numpy()`, `synchronize()`,
  `bool`/`float`/`int` of a tensor expression (one that names torch or calls a tensor
  reduction: all, any, sum, mean, norm, isfinite, max, min), and the implicit bool() of a
  truth test (`if`, `while`, `assert`, `not`, `and`/`or`, `a if t else b`) of a tensor
  (a torch function or tensor method returning one, an operation on one, or a name the
  function bound to one) -- except the calls shardtrain/train/syncs.py STEP_SYNCS lists,
  each with its reason (docs/performance.md).

Every allow-list entry must match a call (or, OFF_STEP, a flagged function): a stale entry
is an error, so the lists stay true. At run time, each collective refuses a tensor not on
its group's device (comm/dispatch.py `placed`), on every call.
"""

from __future__ import annotations

import re

import pytest
import torch

from device_allowed import COPIES_ALLOWED, CPU_ALLOWED, FACTORIES_ALLOWED, OFF_STEP
from device_scan import ROOT, SCANNED, scan
from shardtrain.comm import Communicator, CommLedger, build_mesh
from shardtrain.mesh import MeshShape
from shardtrain.train.syncs import STEP_SYNCS


def test_step_code_names_devices_and_makes_only_the_listed_syncs():
    found, used = scan()
    assert not found, ("step code breaks a device rule (fix it, or add an entry saying why "
                       "to tests/device_allowed.py or train/syncs.py STEP_SYNCS):\n"
                       + "\n".join(found))
    every = {("off", k) for k in OFF_STEP} | {("sync", k) for k in STEP_SYNCS} | \
        {("factory", k) for k in FACTORIES_ALLOWED} | {("cpu", k) for k in CPU_ALLOWED} | \
        {("copy", k) for k in COPIES_ALLOWED}
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
    # blocking copies (issue 40: parallel/pipeline/executor.py, parallel/tensor/sharding.py)
    "to a device": ("def f(x, device):\n    return x.to(device)\n",
                    "step/bad.py:2 copy to (in f)"),
    "to device=": ("def f(x, ex):\n    return x.to(device=ex.device)\n",
                   "step/bad.py:2 copy to (in f)"),
    "to, not non-blocking": ("def f(x, y):\n    return x.to(y.device, non_blocking=False)\n",
                             "step/bad.py:2 copy to (in f)"),
    "cuda()": ("def f(x):\n    return x.cuda()\n", "step/bad.py:2 copy cuda (in f)"),
    "list factory": ("import torch\ndef f(xs, d):\n    return torch.tensor([x for x in xs], "
                     "device=d)\n", "step/bad.py:3 copy tensor (in f)"),
    "new_tensor": ("def f(x):\n    return x.new_tensor(2.0)\n",
                   "step/bad.py:2 copy new_tensor (in f)"),
    # implicit bool() (issue 40: parallel/data/topk.py)
    "not a bound tensor": ("import torch\ndef f(x):\n    o = (~torch.isfinite(x)).float()\n"
                           "    return x if not o else 0\n", "step/bad.py:4 sync bool (in f)"),
    "if a reduction": ("def f(x):\n    if x.any():\n        return 1\n",
                       "step/bad.py:2 sync bool (in f)"),
    "while a comparison": ("def f(x):\n    while x.norm() > 1:\n        x = x / 2\n",
                           "step/bad.py:2 sync bool (in f)"),
    "ternary on a torch test": ("import torch\ndef f(x):\n    return 1 if torch.isnan(x) "
                                "else 0\n", "step/bad.py:3 sync bool (in f)"),
    "assert": ("import torch\ndef f(x, y):\n    assert torch.equal(x, y)\n",
               "step/bad.py:3 sync bool (in f)"),
    "or": ("def f(x, y):\n    return y or x.sum()\n", "step/bad.py:2 sync bool (in f)"),
}


NONE = dict(off_step={}, syncs={}, factories={}, cpu={}, copies={})  # empty allow-lists
LIST_OF = {"factory": "factories", "cpu": "cpu", "sync": "syncs", "copy": "copies"}


@pytest.mark.parametrize("rule", PLANTED)
def test_each_rule_fails_on_a_planted_violation(tmp_path, rule):
    """One file per rule, one violation each: the scan names it; the entry that explains
    it silences it and counts as used (not stale)."""
    source, finding = PLANTED[rule]
    (tmp_path / "step").mkdir()
    (tmp_path / "step" / "bad.py").write_text(source)
    assert scan(tmp_path, ("step",), **NONE)[0] == [finding]
    kind, name = finding.split()[1:3]
    key = ("step/bad.py", "f") if kind == "cpu" else ("step/bad.py", "f", name)
    found, used = scan(tmp_path, ("step",), **(NONE | {LIST_OF[kind]: {key: "why"}}))
    assert not found and used == {(kind, key)}


def test_the_scan_leaves_alone_what_is_fine(tmp_path):
    """Not flagged: device=, *_like, new_*, a module constant for host memory (its own or
    imported), float of a plain number, a non-blocking move, a dtype cast, truth tests of
    host values (None, sizes, numbers), nested functions under their own name, OFF_STEP
    functions."""
    (tmp_path / "step").mkdir()
    (tmp_path / "step" / "wire.py").write_text("import torch\nHOST = torch.device('cpu')\n")
    (tmp_path / "step" / "ok.py").write_text(
        "import torch\nfrom step.wire import HOST\nWIRE = torch.device('cpu')\n\n"
        "def f(n, x, ratio, device, y=None):\n"
        "    a = torch.zeros(n, device=x.device), torch.zeros_like(x), x.new_empty(n)\n"
        "    b = torch.empty(n, device=WIRE), float(ratio), int(n), x.new_full((), n)\n"
        "    c = torch.tensor([ratio], device=HOST).pin_memory().to(device, non_blocking=True)\n"
        "    d = x.to(torch.float32) if y is None and x.numel() > 0 and n else x.shape[0] > 1\n"
        "    def setup():\n"
        "        return x.item()\n"
        "    return a, b, c, d\n")
    found, used = scan(tmp_path, ("step",), **(NONE | {"off_step": {("step/ok.py", "setup"):
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

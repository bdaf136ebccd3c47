"""Device discipline, checked on a CPU: no tensor factory in shardtrain/comm or
shardtrain/parallel without an explicit `device=`, so nothing a collective touches lands on
the CPU by accident when the group is NCCL's (a bug class a GPU would only show at run time).

`*_like` and `Tensor.new_*` forms take their argument's device and are not flagged. A
factory that cannot take a device, or a CPU tensor made on purpose, is in ALLOWED with the
reason; an entry that no longer matches a call is itself an error, so the list stays true.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import shardtrain
from shardtrain.comm import Communicator, CommLedger, build_mesh
from shardtrain.mesh import MeshShape

ROOT = Path(shardtrain.__file__).parent
SCANNED = ("comm", "parallel")
FACTORIES = frozenset({
    "empty", "zeros", "ones", "full", "tensor", "as_tensor", "arange", "linspace",
    "logspace", "eye", "randn", "rand", "randint", "randperm", "normal", "empty_strided",
    "frombuffer", "from_numpy", "from_file", "scalar_tensor", "sparse_coo_tensor"})

# (file name, enclosing function, factory) -> why it carries no device=.
ALLOWED = {
    ("state.py", "all_gather_objects", "frombuffer"):
        "wraps the serialised bytes in host memory (no device argument); copied onto the "
        "communicator's device before any collective",
    ("offload.py", "_map", "from_numpy"):
        "a memory-mapped NVMe file: host memory by nature (no device argument)",
    ("stage.py", "__init__", "empty"):
        "an empty placeholder buffer for the rotary tables: moved with the module "
        "(.to(device)) and filled by init_weights, never handed to a collective",
}


def _violations(root: Path = ROOT, folders: tuple[str, ...] = SCANNED
                ) -> tuple[list[str], set[tuple[str, str, str]]]:
    """(unexplained factory calls as 'path:line torch.name', the ALLOWED keys matched)."""
    found, used = [], set()
    for folder in folders:
        for file in sorted((root / folder).rglob("*.py")):
            tree = ast.parse(file.read_text())
            for func in [tree, *(n for n in ast.walk(tree)
                                 if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef))]:
                name = getattr(func, "name", "<module>")
                for call in _own_calls(func):
                    f = call.func
                    if not (isinstance(f, ast.Attribute) and f.attr in FACTORIES
                            and isinstance(f.value, ast.Name) and f.value.id == "torch"):
                        continue
                    if any(k.arg == "device" for k in call.keywords):
                        continue
                    key = (file.name, name, f.attr)
                    if key in ALLOWED:
                        used.add(key)
                    else:
                        found.append(f"{file.relative_to(root)}:{call.lineno} torch.{f.attr} "
                                     f"(in {name})")
    return found, used


def _own_calls(func: ast.AST):
    """The calls in `func`'s body, not in functions nested in it (those are scanned
    under their own name)."""
    stack = list(ast.iter_child_nodes(func))
    while stack:
        node = stack.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if isinstance(node, ast.Call):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def test_every_tensor_factory_in_comm_and_parallel_names_its_device():
    found, used = _violations()
    assert not found, ("tensor factories without device= (add device=..., or an ALLOWED "
                       "entry saying why):\n" + "\n".join(found))
    assert used == set(ALLOWED), f"ALLOWED entries that match no call: {set(ALLOWED) - used}"


def test_the_scan_sees_the_files_and_a_factory_without_device(tmp_path):
    """The scan is not vacuous: it reads both folders and flags a bare factory, also one
    inside a lambda or a nested function, and not one with device= or a *_like."""
    assert len(list((ROOT / "comm").rglob("*.py"))) > 5
    assert len(list((ROOT / "parallel").rglob("*.py"))) > 5
    (tmp_path / "comm").mkdir()
    (tmp_path / "comm" / "bad.py").write_text(
        "import torch\n\n"
        "def f(n, x):\n"
        "    ok = torch.zeros(n, device=x.device), torch.zeros_like(x)\n"
        "    g = lambda: torch.arange(n)\n"
        "    def inner():\n"
        "        return torch.empty(n)\n"
        "    return torch.zeros(n)\n")
    found, _ = _violations(tmp_path, ("comm",))
    assert sorted(found) == ["comm/bad.py:5 torch.arange (in f)",
                             "comm/bad.py:7 torch.empty (in inner)",
                             "comm/bad.py:8 torch.zeros (in f)"]


def test_a_communicator_knows_its_device_and_refuses_our_algorithms_on_cuda():
    mesh = build_mesh(MeshShape(), device=torch.device("cpu"))
    assert mesh.comm("dp").device == torch.device("cpu")
    with pytest.raises(ValueError, match="algorithm='ring'.*on CUDA use comm.algorithm=native"):
        Communicator(None, name="dp", ranks=[0], ledger=CommLedger(), algorithm="ring",
                     device="cuda")
    comm = Communicator(None, name="dp", ranks=[0], ledger=CommLedger(), device="cuda")
    assert comm.device.type == "cuda" and comm.algorithm == "native"

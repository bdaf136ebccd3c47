"""The intended dependencies between shardtrain's packages, stated once and checked.

Layers, each importing only from those below it (ARCHITECTURE.md):
cli/launch -> train -> parallel -> comm -> mesh, with model, data, config and the cost
model used from above. model imports nothing of parallel, comm or train; comm nothing of
parallel, train or plan; plan and cost are pure arithmetic: no torch, nothing of the
runtime. Every import counts, at module level or inside a function.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "shardtrain"

# package -> the shardtrain packages it may import (itself always).
ALLOWED: dict[str, set[str]] = {
    "__init__": set(),
    "config": set(),
    "cost": {"config"},
    "plan": {"cost", "config"},
    "mesh": {"config", "cost"},
    "model": {"config"},
    "data": {"config"},
    "quant": set(),
    "ckpt": {"config"},
    "comm": {"mesh", "cost", "config"},
    "parallel": {"comm", "mesh", "model", "config", "cost", "quant", "ckpt"},
    "train": {"parallel", "comm", "mesh", "model", "data", "config", "cost", "plan", "quant",
              "ckpt"},
    "launch": {"train", "mesh", "comm", "data", "config", "cost", "plan"},  # data: workers.py
    # fault.mode=replicas on one machine: a lighthouse and one launch per group
    "launch_replicas": {"launch", "train", "data", "config"},
    "bench": {"launch", "train", "comm", "mesh", "config", "cost", "plan"},
    "cli": {"launch", "launch_replicas", "train", "parallel", "comm", "mesh", "model", "data",
            "config", "cost", "plan", "bench", "quant", "ckpt"},
    "__main__": {"cli"},
}
NO_TORCH = {"config", "cost", "plan"}
# Modules of another package a package may import besides: the pipeline schedules as data
# and their simulator, pure Python (test_plan_model.py checks they import nothing else),
# which the runtime executes and the planner prices -- one simulator, no second closed form;
# and the attention kernel rule (model/sdpa_kernels.py, pure Python), which the model
# dispatches by and the planner charges by -- one rule.
MODULES: dict[str, set[str]] = {
    "plan": {*(f"shardtrain.parallel.pipeline.{m}" for m in ("schedules", "zero_bubble",
                                                              "simulate")),
             "shardtrain.model.sdpa_kernels"},
}


def imports_of(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def violations(root: Path = ROOT) -> list[str]:
    """'file: imports X (package P may import only ...)' for every arrow against the rules."""
    found = []
    for path in sorted(root.rglob("*.py")):
        package = path.relative_to(root).with_suffix("").parts[0]
        if package not in ALLOWED:
            found.append(f"{path}: package {package!r} has no entry in ALLOWED; add one")
            continue
        for module in sorted(imports_of(path)):
            head, _, rest = module.partition(".")
            if head == "shardtrain" and rest:
                target = rest.split(".")[0]
                if target != package and target not in ALLOWED[package] \
                        and module not in MODULES.get(package, ()):
                    found.append(f"{path.relative_to(root.parent)}: imports {module} ({package} "
                                 f"may import only {sorted(ALLOWED[package]) or 'nothing'})")
            elif head in ("torch", "numpy") and package in NO_TORCH:
                found.append(f"{path.relative_to(root.parent)}: imports {module} ({package} is "
                             "pure arithmetic: no torch or numpy)")
    return found


def test_import_directions():
    found = violations()
    assert not found, "imports against the intended directions:\n" + "\n".join(found)


def test_every_package_has_rules():
    packages = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    packages |= {p.stem for p in ROOT.glob("*.py") if p.stem != "__init__"}
    assert packages <= set(ALLOWED), f"packages without rules: {packages - set(ALLOWED)}"


def test_the_check_sees_an_arrow_against_the_rules(tmp_path):
    """A model module importing the comm layer, inside a function, is reported."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "bad.py").write_text(
        "def f():\n    from shardtrain.comm import Communicator\n    return Communicator\n")
    (tmp_path / "plan").mkdir()
    (tmp_path / "plan" / "heavy.py").write_text("import torch\n")
    found = violations(tmp_path)
    assert len(found) == 2 and "shardtrain.comm" in found[0] and "torch" in found[1]


def test_planner_imports_no_runtime():
    """plan/ and cost/ use only the standard library, shardtrain.config and cost/ (plan/ also
    itself, the pipeline schedules' data and simulator, which the runtime runs and the
    planner prices: pure Python, importing only each other, and the attention kernel rule): no torch, nothing else of the
    runtime, and cost/ nothing of plan/."""
    root = ROOT
    pipeline = tuple(f"shardtrain.parallel.pipeline.{m}"
                     for m in ("schedules", "zero_bubble", "simulate"))
    kernels = "shardtrain.model.sdpa_kernels"
    rules = {"plan": ("shardtrain.config", "shardtrain.plan", "shardtrain.cost", *pipeline,
                      kernels),
             "cost": ("shardtrain.config", "shardtrain.cost")}
    files = [(f, allowed) for folder, allowed in rules.items()
             for f in sorted((root / folder).glob("*.py"))]
    files += [(root / "parallel" / "pipeline" / f"{m.rsplit('.', 1)[1]}.py",
               ("shardtrain.parallel.pipeline",)) for m in pipeline]
    files += [(root / "model" / "sdpa_kernels.py", (kernels,))]
    assert len(files) > 10
    for file, allowed in files:
        for node in ast.walk(ast.parse(file.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert not name.startswith(("torch", "numpy")), (file.name, name)
                if name.startswith("shardtrain"):
                    assert name.startswith(allowed), (file.name, name)

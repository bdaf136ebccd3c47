"""Every package beyond torch, numpy, tokenizers and tqdm is imported where a feature needs
it, never at a module's top: a machine without one (the GPU machines have no `datasets` and
no network to install it: benchmarks/gpu/check.sh runs from the source tree) still imports
every module and trains on the default corpus. tests/test_gpu_check.py runs the GPU check's
dry run with `datasets` and the trackers absent."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "shardtrain"
AT_TOP = {"torch", "numpy", "tokenizers", "tqdm", "shardtrain"}  # what every run has


def _top_level_imports(tree: ast.Module):
    """(line, package) of the imports a module makes when it is imported: in its body,
    outside `try` (an ImportError handled is optional by construction) and functions."""
    for node in tree.body:
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        for name in names:
            yield node.lineno, name.split(".")[0]


def test_optional_packages_are_imported_lazily():
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, package in _top_level_imports(tree):
            if package not in AT_TOP and package not in sys.stdlib_module_names \
                    and package != "__future__":
                found.append(f"{path.relative_to(ROOT.parent)}:{line} imports {package}")
    assert not found, ("import these where the feature needs them (inside the function), "
                       "not at the module's top:\n" + "\n".join(found))

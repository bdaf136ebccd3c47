"""The static half of tests/test_device_discipline.py: the scan of step code (that file's
docstring states the rules; device_allowed.py holds the allow-lists)."""

from __future__ import annotations

import ast
from pathlib import Path

import shardtrain
from device_allowed import COPIES_ALLOWED, CPU_ALLOWED, FACTORIES_ALLOWED, OFF_STEP
from shardtrain.train.syncs import STEP_SYNCS

ROOT = Path(shardtrain.__file__).parent
SCANNED = ("comm", "parallel", "model", "train", "quant", "ckpt")
FACTORIES = frozenset({
    "empty", "zeros", "ones", "full", "tensor", "as_tensor", "arange", "linspace",
    "logspace", "eye", "randn", "rand", "randint", "randperm", "normal", "empty_strided",
    "frombuffer", "from_numpy", "from_file", "scalar_tensor", "sparse_coo_tensor"})
SYNCS = frozenset({"item", "tolist", "cpu", "numpy", "synchronize"})
REDUCTIONS = frozenset({"all", "any", "sum", "mean", "norm", "isfinite", "max", "min"})
# Factories from Python data: onto a device they copy from pageable host memory, blocking.
DATA_FACTORIES = frozenset({"tensor", "as_tensor"})
# torch functions whose result is a tensor a truth test would read (the implicit bool rule).
TENSOR_FUNCS = REDUCTIONS | frozenset({
    "isnan", "isinf", "equal", "allclose", "eq", "ne", "gt", "ge", "lt", "le", "where",
    "logical_and", "logical_or", "logical_not", "count_nonzero", "stack", "cat"})
# Tensor methods whose result lives on the host (no tensor follows from them).
HOST_RESULTS = SYNCS | frozenset({
    "numel", "nelement", "dim", "size", "stride", "element_size", "is_pinned",
    "is_contiguous", "data_ptr", "get_device", "is_floating_point", "is_complex"})


def _functions(tree: ast.Module):
    """(name, node) for the module body and every function, nested ones on their own."""
    yield "<module>", tree
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node.name, node


def _own_nodes(func: ast.AST):
    """The nodes of `func`'s body, not of functions nested in it (those are scanned under
    their own name); a lambda's are its enclosing function's."""
    stack = list(ast.iter_child_nodes(func))
    while stack:
        node = stack.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
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


def _tensor_valued(node: ast.AST, tensors: set[str]) -> bool:
    """Detectably a tensor, for the truth-test rule: a name bound to one in the function
    (`tensors`), a torch function or tensor method returning one, or an operation on one
    (a comparison, arithmetic, `~`, indexing)."""
    if isinstance(node, ast.Name):
        return node.id in tensors
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        f = node.func
        if _dotted(f.value) == "torch":
            return f.attr in TENSOR_FUNCS
        return f.attr in REDUCTIONS or (f.attr not in HOST_RESULTS
                                        and _tensor_valued(f.value, tensors))
    if isinstance(node, ast.Compare):  # `is`/`in` read no value
        return not any(isinstance(op, ast.Is | ast.IsNot | ast.In | ast.NotIn)
                       for op in node.ops) and any(
            _tensor_valued(n, tensors) for n in (node.left, *node.comparators))
    if isinstance(node, ast.BinOp):
        return _tensor_valued(node.left, tensors) or _tensor_valued(node.right, tensors)
    if isinstance(node, ast.UnaryOp) and not isinstance(node.op, ast.Not):
        return _tensor_valued(node.operand, tensors)
    if isinstance(node, ast.Subscript):
        return _tensor_valued(node.value, tensors)
    return False


def _tensor_names(nodes: list[ast.AST]) -> set[str]:
    """Names a function binds to a tensor-valued expression (to a fixed point: a name bound
    from another such name counts)."""
    tensors: set[str] = set()
    binds = [(t.id, n.value) for n in nodes if isinstance(n, ast.Assign | ast.AnnAssign)
             and n.value is not None for t in (n.targets if isinstance(n, ast.Assign)
                                              else [n.target]) if isinstance(t, ast.Name)]
    while new := {name for name, value in binds
                  if name not in tensors and _tensor_valued(value, tensors)}:
        tensors |= new
    return tensors


def _truth_tests(node: ast.AST) -> list[ast.AST]:
    """The expressions `node` reads as a truth value (`if`, `while`, `x if t else y`,
    `assert`, `not`, `and`/`or`, a comprehension's `if`): each a Tensor.__bool__."""
    if isinstance(node, ast.If | ast.While | ast.IfExp | ast.Assert):
        return [node.test]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return [node.operand]
    if isinstance(node, ast.BoolOp):
        return list(node.values)
    if isinstance(node, ast.comprehension):
        return list(node.ifs)
    return []


def _device_like(node: ast.AST, host: set[str]) -> bool:
    """A device argument: `device`, `x.device`, torch.device(...), a device string, or a
    module constant naming host memory."""
    dotted = _dotted(node)
    return (dotted.rsplit(".", 1)[-1].endswith("device") or dotted in host
            or (isinstance(node, ast.Call) and _dotted(node.func) == "torch.device")
            or (isinstance(node, ast.Constant) and isinstance(node.value, str)
                and node.value.split(":")[0] in ("cuda", "meta")))


def _non_blocking(call: ast.Call) -> bool:
    return any(k.arg == "non_blocking" and not (isinstance(k.value, ast.Constant)
                                                and not k.value.value) for k in call.keywords)


def _copies(call: ast.Call, name: str | None, host: set[str]) -> list[tuple[str, str]]:
    """The copy rule: a factory from Python data onto a device (torch.tensor, as_tensor,
    Tensor.new_tensor), or a move between devices (`.to(device)`, `.cuda()`) that does not
    say non_blocking=True: each copies through pageable host memory and blocks the host.
    (A move to a literal CPU is the cpu rule's.)"""
    f = call.func
    device = next((k.value for k in call.keywords if k.arg == "device"), None)
    if name in DATA_FACTORIES and device is not None and _dotted(device) not in host:
        return [("copy", name)]
    if not isinstance(f, ast.Attribute) or _non_blocking(call):
        return []
    target = device if device is not None else call.args[0] if call.args else None
    moves = f.attr == "cuda" or (f.attr == "to" and target is not None and (
        device is not None or _device_like(target, host)) and not _is_cpu(target))
    return [("copy", f.attr)] if moves or f.attr == "new_tensor" else []


def _findings(call: ast.Call, bare: dict[str, str], func_name: str, host: set[str],
              tensors: set[str]) -> list[tuple[str, str]]:
    """(rule, name) for each rule `call` breaks: factory, copy, cpu, sync."""
    f, out = call.func, []
    name = f.attr if isinstance(f, ast.Attribute) and _dotted(f.value) == "torch" else \
        bare.get(f.id) if isinstance(f, ast.Name) else None
    if name in FACTORIES and not any(k.arg == "device" for k in call.keywords):
        out.append(("factory", name))
    out += _copies(call, name, host)
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
    if isinstance(f, ast.Name) and f.id in ("bool", "float", "int") and call.args and (
            _tensor_expr(call.args[0]) or _tensor_valued(call.args[0], tensors)):
        out.append(("sync", f.id))
    return out


def _host_constants(tree: ast.Module, elsewhere: set[str] = frozenset()) -> set[str]:
    """Module constants naming host memory (the sanctioned form: module doc), the module's
    own and those it imports (`elsewhere`: every scanned module's own)."""
    own = {t.id for n in tree.body if isinstance(n, ast.Assign) and _is_cpu(n.value)
           for t in n.targets if isinstance(t, ast.Name)}
    return own | {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom)
                  for a in n.names if a.name in elsewhere}


def scan(root: Path = ROOT, folders: tuple[str, ...] = SCANNED, *, off_step=OFF_STEP,
         syncs=STEP_SYNCS, factories=FACTORIES_ALLOWED, cpu=CPU_ALLOWED, copies=COPIES_ALLOWED):
    """(unexplained findings as 'path:line rule name (in function)', the allow-list keys
    that matched something)."""
    found, used = [], set()
    lists = {"off": off_step, "sync": syncs, "factory": factories, "cpu": cpu, "copy": copies}
    trees = {file.relative_to(root).as_posix(): ast.parse(file.read_text())
             for folder in folders for file in sorted((root / folder).rglob("*.py"))}
    elsewhere = set().union(*map(_host_constants, trees.values()))
    for rel, tree in trees.items():
        bare = {a.asname or a.name: a.name for n in ast.walk(tree)  # local -> torch's
                if isinstance(n, ast.ImportFrom) and n.module == "torch"
                for a in n.names if a.name in FACTORIES}
        host = _host_constants(tree, elsewhere)
        for func_name, func in _functions(tree):
            nodes = list(_own_nodes(func))
            tensors = _tensor_names(nodes)
            hits = [(node, hit) for node in nodes if isinstance(node, ast.Call)
                    for hit in _findings(node, bare, func_name, host, tensors)]
            hits += [(test, ("sync", "bool")) for node in nodes  # an implicit bool()
                     for test in _truth_tests(node) if _tensor_valued(test, tensors)]
            for node, (rule, name) in hits:
                own = (rel, func_name) if rule == "cpu" else (rel, func_name, name)
                keys = [("off", (rel, "*")), ("off", (rel, func_name)), (rule, own)]
                hit = [(kind, key) for kind, key in keys if key in lists[kind]]
                if hit:
                    used.update(hit)
                else:
                    found.append(f"{rel}:{node.lineno} {rule} {name} (in {func_name})")
    return found, used

"""A chunk's backward in two parts (Qi et al. 2024, "Zero Bubble Pipeline Parallelism",
arXiv 2401.10241, sec. 2): B, the gradient with respect to the chunk's input, which the
previous virtual stage waits for; W, the weights' gradients, run later from what B kept.

B walks the autograd graph from the output. The nodes on a path to the input form the input
path; an intermediate is a node of it with an edge off the path that leads to weights.
B hooks the intermediates, computes the input gradient with the graph kept (retain_graph),
and the hooks capture the gradient flowing into each. W restarts autograd from the
intermediates with those gradients, once per group of weights that share intermediates
(groups whose intermediates reach none of each other share one call: `_calls`), and stops
at those weights: autograd then leaves the input path (which leads only to other calls'
weights) alone, and the weights' gradients accumulate as a full backward's would (the same
ops, so the same numbers). Data parallelism's and ZeRO's
post-accumulate-grad hooks fire then: a weight's reduction waits for its W. While W runs,
each intermediate's incoming gradient is replaced by the captured one, so a gradient that
also reaches it from an earlier intermediate is not counted twice.

The kept graph holds every tensor the forward saved until W (the schedule simulator counts
a micro-batch's activations until its W). Recomputation (torch.utils.checkpoint,
non-reentrant) recomputes in B what the input path unpacks and again in W what the weights'
part does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch.autograd.graph import GradientEdge, Node

if TYPE_CHECKING:
    from shardtrain.parallel.pipeline.schedules import Action

# torch's private engine handle (what torch.autograd.backward calls; a torch release that
# moves it fails here at import, and the pipeline parity tests say so). Its arguments:
# (tensors, grad_tensors, keep_graph, create_graph, inputs, allow_unreachable, accumulate_grad)
_ENGINE = torch.autograd.Variable._execution_engine


def _node(t: torch.Tensor) -> Node | None:
    """t's autograd node; for a leaf its AccumulateGrad (reached through a view)."""
    if t.grad_fn is not None:
        return t.grad_fn
    return t.view_as(t).grad_fn.next_functions[0][0] if t.requires_grad else None


@dataclass
class Kept:
    """What B leaves for W: per autograd call (`_calls`), its intermediates, its weights
    and whether the intermediates' gradients are clamped; the gradients that flowed into
    the intermediates."""
    groups: list[tuple[list[Node], list[torch.Tensor], bool]]
    grads: dict[Node, tuple] = field(default_factory=dict)


def input_backward(out: torch.Tensor, grad: torch.Tensor | None, x: torch.Tensor) -> Kept:
    """B: x.grad = d(out . grad)/dx (out a scalar loss when grad is None); the graph kept."""
    target = _node(x)
    order = _topological(_node(out))  # every node from the output, parents first
    children = {n: [m for m, _ in n.next_functions if m is not None] for n in order}
    on_path = {target}
    for n in reversed(order):  # children first
        if any(m in on_path for m in children[n]):
            on_path.add(n)
    below: dict[Node, set[Node]] = {}  # off the path: the weights a node leads to
    for n in reversed(order):
        if n not in on_path:
            weight = hasattr(n, "variable") and n.variable.requires_grad
            below[n] = ({n} if weight else set()).union(*(below[m] for m in children[n]))
    owner: dict[Node, Node] = {}  # union-find over weights: intermediates shared join groups

    def find(w: Node) -> Node:
        while owner.setdefault(w, w) is not w:
            w = owner[w]
        return w

    reached: dict[Node, set[Node]] = {}  # intermediate -> the weights off its edges
    for n in order:
        if n in on_path and n is not target:
            weights = set().union(*(below[m] for m in children[n] if m not in on_path))
            if weights:
                reached[n] = weights
                first, *rest = (find(w) for w in weights)
                for w in rest:
                    owner[w] = first
    groups: dict[Node, tuple[list[Node], set[Node]]] = {}
    for n, weights in reached.items():
        nodes, ws = groups.setdefault(find(next(iter(weights))), ([], set()))
        nodes.append(n)
        ws.update(weights)
    kept = Kept(_calls(list(groups.values()), _levels(order, children, on_path, reached)))
    handles = [n.register_prehook(_capture(kept, n)) for n in reached]
    try:
        (x.grad,) = torch.autograd.grad(out, x, grad, retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    return kept


def _levels(order: list[Node], children: dict[Node, list[Node]], on_path: set[Node],
            reached: dict[Node, set[Node]]) -> dict[Node, int]:
    """Each intermediate's level: the most intermediates on a path from the output above
    it. One intermediate that reaches another through the input path sits above it, so
    intermediates of one level reach none of each other."""
    above = {n: 0 for n in order}
    for n in order:  # parents first
        if n in on_path:
            below = above[n] + (n in reached)
            for m in children[n]:
                if m in on_path:
                    above[m] = max(above[m], below)
    return {n: above[n] for n in reached}


def _calls(groups: list[tuple[list[Node], set[Node]]], level: dict[Node, int]
           ) -> list[tuple[list[Node], list[torch.Tensor], bool]]:
    """W's autograd calls. Groups of one intermediate and one level share a call: started
    together from intermediates that reach none of each other, autograd runs only their
    own nodes towards their weights (none of the input path), so one traversal does the
    work of several (a Llama block's 9 groups in 6 calls: w2 | w1 w3 | the MLP's norm |
    wo | wq wk wv | the attention's norm). A group of several intermediates, one above
    another, keeps its own call (weight_backward clamps its gradients)."""
    shared: dict[int, tuple[list[Node], list[Node]]] = {}
    alone = []
    for nodes, ws in groups:
        if len(nodes) > 1:
            alone.append((nodes, [w.variable for w in ws], True))
            continue
        into = shared.setdefault(level[nodes[0]], ([], [], False))
        into[0].append(nodes[0])
        into[1].extend(w.variable for w in ws)
    return [*shared.values(), *alone]


def weight_backward(kept: Kept) -> None:
    """W: the weights' gradients, accumulated into .grad (their hooks fire)."""
    for k, (nodes, weights, clamp) in enumerate(kept.groups):
        edges, grads = [], []
        for n in nodes:
            for i, g in enumerate(kept.grads.get(n, ())):
                if g is not None:
                    edges.append(GradientEdge(n, i))
                    grads.append(g)
        handles = [n.register_prehook(lambda _, saved=kept.grads[n]: saved)
                   for n in nodes if clamp and n in kept.grads]
        try:
            if edges:
                # torch.autograd.backward's own engine call, without its per-call argument
                # checks: B captured these gradients from this graph, so they fit (the
                # checks cost about 30 us a call). The graph stays for the next calls; the
                # last (or dropping the output) frees it. Gradients accumulate into .grad
                # (accumulate_grad), and their hooks fire.
                _ENGINE.run_backward(tuple(edges), tuple(grads), k < len(kept.groups) - 1,
                                     False, tuple(weights), True, True)
        finally:
            for h in handles:
                h.remove()
    kept.grads.clear()


def _capture(kept: Kept, n: Node):
    def hook(grad_outputs: tuple) -> None:
        kept.grads[n] = grad_outputs
    return hook


def _topological(root: Node) -> list[Node]:
    """The nodes reachable from root, each before every node it leads to."""
    post, seen, stack = [], {root}, [(root, iter(root.next_functions))]
    while stack:
        n, it = stack[-1]
        for m, _ in it:
            if m is not None and m not in seen:
                seen.add(m)
                stack.append((m, iter(m.next_functions)))
                break
        else:
            post.append(n)
            stack.pop()
    return post[::-1]


def split_keys(actions: list[Action]) -> set[tuple[int, int]]:
    """The (micro-batch, chunk)s whose backward runs split: those with a W, except where the
    W is the very next action after its B. There one whole backward computes the same
    gradients without the split's cost (docs/pipeline.md); the W is an empty slot."""
    keys = {(a.mb, a.chunk) for a in actions if a.op == "W"}
    return keys - {(a.mb, a.chunk) for a, b in zip(actions, actions[1:])
                   if a.op == "B" and b.op == "W" and (a.mb, a.chunk) == (b.mb, b.chunk)}

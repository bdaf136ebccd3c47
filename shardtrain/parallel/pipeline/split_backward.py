"""A chunk's backward in two parts (Qi et al. 2024, "Zero Bubble Pipeline Parallelism",
arXiv 2401.10241, sec. 2): B, the gradient with respect to the chunk's input, which the
previous virtual stage waits for; W, the weights' gradients, run later from what B kept.

B walks the autograd graph from the output: the nodes on a path to the input form the
input path. Those of them that also lead to a weight are the intermediates: B hooks them,
computes the input gradient with the graph kept (retain_graph), and the hooks capture the
gradient flowing into each intermediate. W starts autograd from the intermediates with
those gradients and stops at the weights: their gradients accumulate as a full backward's
would (the same ops, so the same numbers), and the post-accumulate-grad hooks of data
parallelism and ZeRO fire then -- a weight's reduction waits for its W. While W runs, each
intermediate's incoming gradient is replaced by the captured one, so a gradient that also
reaches it from an earlier intermediate is not counted twice.

The kept graph holds every tensor the forward saved until W (the schedule simulator counts
a micro-batch's activations until its W). Recomputation (torch.utils.checkpoint,
non-reentrant) recomputes in B what the input path unpacks and again in W what the weights'
part does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node


def _node(t: torch.Tensor) -> Node | None:
    """t's autograd node; for a leaf its AccumulateGrad (reached through a view)."""
    if t.grad_fn is not None:
        return t.grad_fn
    return t.view_as(t).grad_fn.next_functions[0][0] if t.requires_grad else None


@dataclass
class Kept:
    """What B leaves for W: the intermediates and the gradients that flowed into them."""
    intermediates: list[Node]
    grads: dict[Node, tuple] = field(default_factory=dict)
    weights: list[torch.Tensor] = field(default_factory=list)


def input_backward(out: torch.Tensor, grad: torch.Tensor | None, x: torch.Tensor) -> Kept:
    """B: x.grad = d(out . grad)/dx (out a scalar loss when grad is None); the graph kept."""
    root, target = _node(out), _node(x)
    children: dict[Node, list[Node]] = {}
    order, stack, seen = [], [root], {root}
    while stack:  # every node reachable from the output
        n = stack.pop()
        order.append(n)
        children[n] = [m for m, _ in n.next_functions if m is not None]
        for m in children[n]:
            if m not in seen:
                seen.add(m)
                stack.append(m)
    weights = [n for n in order if n is not target and hasattr(n, "variable")
               and n.variable.requires_grad]
    to_input = _reaching(order, children, {target})
    to_weight = _reaching(order, children, set(weights))
    kept = Kept([n for n in order if n in to_input and n in to_weight and n is not target],
                weights=[n.variable for n in weights])
    handles = [n.register_prehook(_capture(kept, n)) for n in kept.intermediates]
    try:
        (x.grad,) = torch.autograd.grad(out, x, grad, retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    return kept


def weight_backward(kept: Kept) -> None:
    """W: the weights' gradients, accumulated into .grad (their hooks fire)."""
    edges, grads = [], []
    for n in kept.intermediates:
        for i, g in enumerate(kept.grads.get(n, ())):
            if g is not None:
                edges.append(GradientEdge(n, i))
                grads.append(g)
    handles = [n.register_prehook(lambda _, saved=kept.grads.get(n): saved)
               for n in kept.intermediates if n in kept.grads]
    try:
        if edges:
            torch.autograd.backward(edges, grads, inputs=kept.weights)
    finally:
        for h in handles:
            h.remove()
    kept.grads.clear()


def _capture(kept: Kept, n: Node):
    def hook(grad_outputs: tuple) -> None:
        kept.grads[n] = grad_outputs
    return hook


def _reaching(order: list[Node], children: dict[Node, list[Node]], goals: set[Node]) -> set[Node]:
    """The nodes from which some goal is reachable (goals included)."""
    reach = set(goals)
    changed = True
    while changed:  # the graph is a DAG; a few sweeps in reverse discovery order settle it
        changed = False
        for n in reversed(order):
            if n not in reach and any(m in reach for m in children[n]):
                reach.add(n)
                changed = True
    return reach

"""PipeDream-2BW: asynchronous pipeline training with two weight versions (Narayanan et al.,
"Memory-Efficient Pipeline-Parallel DNN Training", ICML 2021, sec. 3.1).

The paper's update rule (its "2BW": double-buffered weight updates). A batch is m
micro-batches, m >= pp (the paper's m >= d); each stage applies one optimizer update per
batch, after that batch's last backward on the stage, and batch t's micro-batches -- their
forwards and their backwards, on every stage -- use weight version W(t-1):

    W(t+1) = W(t) - lr * grad f(W(t-1))          (with W(-1) = W(0): the warm-up)

so the gradient applied at each update is one version old. At any moment a stage holds two
versions: W(t) (being updated) and W(t-1) (the one in-flight micro-batches of batch t
computed with and will run their backward with: weight stashing); when W(t+1) is made,
W(t-1) is no longer read and its buffer takes the new version (double buffering). The
memory cost is one extra copy of the stage's trainable parameters (`stash_bytes`).

The schedule (`pipedream_2bw`): 1F1B's order over consecutive batches with no flush between
them -- batch t + 1's forwards fill the slots where 1F1B would drain batch t -- so in
steady state no rank idles; the only idle time is the first batch's fill and the last
one's drain, the same (p - 1)(F + B) per rank however many batches run
(tests/test_pipedream_2bw.py; docs/pipeline.md). Micro-batch n of the drawing is
micro-batch n % m of batch n // m.

A checkpoint holds both versions (the stash as `stash/<name>`, strategy.py), so a resumed
run computes its next step on the version the uninterrupted run would; one written by
another schedule holds none, and the resumed run starts with W(t-1) = W(t), as at step 0.

The runtime (runtime.py): every micro-batch of batch t runs on W(t-1) (`WeightVersions`),
so its numbers are those of the schedule above; each step's micro-batches run through the
executor in 1F1B's order (`EXECUTED`), the step's last backward before its update. The
executor does not yet carry batch t + 1's forwards into batch t's drain (the trainer steps
one batch at a time): the run computes exactly the 2BW numbers, but with 1F1B's per-step
fill and drain in its wall time.
"""

from __future__ import annotations

from contextlib import contextmanager
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from shardtrain.parallel.pipeline.schedules import Steps, one_f_one_b

NAME = "pipedream-2bw"
BATCHES = 2  # consecutive batches drawn and simulated: the step boundary between them shows
EXECUTED = "1f1b"  # the order the executor runs each step's micro-batches in (module doc)


def check(pp: int, m: int) -> None:
    """(Config validation says the same to users, naming the fields, before launch.)"""
    if m < pp:
        raise ValueError(f"PipeDream-2BW needs at least pp micro-batches per batch, so that "
                         f"one version delay covers the pipeline (got pp={pp}, m={m})")


def pipedream_2bw(pp: int, m: int, batches: int = BATCHES) -> Steps:
    """`batches` batches of m micro-batches each, in 1F1B order with no flush between them:
    micro-batch n = t m + i is micro-batch i of batch t."""
    check(pp, m)
    return one_f_one_b(pp, batches * m)


def versions_live(order: Sequence[tuple[str, int]], m: int) -> int:
    """The most weight versions a rank's compute order (op, micro-batch) needs at once
    under the 2BW rule: batch t computes on W(t-1) and the update to W(t+1) follows batch
    t's last backward, so before it the rank holds W(t) and the versions of the batches in
    flight. Raises if a batch starts before its version exists (batch t + 1's first
    forward before batch t - 1's last backward)."""
    done: dict[int, int] = {}  # batch -> backwards done
    updates, peak = 0, 0  # updates made: the newest version is W(updates)
    started: set[int] = set()
    for op, mb in order:
        t = mb // m
        if op == "F" and t not in started:
            if t - 1 > updates:
                raise ValueError(f"batch {t} starts before W({t - 1}) exists")
            started.add(t)
        if op == "B":
            done[t] = done.get(t, 0) + 1
            if done[t] == m:
                updates += 1
        in_flight = {b for b in started if done.get(b, 0) < m}
        peak = max(peak, len({updates} | {max(b - 1, 0) for b in in_flight}))
    return peak


def stash_bytes(trainable_params: int, bytes_per_param: int) -> int:
    """The second weight version's bytes on one rank: a copy of its trainable parameters
    (in the dtype the forward reads them in)."""
    return trainable_params * bytes_per_param


class WeightVersions:
    """A stage's two weight versions: the module's parameters hold W(t), which the optimizer
    updates; `stash` holds W(t-1), which batch t computes with. Only trainable parameters
    are versioned (frozen ones, LoRA's base weights, never change)."""

    def __init__(self, chunks: Sequence[nn.Module]):
        self.chunks = list(chunks)
        self.params: list[nn.Parameter] = []
        self.stash: list[torch.Tensor] | None = None  # taken at the first step (below)

    def take(self) -> None:
        """The stash, W(-1) = W(0), once the parameters are filled (initialised or loaded:
        only after the pipeline is built)."""
        if self.stash is None:
            # a pipeline chunk registers no parameters: its stage owns them (stage.py)
            owners = {id(o): o for o in (getattr(c, "stage", c) for c in self.chunks)}
            self.params = [p for o in owners.values() for p in o.parameters() if p.requires_grad]
            self.stash = [p.detach().clone() for p in self.params]

    def stashed(self, named: dict[str, nn.Parameter], skip: set[str]) -> dict[str, torch.Tensor]:
        """{parameter name: its stashed version} (`named`: the stage's parameters by name;
        `skip`: aliases of a tied one). A checkpoint holds it beside W(t): the version the
        next step computes on (strategy.py)."""
        self.take()
        at = {id(p): s for p, s in zip(self.params, self.stash)}
        return {n: at[id(p)] for n, p in named.items() if id(p) in at and n not in skip}

    @property
    def nbytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self.stash or [])

    @contextmanager
    def computing(self) -> Iterator[None]:
        """Run batch t on W(t-1): the parameters hold it inside the block (their gradients
        are then grad f(W(t-1))); on exit they hold W(t) again, ready for the update, and the
        stash holds W(t) too -- batch t + 1's version, kept before the update overwrites
        the parameters with W(t+1)."""
        self.take()
        with torch.no_grad():
            for p, s in zip(self.params, self.stash):  # swap, one tensor's copy at a time
                current = p.detach().clone()
                p.copy_(s)
                s.copy_(current)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, s in zip(self.params, self.stash):
                    p.copy_(s)

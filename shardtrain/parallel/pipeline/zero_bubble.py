"""The schedules that split each backward into B (input gradient) and W (weight gradient)
and move W into what would be idle time (schedules.py: the actions, the placement).

- ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", arXiv 2401.10241, sec. 3.1):
  1F1B's order of forwards and input-gradient backwards, with stage s deferring up to
  pp - 1 - s of its W passes and running them where 1F1B's cool-down waits for gradients.
  Bubble (p-1)(F+B-2W) in DualPipe's notation (B a whole backward, W its weight part).
- ZB-V (same paper, sec. 6): two chunks per rank in a V (chunk 0 of rank s is virtual
  stage s, chunk 1 is 2p-1-s), so the first and last virtual stage are on rank 0 and a
  rank's warm-up is filled with the forwards of its second chunk.
- DualPipeV (DeepSeek-AI 2024, the DeepSeek-V3 technical report arXiv 2412.19437, sec.
  3.2.1, cut to a V): the same placement; in its main phase each step pairs one
  micro-batch's forward on one chunk with another's full backward on the other chunk,
  independent of each other, so a device can overlap the two (and one's communication
  with the other's compute). Part of the backwards are split, their W run at the end.

A schedule's steps are tuples of one compute, or two for DualPipeV's overlapped pairs
(simulate.py costs a pair F&B).
"""

from __future__ import annotations

from collections import deque

from shardtrain.parallel.pipeline.schedules import Action, Steps


def zb_h1(pp: int, m: int) -> Steps:
    """Stage s: 1F1B's pp - 1 - s warm-up forwards, then F B pairs, each B followed by the
    oldest pending W once s of them are pending; the cool-down's B W; the s held-back W
    last. The later a stage, the more W it defers: they fill the waits of its cool-down
    while the input gradients (B only) hurry to the first stages. Every stage then holds at
    most pp micro-batches between F and W -- 1F1B's stage-0 peak."""
    out = []
    for s in range(pp):
        warmup = min(pp - s - 1, m)
        order = [(Action("F", i, 0),) for i in range(warmup)]
        pending: deque[int] = deque()
        for i in range(m):
            if warmup + i < m:  # steady state; after it the cool-down's backwards
                order.append((Action("F", warmup + i, 0),))
            order.append((Action("B", i, 0),))
            pending.append(i)
            if len(pending) > s:
                order.append((Action("W", pending.popleft(), 0),))
        order += [(Action("W", i, 0),) for i in pending]
        out.append(order)
    return out


def zbv(pp: int, m: int) -> Steps:
    """Rank r: 2(p-r)-1 forwards of chunk 0, r pairs of forwards (chunk 1, chunk 0), p-r
    rounds of F B W on chunk 1, then the steady F B W on chunk 0 and on chunk 1, and the
    cool-down's input gradients before the remaining weight gradients. Built for at least
    2p-1 micro-batches (the pipeline full once); the actions of micro-batches past m are
    dropped."""
    n = max(2 * pp - 1, m)
    out = []
    for r in range(pp):
        order: list[Action] = []
        count = {(op, c): 0 for op in "FBW" for c in (0, 1)}

        def add(op: str, c: int) -> None:
            order.append(Action(op, count[(op, c)], c))
            count[(op, c)] += 1

        for _ in range(2 * (pp - r) - 1):
            add("F", 0)
        for _ in range(r):
            add("F", 1)
            add("F", 0)
        for _ in range(pp - r):
            add("F", 1), add("B", 1), add("W", 1)
        while count[("F", 0)] < n or count[("F", 1)] < count[("F", 0)]:
            if count[("F", 0)] < n:
                add("F", 0)
            add("B", 0), add("W", 0)
            add("F", 1), add("B", 1), add("W", 1)
        for _ in range(r):
            add("B", 0), add("B", 1)
        for _ in range(pp - r):
            add("B", 0), add("W", 0)
        while count[("W", 1)] < count[("B", 1)]:
            add("W", 1)
        while count[("W", 0)] < count[("B", 0)]:
            add("W", 0)
        out.append([(a,) for a in order if a.mb < m])
    return out


def dualpipev(pp: int, m: int) -> Steps:
    """Rank r, in eight phases (the counts make every F, B and W of both chunks appear
    once; m >= 2p): forwards of chunk 0; pairs of forwards (chunk 0, chunk 1); B W F on
    chunk 1 (split backwards); the main phase of overlapped pairs F0&B1, F1&B0; B1 then
    F1&B0; the last backwards of both chunks (split from the middle on); W and B0; the
    remaining W. The deferred W run oldest first."""
    check_dualpipev(pp, m)
    out = []
    for r in range(pp):
        steps: list[tuple[Action, ...]] = []
        count = {(op, c): 0 for op in "FB" for c in (0, 1)}
        deferred: deque[Action] = deque()

        def act(op: str, c: int, split: bool = False) -> Action:
            a = Action(op, count[(op, c)], c)
            count[(op, c)] += 1
            if split:
                deferred.append(Action("W", a.mb, c))
            return a

        def one(op: str, c: int, split: bool = False) -> None:
            steps.append((act(op, c, split),))

        def pair(forward: int, backward: int) -> None:  # independent: overlappable
            steps.append((act("F", forward), act("B", backward)))

        def weight() -> None:
            if deferred:
                steps.append((deferred.popleft(),))

        for _ in range(2 * (pp - r - 1)):
            one("F", 0)
        for _ in range(r + 1):
            one("F", 0), one("F", 1)
        for _ in range(pp - r - 1):
            one("B", 1, split=True), weight(), one("F", 1)
        for i in range(m - 2 * pp + r + 1):
            if i == 0 and r == pp - 1:  # the turn of the V: no partner yet to overlap
                one("F", 0), one("B", 1)
            else:
                pair(0, 1)
            pair(1, 0)
        for _ in range(pp - r - 1):
            one("B", 1), pair(1, 0)
        split = False
        for i in range(r + 1):
            split = split or (i == (r + 1) // 2 and r % 2 == 1)
            one("B", 1, split)
            split = split or (i == (r + 1) // 2 and r % 2 == 0)
            one("B", 0, split)
        for _ in range(pp - r - 1):
            weight(), one("B", 0, split=True)
        while deferred:
            weight()
        out.append(steps)
    return out


def check_dualpipev(pp: int, m: int) -> None:
    """(Config validation says the same to users, naming the fields, before launch.)"""
    if pp < 2 or m < 2 * pp:
        raise ValueError(f"dualpipev needs pp >= 2 and at least 2 pp micro-batches, one per "
                         f"virtual stage (got pp={pp}, m={m})")

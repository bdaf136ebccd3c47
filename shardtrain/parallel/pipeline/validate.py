"""Prove a schedule sound before it runs.

Checks, for every rank (stage) of a schedule built for (pp, m, v) and a placement:
1. completeness: every (micro-batch, chunk) is forwarded exactly once and (with backward)
   backwarded exactly once, weight-gradient passes (W) at most once each, and each of them
   has exactly the transfers its position in the pipeline needs (see schedules.py),
   nothing else;
2. local order: an input is received before its forward, an output sent after it, a
   backward comes after its forward and after its gradient's receive, the input gradient
   is sent after the backward, and a W comes after its B;
2b. memory: with `bound`, no rank holds more (micro-batch, chunk)s between F and the end of
   their backward (schedules.peak_in_flight) than the bound;
3. matching and deadlock freedom: the ranks are simulated with the executor's semantics
   (consecutive transfers posted as one batch, a batch done once every transfer in it has
   met its peer's; no buffering). On each (sender, receiver, kind) channel the k-th send
   must carry what the k-th receive expects (same micro-batch, same pipeline boundary);
   a state where no rank can move while some have actions left is a deadlock. Under the V
   placement (ZB-V, DualPipeV) and ZB-H1 sends are eager (schedules.py): a send completes
   once posted, a receive once its peer's send is posted.
"""

from __future__ import annotations

from collections import Counter

from shardtrain.parallel.pipeline.schedules import (COMPUTE, TRANSFERS, Action, Placement,
                                                    Schedule, peak_in_flight)


class ScheduleError(ValueError):
    """A schedule that would compute the wrong thing, mismatch messages or hang."""


def validate(schedule: Schedule, pp: int, m: int, v: int = 1, *, backward: bool = True,
             shape: str = "loop", bound: int | None = None, eager: bool = False) -> None:
    """`shape`, `eager`: the placement (schedules.Placement); `bound`: the most
    (micro-batch, chunk)s a rank may hold between forward and finished backward."""
    if len(schedule) != pp:
        raise ScheduleError(f"the schedule has {len(schedule)} ranks, expected pp={pp}")
    place = Placement(pp, v, shape, eager)
    for s, actions in enumerate(schedule):
        _check_rank(s, actions, place, m, backward)
        if bound is not None and peak_in_flight(actions) > bound:
            raise ScheduleError(f"rank {s} holds {peak_in_flight(actions)} micro-batch chunks "
                                f"in flight, above the schedule's bound of {bound}")
    _simulate(schedule, place)


def _needed(s: int, place: Placement, m: int, backward: bool) -> Counter:
    need: Counter = Counter()
    for c in range(place.v):
        for i in range(m):
            ops = ["F"] + ["recv_act"] * place.crosses(s, c, "F") \
                + ["send_act"] * place.sends(s, c, "F")
            if backward:
                ops += ["B"] + ["recv_grad"] * place.crosses(s, c, "B") \
                    + ["send_grad"] * place.sends(s, c, "B")
            need.update(Action(op, i, c) for op in ops)
    return need


# Action op -> the ops of the same (micro-batch, chunk) that must come before it.
_AFTER = {"F": ("recv_act",), "send_act": ("F",), "B": ("F", "recv_grad"), "send_grad": ("B",),
          "W": ("B",), "recv_act": (), "recv_grad": ()}


def _check_rank(s: int, actions: list[Action], place: Placement, m: int, backward: bool) -> None:
    have, need = Counter(actions), _needed(s, place, m, backward)
    # A W is optional (the B before it then computes the input gradient only), once at most.
    need.update(a for a in set(actions) if a.op == "W" and Action("B", a.mb, a.chunk) in need)
    if have != need:
        extra, missing = sorted(have - need, key=repr), sorted(need - have, key=repr)
        raise ScheduleError(f"rank {s}: " + "; ".join(
            part for part in (f"missing {missing[:4]}" if missing else "",
                              f"unexpected or repeated {extra[:4]}" if extra else "") if part))
    done: set[Action] = set()
    for a in actions:
        for before in _AFTER[a.op]:
            prior = Action(before, a.mb, a.chunk)
            if prior in need and prior not in done:
                raise ScheduleError(f"rank {s}: {a} runs before {prior}")
        done.add(a)


def _message(s: int, a: Action, place: Placement
             ) -> tuple[tuple[int, int, str], tuple[int, int]]:
    """((sender, receiver, kind), (micro-batch, boundary)) of a transfer on stage s. Boundary
    g is the edge from virtual stage g to g + 1."""
    g = place.virtual(s, a.chunk)
    nxt = place.where(min(g + 1, place.last))[0]  # where this chunk's output goes
    prv = place.where(max(g - 1, 0))[0]  # where its input comes from
    channel, boundary = {"send_act": ((s, nxt, "act"), g), "recv_act": ((prv, s, "act"), g - 1),
                         "send_grad": ((s, prv, "grad"), g - 1),
                         "recv_grad": ((nxt, s, "grad"), g)}[a.op]
    return channel, (a.mb, boundary)


def _simulate(schedule: Schedule, place: Placement) -> None:
    pp = place.pp
    sends: dict[tuple, list] = {}  # channel -> messages (micro-batch, boundary) in posting order
    recvs: dict[tuple, list] = {}
    pc = [0] * pp
    posted: list[list | None] = [None] * pp  # the batch a rank waits on

    def advance(s: int) -> bool:
        """Run rank s until it finishes or waits; whether it moved."""
        actions, start = schedule[s], pc[s]
        while pc[s] < len(actions):
            if actions[pc[s]].op in COMPUTE:
                pc[s] += 1
                continue
            if posted[s] is None:  # post the whole batch of consecutive transfers
                posted[s] = []
                end = pc[s]
                while end < len(actions) and actions[end].op in TRANSFERS:
                    a = actions[end]
                    channel, msg = _message(s, a, place)
                    mine, theirs = (sends, recvs) if a.op.startswith("send") else (recvs, sends)
                    log = mine.setdefault(channel, [])
                    log.append(msg)
                    posted[s].append((a, channel, len(log) - 1, theirs, msg))
                    end += 1
                return True  # the peers may now match what was posted
            if not all(_matched(s, item) for item in posted[s]):
                return pc[s] != start
            pc[s] += len(posted[s])
            posted[s] = None
        return pc[s] != start

    def _matched(s: int, item: tuple) -> bool:
        return (eager and item[0].op.startswith("send")) or _peer_posted(s, item)

    eager = place.eager_sends
    while True:
        moved = [advance(s) for s in range(pp)]
        if all(pc[s] == len(a) for s, a in enumerate(schedule)):
            return
        if not any(moved):
            stuck = {s: [item[0] for item in posted[s] or ()] for s in range(pp)
                     if pc[s] < len(schedule[s])}
            raise ScheduleError(f"deadlock: no rank can proceed; waiting ranks and their "
                                f"posted transfers: {stuck}")


def _peer_posted(s: int, item: tuple) -> bool:
    """Whether the peer has posted the transfer matching this one (and it carries the same)."""
    a, channel, index, theirs, msg = item
    peer_log = theirs.get(channel, [])
    if len(peer_log) <= index:
        return False
    if peer_log[index] != msg:
        raise ScheduleError(
            f"rank {s}: {a} is message {index} on channel {channel[0]}->{channel[1]} "
            f"({channel[2]}) carrying (micro-batch, boundary) {msg}, but the peer's message "
            f"{index} there carries {peer_log[index]}: the two post them in different orders")
    return True

"""Pipeline schedules as data: for every rank, the ordered list of actions it runs in one
optimizer step.

An `Action` is a forward (F), backward (B) or weight-gradient pass (W) of micro-batch `mb`
on the rank's local model chunk `chunk`, or a point-to-point transfer of that (micro-batch,
chunk)'s boundary tensor: `recv_act` before its forward, `send_act` after it, `recv_grad`
before its backward, `send_grad` after it. B computes the gradient with respect to the
chunk's input (what the previous virtual stage waits for) and, unless the schedule has a W
for the same (micro-batch, chunk), the weights' gradients too (a full backward); a W
computes those weight gradients later, from what its B kept (the split backward of Qi et
al. 2024, "Zero Bubble Pipeline Parallelism", arXiv 2401.10241).

Placement (`Placement`): with the "loop" shape chunk c of stage s is virtual stage
g = c * pp + s (Narayanan et al. 2021, sec. 2.2): it feeds virtual stage g + 1 on stage
(s + 1) % pp. With the "v" shape (ZB-V, DualPipeV; two chunks) chunk 0 of stage s is
virtual stage s and chunk 1 is 2 pp - 1 - s: a micro-batch goes down the ranks and back up,
the last rank hands chunk 0's output to its own chunk 1 with no transfer, and rank 0 holds
both the first and the last virtual stage. Virtual stage 0 has no input to receive (it
embeds the tokens); the last, G - 1 = pp * v - 1, has no output to send (the loss).

Communication semantics (what the validator simulates and the executor does): consecutive
transfer actions of a rank form one batch, posted together (batch_isend_irecv) and waited
for together; a transfer completes only once its peer has posted the matching one
(rendezvous: no buffering is assumed). Activations and gradients travel under different
message tags, and on each (sender, receiver, kind) channel the k-th send matches the k-th
receive. Under the V placement (and under ZB-H1: `placement`) sends are eager instead: a
send is posted (isend) and the rank goes on, its work collected once done or at the end of
the step; a receive still waits for its message. The V's two chunks send both ways between neighbours (chunk 0 down, chunk 1 up),
and with rendezvous sends two neighbours each sending before receiving would wait for each
other; eager sends leave only the data dependencies, which the validator replays.

Schedules (the compute order in steps; `with_transfers` places the transfers):
- GPipe (Huang et al. 2019): all forwards, then all backwards; stage 0 holds the
  activations of all m micro-batches at once.
- 1F1B (PipeDream-Flush, Narayanan et al. 2021, sec. 2.1): stage s runs pp - s - 1 warm-up
  forwards, then alternates one forward and one backward, then drains the backwards; at most
  pp micro-batches in flight on stage 0, the same bubble as GPipe.
- Interleaved 1F1B (Narayanan et al. 2021, sec. 2.2): v chunks per stage; forwards go in
  rounds of pp micro-batches through chunk 0, then chunk 1, ...; backwards mirror that from
  the last chunk. The bubble shrinks by v, (pp - 1) / (v m); m must be a multiple of pp so
  the rounds are whole.
- ZB-H1, ZB-V and DualPipeV: zero_bubble.py.
- PipeDream-2BW (asynchronous, two weight versions): pipedream.py; its steps span
  pipedream.BATCHES consecutive batches, micro-batch n being n % m of batch n // m.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


COMPUTE = ("F", "B", "W")
TRANSFERS = ("recv_act", "send_act", "recv_grad", "send_grad")


@dataclass(frozen=True)
class Action:
    op: str  # F | B | W | send_act | recv_act | send_grad | recv_grad
    mb: int
    chunk: int  # the rank's local chunk (virtual stage chunk * pp + stage)

    def __repr__(self) -> str:
        return f"{self.op}(mb={self.mb}, chunk={self.chunk})"


Schedule = list[list[Action]]  # [rank] -> actions in order
Steps = list[list[tuple[Action, ...]]]  # [rank] -> compute steps, each one or two computes


@dataclass(frozen=True)
class Placement:
    """Which virtual stage each (stage, local chunk) is (module doc)."""
    pp: int
    v: int = 1
    shape: str = "loop"  # loop | v
    eager: bool = False  # sends eager in the loop too (`placement`)

    @property
    def eager_sends(self) -> bool:
        """Whether sends complete when posted (module doc): the V placement's, and ZB-H1's."""
        return self.shape == "v" or self.eager

    @property
    def last(self) -> int:
        return self.pp * self.v - 1

    @property
    def ends_apart(self) -> bool:
        """Whether the first and the last virtual stage are on different ranks."""
        return self.where(0)[0] != self.where(self.last)[0]

    def virtual(self, stage: int, chunk: int) -> int:
        if self.shape == "v":
            return stage if chunk == 0 else 2 * self.pp - 1 - stage
        return chunk * self.pp + stage

    def where(self, g: int) -> tuple[int, int]:
        """(stage, chunk) holding virtual stage g."""
        if self.shape == "v":
            return (g, 0) if g < self.pp else (2 * self.pp - 1 - g, 1)
        return g % self.pp, g // self.pp

    def crosses(self, stage: int, chunk: int, op: str) -> bool:
        """Whether F's input (op "F") or B's input gradient ("B") of this chunk comes from
        another rank -- else it is the first/last virtual stage or a local hand-off."""
        g = self.virtual(stage, chunk)
        src = g - 1 if op == "F" else g + 1
        return 0 <= src <= self.last and self.where(src)[0] != stage

    def sends(self, stage: int, chunk: int, op: str) -> bool:
        """Whether F's output ("F") or B's input gradient ("B") goes to another rank."""
        g = self.virtual(stage, chunk)
        dst = g + 1 if op == "F" else g - 1
        return 0 <= dst <= self.last and self.where(dst)[0] != stage


def gpipe(pp: int, m: int) -> Steps:
    return [[(Action("F", i, 0),) for i in range(m)] + [(Action("B", i, 0),) for i in range(m)]
            for _ in range(pp)]


def one_f_one_b(pp: int, m: int) -> Steps:
    """Each compute is its own step: in the steady state a stage's forward output and its
    next backward's gradient then travel in one batch (see with_transfers)."""
    out = []
    for s in range(pp):
        warmup = min(pp - s - 1, m)
        order = [(Action("F", i, 0),) for i in range(warmup)]
        for i in range(m - warmup):  # steady state: one forward, one backward
            order += [(Action("F", warmup + i, 0),), (Action("B", i, 0),)]
        order += [(Action("B", i, 0),) for i in range(m - warmup, m)]  # cool-down
        out.append(order)
    return out


def interleaved(pp: int, m: int, v: int) -> Steps:
    """Megatron-LM's order: the k-th forward of a stage is micro-batch
    (k // (pp v)) pp + k % pp of chunk (k // pp) % v; the k-th backward the same micro-batch
    of chunk v - 1 - (k // pp) % v. Stage s warms up with 2 (pp - s - 1) + (v - 1) pp
    forwards (all of them when m = pp), then each steady step is a forward and a backward
    whose four transfers (send the forward's output and the backward's input gradient,
    receive the next step's input and gradient) form one batch after the step: with a
    batch between the two computes, stages in the ring of chunks would wait on each other
    (the validator finds that deadlock for m > pp)."""
    check_interleaved(pp, m, v)
    total = m * v

    def mb(k: int) -> int:
        return (k // (pp * v)) * pp + k % pp

    out = []
    for s in range(pp):
        warmup = total if m == pp else min(2 * (pp - s - 1) + (v - 1) * pp, total)
        fwd = [Action("F", mb(k), (k // pp) % v) for k in range(total)]
        bwd = [Action("B", mb(k), v - 1 - (k // pp) % v) for k in range(total)]
        steps = [(a,) for a in fwd[:warmup]]
        steps += [(fwd[warmup + i], bwd[i]) for i in range(total - warmup)]
        steps += [(a,) for a in bwd[total - warmup:]]
        out.append(steps)
    return out


def forward_only(pp: int, m: int, v: int) -> Steps:
    """Evaluation: each micro-batch through every virtual stage in turn, no backward."""
    return [[(Action("F", i, c),) for i in range(m) for c in range(v)] for _ in range(pp)]


def check_interleaved(pp: int, m: int, v: int) -> None:
    """(Config validation says the same to users, naming the fields, before launch.)"""
    if pp < 2 or v < 2 or m % pp:
        raise ValueError(f"the interleaved schedule needs pp >= 2, v >= 2 chunks per stage "
                         f"and micro-batches in whole rounds of pp (got pp={pp}, v={v}, m={m})")


def compute_steps(schedule: str, pp: int, m: int, v: int = 1) -> Steps:
    """The F/B/W order of `schedule` (SCHEDULES) for every rank."""
    from shardtrain.parallel.pipeline import pipedream, zero_bubble  # they build on this

    if schedule == "interleaved":
        return interleaved(pp, m, v)
    builders: dict[str, tuple[Callable[[int, int], Steps], int]] = {
        "gpipe": (gpipe, 1), "1f1b": (one_f_one_b, 1), "zb-h1": (zero_bubble.zb_h1, 1),
        "zbv": (zero_bubble.zbv, 2), "dualpipev": (zero_bubble.dualpipev, 2),
        pipedream.NAME: (pipedream.pipedream_2bw, 1)}
    if schedule not in builders or v != builders[schedule][1]:
        raise ValueError(f"schedule {schedule!r} with v={v} chunks per stage: one of gpipe, "
                         "1f1b, zb-h1, pipedream-2bw (v = 1), interleaved (v >= 2), zbv or dualpipev (v = 2)")
    return builders[schedule][0](pp, m)


SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev", "pipedream-2bw")
V_SHAPED = ("zbv", "dualpipev")


def placement(schedule: str, pp: int, v: int = 1) -> Placement:
    # ZB-H1 puts W passes between a send and the next receive (a later stage: B, send the
    # input gradient, W, receive the next activation). A rendezvous send would hold the
    # receiving stage, whose batch also waits for that next activation's send, for the
    # whole W: eager sends leave it only its data dependency, the simulator's.
    return Placement(pp, v, "v" if schedule in V_SHAPED else "loop", eager=schedule == "zb-h1")


def activation_bound(schedule: str, pp: int, m: int, v: int = 1) -> int:
    """The most (micro-batch, chunk)s a rank holds between F and the end of its backward, as
    each schedule's paper states it (the validator holds every built schedule to it): GPipe
    all m; 1F1B and ZB-H1 pp (Qi et al. 2024: ZB-H1 keeps 1F1B's peak); interleaved
    stage 0's warm-up 2(pp-1) + (v-1) pp, plus the steady step's forward; ZB-V pp micro-
    batches on both chunks; DualPipeV 2pp + 1 (DualPipe's PP + 1, PP = 2pp stages);
    PipeDream-2BW 1F1B's pp (Narayanan et al. 2021, sec. 3.1), across batches too."""
    bound = {"gpipe": m * v, "1f1b": pp, "zb-h1": pp, "pipedream-2bw": pp, "interleaved": (v + 1) * pp - 1,
             "zbv": 2 * pp, "dualpipev": 2 * pp + 1}[schedule]
    return min(bound, m * v)


def with_transfers(steps: Steps, pp: int, v: int, shape: str = "loop") -> Schedule:
    """Place each step's transfers around it: the receives of its computes' inputs (the
    activation before a forward, the gradient before a backward) just before it, the sends
    of their outputs just after. The transfers between two steps form one batch: in 1F1B's
    steady state a stage sends its forward output and receives its next backward's gradient
    together while its neighbour sends that gradient and receives the next input -- blocking
    transfers one at a time would have both wait for the other."""
    place = Placement(pp, v, shape)
    out = []
    for s, rank_steps in enumerate(steps):
        actions: list[Action] = []
        for step in rank_steps:
            for a in step:
                if a.op != "W" and place.crosses(s, a.chunk, a.op):
                    actions.append(Action("recv_act" if a.op == "F" else "recv_grad", a.mb,
                                          a.chunk))
            actions += step
            for a in step:
                if a.op != "W" and place.sends(s, a.chunk, a.op):
                    actions.append(Action("send_act" if a.op == "F" else "send_grad", a.mb,
                                          a.chunk))
        out.append(actions)
    return out


def build(schedule: str, pp: int, m: int, v: int = 1) -> Schedule:
    """The full schedule (compute and transfers) of every rank."""
    return with_transfers(compute_steps(schedule, pp, m, v), pp, v,
                          placement(schedule, pp, v).shape)


def build_forward_only(pp: int, m: int, v: int = 1, shape: str = "loop") -> Schedule:
    return with_transfers(forward_only(pp, m, v), pp, v, shape)


def peak_in_flight(actions: list[Action]) -> int:
    """The most (micro-batch, chunk)s whose forward has run and whose backward has not
    finished -- its W, where the schedule splits it, else its B: a split B keeps the graph,
    and with it every saved activation, for its W -- at any point of the rank's schedule."""
    split = {(a.mb, a.chunk) for a in actions if a.op == "W"}
    live = peak = 0
    for a in actions:
        done = a.op == "W" or (a.op == "B" and (a.mb, a.chunk) not in split)
        live += (a.op == "F") - done
        peak = max(peak, live)
    return peak

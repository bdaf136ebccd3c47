"""The schedule simulator against the published bubbles, the zero-bubble schedules' shape
(every F, B, W once; DualPipeV's overlapped pairs independent), the validator's W and
memory checks, the planner's terms and `shardtrain schedule` (one process, no spawn)."""

from __future__ import annotations

import json

import pytest

from shardtrain import cli
from shardtrain.parallel.pipeline import schedules
from shardtrain.parallel.pipeline.schedules import Action, build, compute_steps, peak_in_flight
from shardtrain.parallel.pipeline.simulate import Costs, simulate
from shardtrain.parallel.pipeline.validate import ScheduleError, validate
from shardtrain.plan.schedule_terms import schedule_terms
from shardtrain.plan.timing import bubble_fraction

CASES = [(2, 4), (2, 8), (3, 6), (4, 8), (4, 12), (8, 16)]
# Exact where an input-gradient pass costs a forward (B - W = F), the zero-bubble papers'
# premise; F&B = F + B: nothing overlaps on one CPU core.
COSTS = [Costs(1, 2, 1), Costs(2, 3, 1)]


@pytest.mark.parametrize("costs", COSTS)
@pytest.mark.parametrize("pp,m", CASES)
def test_the_published_bubbles(pp, m, costs):
    f, b, w = costs.f, costs.b, costs.w
    assert simulate("1f1b", pp, m, 1, costs).idle == [(pp - 1) * (f + b)] * pp
    assert simulate("zb-h1", pp, m, 1, costs).idle == [(pp - 1) * (f + b - 2 * w)] * pp
    # DualPipeV: P = 2 pp virtual stages (DualPipe's PP), F&B defaulting to F + B
    p_stages, fb = 2 * pp, f + b
    assert simulate("dualpipev", pp, m, 2, costs).idle == \
        [(p_stages / 2 - 1) * (fb + b - 3 * w)] * pp
    # an F&B given (here 3): the formula is the most idle rank's
    fb = 3.0
    given = simulate("dualpipev", pp, m, 2, Costs(f, b, w, fb=fb))
    assert max(given.idle) == (p_stages / 2 - 1) * (fb + b - 3 * w)


def test_1f1b_against_zb_h1_in_slots():
    one, zb = simulate("1f1b", 4, 8), simulate("zb-h1", 4, 8)
    assert one.idle == [9] * 4 and one.span == 33 and round(one.bubble_fraction, 3) == 0.273
    assert zb.idle == [3] * 4 and zb.span == 27 and round(zb.bubble_fraction, 3) == 0.111
    # the same memory: at most pp micro-batches between F and W, as 1F1B's stage 0
    assert zb.peak_activations == [4.0] * 4 and max(one.peak_activations) == 4.0


@pytest.mark.parametrize("schedule,v", [("zb-h1", 1), ("zbv", 2), ("dualpipev", 2)])
def test_every_f_b_w_once_and_no_deadlock(schedule, v):
    for pp in range(2, 7):
        for m in range(2 * pp, 3 * pp + 2):
            steps = compute_steps(schedule, pp, m, v)
            for rank in steps:
                order = [a for step in rank for a in step]
                for op in "FBW":
                    assert sorted((a.mb, a.chunk) for a in order if a.op == op) == \
                        [(i, c) for i in range(m) for c in range(v)] or op == "W", \
                        (schedule, pp, m, op)
                assert len(order) == len(set(order))
            simulate(schedule, pp, m, v)  # raises on a deadlock


def test_dualpipev_overlaps_independent_forward_and_backward():
    """Each two-compute step pairs a forward with a backward of the other chunk: neither
    needs the other (a B needs its own chunk's F and the next virtual stage's B), so a
    device may run them at once; the simulator with F&B < F + B shortens the step."""
    pp, m = 4, 12
    pairs = [step for rank in compute_steps("dualpipev", pp, m, 2) for step in rank
             if len(step) == 2]
    assert pairs and all(f.op == "F" and b.op == "B" and f.chunk != b.chunk for f, b in pairs)
    assert len(pairs) == sum(2 * (m - 2 * pp + r + 1) - (r == pp - 1) + (pp - r - 1)
                             for r in range(pp))
    slower, faster = simulate("dualpipev", pp, m, 2), simulate("dualpipev", pp, m, 2,
                                                                Costs(fb=2.0))
    assert faster.span < slower.span


def test_zb_h1_validates_with_transfers_and_its_memory_bound():
    for pp in range(1, 7):
        for m in range(1, 13):
            validate(build("zb-h1", pp, m), pp, m, bound=pp)
    good = build("zb-h1", 2, 4)
    late_w = [list(a) for a in good]  # a W before its B
    i, j = late_w[1].index(Action("W", 0, 0)), late_w[1].index(Action("B", 0, 0))
    late_w[1][i], late_w[1][j] = late_w[1][j], late_w[1][i]
    with pytest.raises(ScheduleError, match=r"W\(mb=0, chunk=0\) runs before B\(mb=0"):
        validate(late_w, 2, 4)
    twice = [list(a) for a in good]
    twice[0].append(Action("W", 0, 0))
    with pytest.raises(ScheduleError, match="unexpected or repeated"):
        validate(twice, 2, 4)
    with pytest.raises(ScheduleError, match="above the schedule's bound of 1"):
        validate(good, 2, 4, bound=1)
    assert peak_in_flight(good[1]) == 2  # rank 1 holds one W back: F F B ... W


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2),
                                        ("zb-h1", 1), ("zbv", 2), ("dualpipev", 2)])
def test_planner_terms_extrapolate_the_steady_state_exactly(schedule, v):
    for pp in (2, 3, 4):
        for m in (8 * pp, 10 * pp):
            full = simulate(schedule, pp, m, v)
            terms = schedule_terms(schedule, pp, m, v)
            assert terms.bubble_fraction == pytest.approx(full.bubble_fraction, rel=1e-12)
            assert terms.in_flight == max(full.peak_activations)


def test_planner_terms_keep_the_narayanan_forms():
    for pp, m in CASES:
        assert bubble_fraction(pp, m) == pytest.approx((pp - 1) / (m + pp - 1))
        assert schedule_terms("gpipe", pp, m).in_flight == m
        assert schedule_terms("1f1b", pp, m).in_flight == min(m, pp)
        if m % pp == 0:
            assert bubble_fraction(pp, m, v=2) == pytest.approx((pp - 1) / (2 * m + pp - 1))
            assert schedule_terms("interleaved", pp, m, 2).in_flight == \
                pytest.approx(pp * (1 + (pp - 1) / (2 * pp)))
    assert bubble_fraction(4, 8, schedule="zb-h1") < bubble_fraction(4, 8)


def test_schedule_command(capsys):
    assert cli.main(["schedule", "--schedule", "zb-h1", "--pp", "4", "--microbatches", "8"]) == 0
    out = capsys.readouterr().out
    assert "rank 3: .  .  .  F0 B0 F1 B1" in out and "bubble fraction 11.1%" in out
    assert "rank 0 4, rank 1 4" in out
    assert cli.main(["schedule", "--schedule", "1f1b", "--pp", "4", "--microbatches", "8",
                     "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert round(doc["bubble_fraction"], 3) == 0.273 and doc["idle"] == [9.0] * 4
    assert cli.main(["schedule", "--schedule", "zbv", "--pp", "2", "--microbatches", "4",
                     "--costs", "1,3,1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["virtual_stages"] == 2
    assert cli.main(["schedule", "--schedule", "zb-h1", "--pp", "2", "--microbatches", "4",
                     "--costs", "1,2,2"]) == 2
    assert "0 <= W < B" in capsys.readouterr().err
    assert cli.main(["schedule", "--schedule", "dualpipev", "--pp", "2",
                     "--microbatches", "3"]) == 2
    assert "at least 2 pp micro-batches" in capsys.readouterr().err


def test_v_placement():
    place = schedules.placement("zbv", 3, 2)
    assert [place.virtual(s, c) for s in range(3) for c in range(2)] == [0, 5, 1, 4, 2, 3]
    assert all(place.where(place.virtual(s, c)) == (s, c) for s in range(3) for c in range(2))
    # the turn of the V is local: rank 2's chunk 0 feeds its chunk 1 with no transfer
    assert not place.sends(2, 0, "F") and not place.crosses(2, 1, "F")

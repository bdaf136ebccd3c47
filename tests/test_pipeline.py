"""Pipeline schedules, the validator, the partition, config validation and the executor on
one process (no spawn; parity across processes is in test_pipeline_parity.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardtrain import config
from shardtrain.comm import CommLedger, Communicator
from shardtrain.config import ConfigError
from shardtrain.parallel.pipeline import schedules
from shardtrain.parallel.pipeline.executor import PipelineExecutor
from shardtrain.parallel.pipeline.partition import layer_ranges
from shardtrain.parallel.pipeline.schedules import Action, build, peak_in_flight
from shardtrain.parallel.pipeline.validate import ScheduleError, validate


def _defined(p: int, m: int):
    yield "gpipe", 1
    yield "1f1b", 1
    if p >= 2 and m % p == 0:
        yield "interleaved", 2
        yield "interleaved", 3


def test_every_generated_schedule_is_valid():
    count = 0
    for p in range(1, 9):
        for m in range(1, 17):
            for name, v in _defined(p, m):
                validate(build(name, p, m, v), p, m, v,
                         bound=schedules.activation_bound(name, p, m, v))
                count += 1
            for v in (1, 2, 3):  # evaluation: forward only
                validate(schedules.build_forward_only(p, m, v), p, m, v, backward=False)
    assert count == 2 * 8 * 16 + 2 * sum(16 // p for p in range(2, 9))


def test_activations_in_flight_on_stage_0():
    """GPipe holds all m micro-batches' activations on stage 0; 1F1B at most p."""
    for p in range(1, 9):
        for m in range(1, 17):
            assert peak_in_flight(build("gpipe", p, m)[0]) == m
            assert peak_in_flight(build("1f1b", p, m)[0]) == min(m, p)


def _index(actions: list[Action], op: str, mb: int, chunk: int = 0) -> int:
    return actions.index(Action(op, mb, chunk))


def test_validator_rejects_broken_schedules():
    good = build("1f1b", 2, 4)
    validate(good, 2, 4)

    dropped = [list(a) for a in good]  # a receive goes missing
    del dropped[1][_index(dropped[1], "recv_act", 2)]
    with pytest.raises(ScheduleError, match=r"rank 1: missing \[recv_act\(mb=2, chunk=0\)\]"):
        validate(dropped, 2, 4)

    early = [list(a) for a in good]  # a backward before its forward
    i, j = _index(early[0], "F", 3), _index(early[0], "B", 3)
    early[0][i], early[0][j] = early[0][j], early[0][i]
    with pytest.raises(ScheduleError, match=r"rank 0: B\(mb=3, chunk=0\) runs before F\(mb=3"):
        validate(early, 2, 4)

    # Stage 0 waits for a gradient before sending any activation: both ranks wait forever.
    hang = [list(a) for a in good]
    hang[0].insert(0, hang[0].pop(_index(hang[0], "recv_grad", 0)))
    with pytest.raises(ScheduleError, match="deadlock: no rank can proceed"):
        validate(hang, 2, 4)

    # Two sends swapped (each still after its forward): the receiver would take micro-batch
    # 1's activation as micro-batch 0's.
    crossed = build("gpipe", 2, 2)
    s0 = crossed[0]  # F0 send0 F1 send1 ... -> F0 F1 send1 send0
    crossed[0] = [s0[0], s0[2], s0[3], s0[1], *s0[4:]]
    with pytest.raises(ScheduleError, match="post them in different orders"):
        validate(crossed, 2, 2)


def test_interleaved_needs_its_transfers_batched_after_each_step():
    """Placing the interleaved schedule's transfers next to each compute (as for 1F1B)
    deadlocks the ring of chunks; the schedule pairs each steady forward and backward."""
    steps = schedules.interleaved(2, 4, 2)
    single = [[(a,) for step in rank for a in step] for rank in steps]
    with pytest.raises(ScheduleError, match="deadlock"):
        validate(schedules.with_transfers(single, 2, 2), 2, 4, 2)
    validate(schedules.with_transfers(steps, 2, 2), 2, 4, 2)
    with pytest.raises(ValueError, match="whole rounds of pp"):
        schedules.interleaved(4, 6, 2)


def test_v_schedules_need_eager_sends(monkeypatch):
    """Under the V the neighbours send both ways (chunk 0 down, chunk 1 up): with
    rendezvous batches ZB-V and DualPipeV deadlock, with eager sends (the V placement's,
    schedules.py) every (pp, m) the trainer accepts is sound, and the evaluation too."""
    for name in schedules.V_SHAPED:
        for p in range(2, 5):
            for m in range(2 * p if name == "dualpipev" else 1, 2 * p + 3):
                validate(build(name, p, m, 2), p, m, 2, shape="v",
                         bound=schedules.activation_bound(name, p, m, 2))
            validate(schedules.build_forward_only(p, 2, 2, "v"), p, 2, 2, backward=False,
                     shape="v")
    # the same schedules under the loop's rendezvous sends
    monkeypatch.setattr(schedules.Placement, "eager_sends", property(lambda self: False))
    for name in schedules.V_SHAPED:
        with pytest.raises(ScheduleError, match="deadlock"):
            validate(build(name, 2, 4, 2), 2, 4, 2, shape="v")


def test_zb_h1_sends_eagerly_and_is_sound_so():
    """ZB-H1's placement sends eagerly (schedules.placement says why), and every (pp, m)
    is proven sound under those semantics, the ones the executor runs."""
    for p in range(2, 6):
        place = schedules.placement("zb-h1", p)
        assert place.eager_sends and not schedules.placement("1f1b", p).eager_sends
        for m in range(1, 2 * p + 3):
            validate(build("zb-h1", p, m), p, m, shape=place.shape, eager=True,
                     bound=schedules.activation_bound("zb-h1", p, m))


def test_partition():
    # V (ZB-V, DualPipeV): stage s holds virtual stages s and 2p - 1 - s.
    assert layer_ranges(8, 2, 2, shape="v") == [[range(0, 2), range(6, 8)],
                                                 [range(2, 4), range(4, 6)]]
    # Interleaved: chunk c of stage s holds the (c p + s)-th of p v equal ranges.
    assert layer_ranges(8, 2, 2) == [[range(0, 2), range(4, 6)], [range(2, 4), range(6, 8)]]
    # Balanced by cost: a head worth 2.5 layers leaves the last stage fewer layers.
    assert layer_ranges(8, 2, costs=(1.0, 0.0, 2.5)) == [[range(0, 5)], [range(5, 8)]]
    assert layer_ranges(8, 4) == [[range(2 * s, 2 * s + 2)] for s in range(4)]
    ranges = layer_ranges(5, 5, costs=(1.0, 10.0, 10.0))
    assert [len(r[0]) for r in ranges] == [1] * 5  # every stage keeps a layer


@pytest.mark.parametrize("args, needle", [
    (["--parallel.pp", "4", "--model.n_layers", "2"],
     "parallel.pp=4 exceeds model.n_layers=2: every pipeline stage needs at least one layer"),
    (["--parallel.pp", "2", "--parallel.microbatches", "3"],
     "parallel.microbatches=3 does not divide this data-parallel rank's share of "
     "train.global_batch=8"),
    (["--parallel.pp", "4", "--model.n_layers", "6", "--parallel.schedule", "interleaved",
      "--parallel.virtual_stages", "2"],
     "model.n_layers=6 is not divisible by parallel.pp=4 x parallel.virtual_stages=2"),
    (["--parallel.pp", "2", "--parallel.schedule", "interleaved"],
     "parallel.schedule=interleaved needs parallel.pp >= 2 and parallel.virtual_stages >= 2"),
    (["--parallel.pp", "2", "--parallel.virtual_stages", "2"],
     "parallel.virtual_stages=2 needs parallel.schedule=interleaved"),
    (["--parallel.pp", "4", "--model.n_layers", "8", "--parallel.schedule", "interleaved",
      "--parallel.virtual_stages", "2", "--parallel.microbatches", "2"],
     "parallel.microbatches=2 is not a multiple of parallel.pp=4"),
    (["--parallel.pp", "2", "--parallel.zero", "3", "--parallel.zero_hpz", "true"],
     "parallel.zero_hpz with parallel.pp=2"),
    (["--parallel.pp", "2", "--parallel.schedule", "zbv"],
     "parallel.schedule=zbv needs parallel.pp >= 2 and parallel.virtual_stages=2"),
    (["--parallel.pp", "1", "--parallel.schedule", "dualpipev", "--parallel.virtual_stages",
      "2"], "parallel.schedule=dualpipev needs parallel.pp >= 2"),
    (["--parallel.pp", "2", "--model.n_layers", "6", "--parallel.schedule", "zbv",
      "--parallel.virtual_stages", "2"], "model.n_layers=6 is not divisible by 2 x parallel.pp=4"),
    (["--parallel.pp", "2", "--model.n_layers", "4", "--parallel.schedule", "dualpipev",
      "--parallel.virtual_stages", "2", "--parallel.microbatches", "2"],
     "parallel.microbatches=2 is below 2 x parallel.pp=4"),
])
def test_bad_pipeline_layouts_name_the_fields(args, needle):
    with pytest.raises(ConfigError) as e:
        config.load("tiny", args).validate(4)
    assert needle in str(e.value)


def test_microbatches_resolve_in_one_place():
    cfg = config.load("tiny", ["--parallel.pp", "2", "--parallel.microbatches", "4"])
    cfg.validate(4)  # dp = 2: 8 sequences / (2 x 4) = 1 per micro-batch
    assert (cfg.parallel.microbatches, cfg.train.micro_batch) == (4, 1)
    again = config.loads(config.to_toml(cfg))  # the written config.toml says the same
    assert (again.parallel.microbatches, again.train.micro_batch) == (4, 1)
    cfg = config.load("tiny")  # microbatches = 0: derived from train.micro_batch
    cfg.validate(2)
    assert (cfg.parallel.microbatches, cfg.train.micro_batch) == (2, 2)


class _Affine(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


def test_executor_on_one_stage_accumulates_and_records_its_timeline():
    """The executor with any chunk module: one stage running 1F1B is plain gradient
    accumulation (mean loss over micro-batches), with a timeline of every action."""
    torch.manual_seed(0)
    chunk, m = _Affine(), 3
    inputs = [torch.randn(2, 3) for _ in range(m)]
    targets = [torch.randn(2, 3) for _ in range(m)]
    loss = nn.functional.mse_loss
    comm = Communicator(None, name="pp", ranks=[0], ledger=CommLedger())
    ex = PipelineExecutor([chunk], comm, loss=loss, act_shape=(2, 3), act_dtype=torch.float32,
                          device=torch.device("cpu"))
    total = ex.run(build("1f1b", 1, m)[0], inputs, targets, info={"schedule": "1f1b"})
    got = [p.grad.clone() for p in chunk.parameters()]
    chunk.zero_grad()
    expected = sum(loss(chunk(x), y) for x, y in zip(inputs, targets))
    (expected / m).backward()
    torch.testing.assert_close(total, expected.detach())
    for g, p in zip(got, chunk.parameters()):
        torch.testing.assert_close(g, p.grad)
    t = ex.timeline
    assert {k: t[k] for k in ("rank", "stage", "pp", "microbatches", "virtual_stages",
                              "schedule")} == {"rank": 0, "stage": 0, "pp": 1, "microbatches": m,
                                               "virtual_stages": 1, "schedule": "1f1b"}
    assert [(a["op"], a["mb"]) for a in t["actions"]] == [("F", 0), ("B", 0), ("F", 1), ("B", 1),
                                                         ("F", 2), ("B", 2)]
    times = [x for a in t["actions"] for x in (a["start"], a["end"])]
    assert times == sorted(times) and times[0] >= 0
    assert ex.peak_live == 1

"""The planner's step peak equals the measured one (issue 46): rank 0 of an 8-rank job over the
fake process group (train/start/dryrun.py, in this process), its step peak in tensor bytes
(model states plus malloc's growth during the last step, train/start/meters.py) within 10%
of the planner's total either way (plan/memory.py: model states, activations, the largest
transient moment of plan/buffers.py), for data parallelism, ZeRO-1, 2 and 3 and tensor
parallelism; and the dry run's `planned_peak` is that total plus the runtime base it is given
(the CLI gives this machine's stored one: train/start/calibrate.py `runtime_base`).

tests/test_dryrun_matrix.py bounds the peak from above over the model families; this file
bounds it from both sides, so a planner that counts a transient the step no longer holds
(the embedding's table gathered again for backward, before ZeRO-3 stopped doing that) fails
too. The shape is vocabulary-heavy, like the 8B presets' (the vocabulary units and the
loss's [n, V] tensors set the peak). The RSS side (runtime included) is measured at scale
in docs/benchmarks.md; the runtime base is one stored figure, not a per-layout one.
"""

from __future__ import annotations

import pytest
import torch

from parity import tiny
from shardtrain.train.start.dryrun import dry_run
from shardtrain.train.start.meters import malloc_in_use_bytes

WORLD = 8
WITHIN = 0.10
# the loss's fp32 [256, 16384] is 16.8 MB, each vocabulary unit 16.8 MB, a block 1.3 MB
SHAPE = ("--model.dim", "256", "--model.n_layers", "2", "--model.n_heads", "4",
         "--model.n_kv_heads", "2", "--model.vocab_size", "16384", "--model.max_seq_len", "128",
         "--train.seq_len", "128", "--train.micro_batch", "2", "--train.steps", "2",
         "--model.tie_embeddings", "false")
ROWS = {  # name: layout
    "zero3": ("--parallel.zero", "3", "--train.global_batch", "16"),
    "dp": pytest.param(("--parallel.zero", "0", "--train.global_batch", "16"),
                       marks=pytest.mark.slow),
    "zero1": pytest.param(("--parallel.zero", "1", "--train.global_batch", "16"),
                          marks=pytest.mark.slow),
    "zero2": pytest.param(("--parallel.zero", "2", "--train.global_batch", "16"),
                          marks=pytest.mark.slow),
    "zero3 bf16": pytest.param(("--parallel.zero", "3", "--train.global_batch", "16",
                                "--train.precision", "bf16"), marks=pytest.mark.slow),
    "tp2 zero1": pytest.param(("--parallel.tp", "2", "--parallel.zero", "1",
                               "--train.global_batch", "8"), marks=pytest.mark.slow),
    "tp2 zero3 bf16": pytest.param(("--parallel.tp", "2", "--parallel.zero", "3",
                                    "--train.global_batch", "8", "--train.precision", "bf16"),
                                   marks=pytest.mark.slow),
}


@pytest.mark.skipif(malloc_in_use_bytes() is None,
                    reason="the CPU step peak needs glibc's mallinfo2 (glibc >= 2.33)")
@pytest.mark.parametrize("layout", list(ROWS.values()), ids=list(ROWS))
def test_planned_peak_is_the_measured_one(tmp_path, capsys, layout):
    cfg = tiny(tmp_path, "peak", *SHAPE, *layout)
    runtime = 123_456_789  # any stored figure: the prediction adds it as it is
    report = dry_run(cfg, WORLD, torch.device("cpu"), runtime_bytes=runtime, quiet=True)
    measured, planned = report["measured"], report["planned_estimate"]
    peak, total = measured["step_peak"], planned["total"]
    capsys.readouterr()  # the report's table
    print(f"{' '.join(layout)}: step peak {peak / 1e6:.2f} MB, planner {total / 1e6:.2f} MB "
          f"({total / peak - 1:+.1%}; states {measured['model_states'] / 1e6:.2f}, saved "
          f"{measured['saved_activations'] / 1e6:.2f} MB, planned activations "
          f"{planned['activations'] / 1e6:.2f} + buffers {planned['buffers'] / 1e6:.2f})")
    assert report["skipped_steps"] == 0
    assert abs(total - peak) <= WITHIN * peak, f"planner {total:,.0f} B against {peak:,} B"
    assert report["planned_peak"] == int(runtime + total)
    assert report["runtime_bytes"] == runtime


def test_runtime_base_is_stored_per_torch_version(tmp_path):
    """The runtime base is read back for the torch that measured it, and measured again
    (None here) for another torch or a file that cannot be read."""
    from shardtrain.cost.calibration import RuntimeBase, load_runtime, save_runtime

    path = tmp_path / "cpu_runtime.json"
    assert load_runtime("2.13.0", path) is None  # nothing measured yet
    base = RuntimeBase(bytes=344_244_720, torch="2.13.0", measured_at="2026-11-27T00:59:26")
    save_runtime(base, path)
    assert load_runtime("2.13.0", path) == base
    assert load_runtime("2.14.0", path) is None  # another torch: measure again
    path.write_text("{not json")
    assert load_runtime("2.13.0", path) is None

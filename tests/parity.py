"""The parity harness: train a layout and compare it with the single-process run.

Same seed, same global batch: per-step losses must agree within rtol 1e-5 and final
weights within 1e-4 (fp32). Later layouts add rows by calling `check_parity` with their
config overrides and world size.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch

from shardtrain import config
from shardtrain.ckpt.files import Reader
from shardtrain.config import Config
from shardtrain.comm import build_mesh
from shardtrain.mesh import ParallelMesh, shape_for
from shardtrain.train.trainer import Trainer

LOSS_RTOL = 1e-5
WEIGHT_TOL = 1e-4
# bf16 rounds each matmul's inputs to 8 bits of mantissa; layouts that cut the batch or the
# model differently round different partial sums, so they may differ by a few bf16 ulps of
# single activations, which the loss averages down. tp splits every matmul's inner
# dimension in two (row-parallel partial sums are rounded to bf16 before they are summed),
# hence the looser bound there. Relative loss deviation from the single-process bf16 run.
BF16_LOSS_RTOL = {False: 1e-3, True: 5e-3}  # without tp, with tp
# Set by tests/conftest.py for the session: one token cache for every tiny run.
CACHE_ENV = "SHARDTRAIN_TEST_CACHE"


def tiny_data(tmp: Path) -> list[str]:
    """The data overrides of a test run: the session's token cache (conftest.py), or
    outside a test session a cache under `tmp`."""
    return ["--data.cache_dir", os.environ.get(CACHE_ENV, str(tmp / "cache"))]


def tiny(tmp: Path, name: str, *overrides: str) -> Config:
    """The tiny preset with its run dir under `tmp`, on the session's text (tiny_data).
    `train.peak_flops` is set: no matmul throughput measurement (~0.3 s of a core) per
    trainer for an MFU no test here reads (the CLI runs of test_cli.py measure it)."""
    return config.load("tiny", ["--train.run_dir", str(tmp / name), *tiny_data(tmp),
                                "--train.progress", "false", "--train.peak_flops", "1e12",
                                *overrides])


def make_mesh(cfg: Config, rank: int, world_size: int) -> ParallelMesh:
    p = cfg.parallel
    return build_mesh(shape_for(cfg, world_size), rank=rank, node_size=p.node_size,
                        algorithm=cfg.comm.algorithm, timeout_s=cfg.comm.timeout_s)


def train_layout(rank: int, world_size: int, cfg_text: str,
                 extra: Callable[[Trainer], dict] | None = None, *,
                 mesh: ParallelMesh | None = None) -> dict:
    """Worker: train one config on this rank; return its losses and final full weights
    (gathered over tensor-parallel and pipeline ranks, so every layout's are comparable),
    plus what `extra` (a module-level function: it is pickled) reads off the trainer."""
    cfg = config.loads(cfg_text)
    trainer = Trainer(cfg, mesh or make_mesh(cfg, rank, world_size), torch.device("cpu"))
    result = trainer.run()
    return {"losses": result.losses, "eval_loss": result.eval_loss,
            "weights": trainer.parallel.full_state_dict(),
            **(extra(trainer) if extra is not None else {})}


def reference_runs(text: Callable[..., str]) -> Callable[[tuple], dict]:
    """Single-process runs keyed by their overrides, each trained once (a module fixture
    returns this): `text(name, *overrides)` is the run's config as TOML."""
    cache: dict[tuple, dict] = {}

    def get(overrides: tuple) -> dict:
        if overrides not in cache:
            cache[overrides] = train_layout(0, 1, text(f"ref-{len(cache)}", *overrides))
        return cache[overrides]

    return get


def train_layouts(rank: int, world_size: int, cfg_texts: list[str],
                  extra: Callable[[Trainer], dict] | None = None) -> list[dict]:
    """Worker: several layouts in one spawn (spawning is the slow part)."""
    return [train_layout(rank, world_size, text, extra) for text in cfg_texts]


def assert_parity(reference: dict, result: dict, label: str) -> None:
    ref, got = torch.tensor(reference["losses"]), torch.tensor(result["losses"])
    assert ref.shape == got.shape, f"{label}: {len(got)} steps vs {len(ref)}"
    torch.testing.assert_close(got, ref, rtol=LOSS_RTOL, atol=0,
                               msg=lambda m: f"{label}: per-step losses differ\n{m}")
    torch.testing.assert_close(result["eval_loss"], reference["eval_loss"], rtol=LOSS_RTOL, atol=0,
                               msg=lambda m: f"{label}: eval loss differs\n{m}")
    for name, w in reference["weights"].items():
        torch.testing.assert_close(result["weights"][name], w, rtol=WEIGHT_TOL, atol=WEIGHT_TOL,
                                   msg=lambda m: f"{label}: final weight {name} differs\n{m}")


def worst_loss_deviation(reference: list[float], got: list[float]) -> float:
    """The largest relative per-step loss difference (the bf16 rows' measure)."""
    return max(abs(g - r) / abs(r) for r, g in zip(reference, got, strict=True))


def checkpoint_tensors(path: Path, prefix: str = "model/") -> dict[str, torch.Tensor]:
    """A checkpoint's full tensors under `prefix` ("model/": the weights by their
    single-process names; "optim/": the optimizer state, "optim/<name>/<state>")."""
    reader = Reader(path)
    return {k[len(prefix):]: reader.tensor(k) for k in reader.keys(prefix)}

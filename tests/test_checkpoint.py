"""Sharded checkpoints: asynchronous saves, the memory a save holds, the streamed export and
bitwise resume. (Damaged checkpoints: test_checkpoint_integrity.py; resuming in another
layout: test_reshard.py.)"""

from __future__ import annotations

import json
import resource
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

from dist import run_distributed
from parity import checkpoint_tensors, make_mesh, tiny, train_layouts
from shardtrain import config
from shardtrain.model.hf import save_hf
from shardtrain.train.finetune.export import export_checkpoint, load_checkpoint_model
from shardtrain.train.trainer import Trainer

STEPS = ("--train.steps", "4", "--checkpoint.every", "2", "--checkpoint.keep", "2")


def _step(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


def test_async_save_equals_sync_save(tmp_path):
    """ZeRO-2 over 2 ranks: every file of both checkpoints (steps 2 and 4) is byte-equal
    (DCP's .metadata: the same tensors, chunks and storage; it also records a save id)."""
    texts = [config.to_toml(tiny(tmp_path, name, *STEPS, "--parallel.zero", "2",
                                 "--checkpoint.async_save", flag))
             for name, flag in (("sync", "false"), ("async", "true"))]
    run_distributed(train_layouts, 2, texts)
    for step in (2, 4):
        sync, asyn = _step(tmp_path / "sync", step), _step(tmp_path / "async", step)
        names = sorted(f.name for f in sync.iterdir() if f.name != "config.toml")
        assert names == sorted(f.name for f in asyn.iterdir() if f.name != "config.toml")
        assert "__1_0.distcp" in names and ".metadata" in names
        for name in names:
            if name != ".metadata":
                assert (sync / name).read_bytes() == (asyn / name).read_bytes(), (step, name)
        metadata = [FileSystemReader(d).read_metadata() for d in (sync, asyn)]
        assert metadata[0].state_dict_metadata == metadata[1].state_dict_metadata
        assert metadata[0].storage_data == metadata[1].storage_data


def _resident() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()


def _save_memory(rank: int, world_size: int, cfg_text: str) -> dict:
    """The most resident memory a save adds (sampled every millisecond while it runs),
    on a model of ~100M parameters, with the state's size and its largest piece's."""
    cfg = config.loads(cfg_text)
    trainer = Trainer(cfg, make_mesh(cfg, rank, world_size), torch.device("cpu"))
    trainer.train_step()
    before, peak, done = _resident(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _resident())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    trainer.save()
    done.set()
    sampler.join()
    pieces, _ = trainer.parallel.state_pieces()
    sizes = [p.region.numel * 4 for p in pieces]
    return {"growth": peak[0] - before, "state": sum(sizes), "largest": max(sizes)}


@pytest.mark.slow  # README command's time: run by .ci/run's slow tier
def test_save_holds_no_copy_of_the_state(tmp_path):
    """Saving writes each tensor from where it lives: the resident memory grows by far
    less than the state while it runs (a gathered copy would add all of it)."""
    text = config.to_toml(tiny(tmp_path, "big", "--model.dim", "1024", "--model.n_layers", "8",
                               "--model.n_heads", "8", "--model.n_kv_heads", "8",
                               "--train.steps", "1", "--train.global_batch", "1",
                               "--train.micro_batch", "1", "--train.seq_len", "16"))
    got = run_distributed(_save_memory, 1, text)[0]
    print(f"\nsave: state {got['state'] / 2**20:.0f} MiB (largest piece "
          f"{got['largest'] / 2**20:.1f} MiB); peak memory grew by {got['growth'] / 2**20:.1f} MiB")
    assert got["state"] > 1 << 30
    assert got["growth"] < got["state"] / 10


@pytest.mark.parametrize("lora", [(), ("--lora.rank", "4"),
                                  ("--lora.rank", "4", "--lora.quantize_base", "nf4")],
                         ids=["plain", "lora", "qlora"])
def test_streamed_export_equals_the_loaded_model_export(tmp_path, lora):
    cfg = tiny(tmp_path, "run", "--train.steps", "2", *lora)
    Trainer(cfg, make_mesh(cfg, 0, 1), torch.device("cpu")).run()
    path = _step(tmp_path / "run", 2)
    model, cfg = load_checkpoint_model(path)
    whole = save_hf(model, tmp_path / "whole", cfg=cfg.model)
    streamed = export_checkpoint(path, tmp_path / "streamed", max_shard_bytes=100_000)
    index = json.loads((streamed / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2  # split at the size asked
    got = {k: v for f in files for k, v in load_file(streamed / f).items()}
    want = load_file(whole / "model.safetensors")
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    assert checkpoint_tensors(path).keys() >= {"tok_emb.weight"}


@pytest.mark.parametrize("optim,zero", [("adamw", "0"), ("adamw8bit", "0"), ("adamw8bit", "1")])
def test_resume_continues_bitwise(tmp_path, optim, zero):
    """One process, the same layout: the resumed run continues the uninterrupted one
    bitwise. A checkpoint keeps 8-bit moments dequantized; quantized again in the same
    blocks they are the same codes."""
    args = ("--optim.name", optim, "--parallel.zero", zero, *STEPS)
    cfg = tiny(tmp_path, "whole", *args)
    whole = Trainer(cfg, make_mesh(cfg, 0, 1), torch.device("cpu")).run().losses
    cfg = tiny(tmp_path, "resumed", *args, "--checkpoint.resume", str(_step(tmp_path / "whole", 2)))
    assert Trainer(cfg, make_mesh(cfg, 0, 1), torch.device("cpu")).run().losses == whole[2:]

"""The precision policy's rules, in one process: the loss scaler's updates and its
checkpoint, the refused precision configs, and the MFU peak each precision counts against.
(The layouts' bf16 numbers and fp16's skipped step on every rank: tests/test_precision.py.)
"""

from __future__ import annotations

import pytest
import torch

from parity import make_mesh, tiny
from shardtrain.config import ConfigError
from shardtrain.parallel.precision import LossScaler
from shardtrain.train.observe.metrics import device_peak_flops
from shardtrain.train.observe.records import format_record
from shardtrain.train.trainer import Trainer


def test_loss_scaler_rules():
    s = LossScaler(dynamic=True, initial=8.0, growth_interval=3, hysteresis=2, min_scale=2.0)
    inf, one = torch.tensor(float("inf")), torch.tensor(1.0)
    assert s.update(inf) and s.scale == 8.0  # the first overflow is tolerated (hysteresis)
    assert s.update(torch.tensor(float("nan"))) and s.scale == 4.0
    assert s.update(inf) and s.scale == 2.0  # no growth since: each overflow halves
    assert [s.update(one) for _ in range(3)] == [False] * 3 and s.scale == 4.0  # grown x2
    state = s.state_dict()
    assert s.update(inf) and s.scale == 4.0  # growth refilled the tolerance
    assert s.update(inf) and s.scale == 2.0 and not s.bad  # overflows scaling explains
    assert s.update(inf) and s.bad and s.scale == 2.0  # at the minimum: a bad step
    assert s.update(one, loss=torch.tensor(float("nan"))) and s.bad  # a NaN loss: bad...
    assert s.scale == 2.0 and s.clean_steps == 0  # ... and the scale stays put
    assert not s.update(one, loss=one) and not s.bad
    restored = LossScaler(dynamic=True)
    restored.load_state_dict(state)
    assert restored.state_dict() == state
    static = LossScaler(dynamic=False, initial=8.0)
    assert static.scale == 1.0 and static.update(inf) and static.scale == 1.0 and static.bad
    assert static.update(one, loss=torch.tensor(float("inf"))) and static.bad


def test_fp16_checkpoint_holds_the_scaler(tmp_path):
    state = {"scale": 1024.0, "clean_steps": 1, "tolerance": 1}
    cfg = tiny(tmp_path, "scaler", "--train.precision", "fp16", "--train.steps", "2")
    first = Trainer(cfg, make_mesh(cfg, 0, 1), torch.device("cpu"))
    first.train_step()
    first.parallel.scaler.load_state_dict(state)
    first.save()
    cfg.checkpoint.resume = "latest"
    resumed = Trainer(cfg, make_mesh(cfg, 0, 1), torch.device("cpu"))
    assert resumed.step == 1 and resumed.parallel.scaler.state_dict() == state
    assert resumed.train_step()["loss_scale"] == 1024.0


def test_precision_config_errors(tmp_path):
    tiny(tmp_path, "ok", "--train.precision", "fp16", "--train.grad_reduce_dtype", "bf16"
         ).validate(1)
    with pytest.raises(ConfigError, match="train.grad_reduce_dtype"):
        tiny(tmp_path, "bad", "--train.grad_reduce_dtype", "bf16", "--comm.compress", "int8"
             ).validate(1)
    with pytest.raises(ConfigError, match="loss_scale.min_scale"):
        tiny(tmp_path, "bad", "--loss_scale.min_scale", "1e6").validate(1)
    with pytest.raises(ConfigError, match="train.precision"):
        tiny(tmp_path, "bad", "--train.precision", "fp8")


def test_mfu_peak_follows_the_precision_and_an_unknown_gpu_gives_null(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert device_peak_flops(cuda, 0.0, "bf16") == device_peak_flops(cuda, 0.0, "fp16") == 989.4e12
    allowed = torch.backends.cuda.matmul.allow_tf32
    try:
        for flag, peak in ((False, 67e12), (True, 494.7e12)):  # fp32 matmuls as fp32 or tf32
            torch.backends.cuda.matmul.allow_tf32 = flag
            assert device_peak_flops(cuda, 0.0, "fp32") == peak
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed
    assert device_peak_flops(cuda, 5e14, "bf16") == 5e14  # train.peak_flops wins
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Mystery GPU 9000")
    with pytest.warns(UserWarning, match="train.peak_flops"):
        assert device_peak_flops(cuda, 0.0, "bf16") is None
    record = {"step": 1, "loss": 1.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1.0,
              "mfu": None, "skipped": True, "loss_scale": 65536.0}
    assert "mfu n/a" in format_record(record) and "skipped" in format_record(record)

"""GPU check of compiled blocks (train.compile): the default model trained in one process
on CUDA, eager and compiled, steps alternated (benchmarks/compile_throughput.py); the
losses must agree, and the tokens/s of each and their ratio are printed.

Run where CUDA exists: `python -m pytest tests/gpu -q -s`; skipped elsewhere (the CPU
suite's tests/test_compile.py checks compiled against eager on the CPU's inductor).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from compile_throughput import compare  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device: this check compiles for a GPU")


def test_compiled_default_model_tokens_per_s(tmp_path):
    r = compare("default", ["--train.device", "cuda"], steps=20, warmup=3, run_dir=tmp_path)
    print(f"\ndefault model on {torch.cuda.get_device_name()}: eager "
          f"{r['eager_tokens_per_s']:.0f} tokens/s, compiled {r['compiled_tokens_per_s']:.0f} "
          f"(x{r['ratio']:.2f}), compile {r['compile_s']:.1f} s")
    assert r["device"].startswith("cuda")
    # fp32 on CUDA: inductor's fused kernels reorder sums, and TF32 is not enabled here.
    assert r["worst_loss_deviation"] < 1e-4

"""The CPU calibration file: what a measuring run found about this machine (pure I/O).

Schema (JSON object, all keys required):
    {"flops_per_s": float,        achieved fp32 matmul FLOP/s of one process
     "alpha_s": float,            per-message latency between two local processes
     "beta_s_per_byte": float,    seconds per byte between two local processes
     "gamma_s_per_byte": float,   seconds per byte of a local reduction (a + b)
     "cores": int,                CPU cores the measurement saw
     "measured_at": str,          ISO-8601 time of the measurement
     "efficiency": float,         optional (default 1.0): a training step's model FLOP/s over
                                  flops_per_s, measured on a reference transformer
     "shared_s_per_byte": float,  optional (default 0): seconds per byte of all processes'
                                  traffic together, the host they share (cost/collectives.py Link)
     "native_alpha_s": float,     optional (default alpha_s): latency per round of the
                                  backend's own collectives
     "staging_s_per_byte": float} optional (default 0): seconds per byte of the fresh
                                  temporaries the backend's own collectives stage through
Optional keys missing from a file (one written before they existed) take their defaults.
The measuring code (it runs torch) lives outside the planner and calls `save`.

A second, smaller file holds the runtime base (`RuntimeBase`, cpu_runtime.json): the
resident bytes a CPU process of shardtrain holds beyond its tensors at a step's peak (the
Python interpreter, torch's libraries and their data, malloc's own overhead), measured once
per machine and torch version (train/start/calibrate.py `runtime_base`) and added to the
planner's tensor bytes for the CPU dry run's predicted peak (docs/planner.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

from shardtrain.config import ConfigError
from shardtrain.cost.link import Link

DEFAULT_PATH = Path("~/.cache/shardtrain/cpu_calibration.json")


@dataclass(frozen=True, kw_only=True)
class Calibration:
    flops_per_s: float
    alpha_s: float
    beta_s_per_byte: float
    gamma_s_per_byte: float
    cores: int
    measured_at: str
    efficiency: float = 1.0
    shared_s_per_byte: float = 0.0
    native_alpha_s: float | None = None  # None: alpha_s
    staging_s_per_byte: float = 0.0

    def link(self) -> Link:
        """The figures as the cost model's link: local processes on Gloo (native's latency
        defaults to ours)."""
        return Link(backend="gloo", alpha_s=self.alpha_s, beta_s_per_byte=self.beta_s_per_byte,
                    gamma_s_per_byte=self.gamma_s_per_byte,
                    shared_s_per_byte=self.shared_s_per_byte,
                    native_alpha_s=self.native_alpha_s,
                    staging_s_per_byte=self.staging_s_per_byte)


# Used when no calibration exists: a small x86 machine (2-4 cores, AVX2 fp32 GEMM) with
# processes exchanging tensors through Gloo over loopback TCP. Measure to replace them.
DEFAULT = Calibration(flops_per_s=2e10, alpha_s=5e-5, beta_s_per_byte=1 / 2e9,
                      gamma_s_per_byte=1 / 4e9, cores=os.cpu_count() or 1,
                      measured_at="never (built-in defaults)")


RUNTIME_PATH = Path("~/.cache/shardtrain/cpu_runtime.json")


@dataclass(frozen=True, kw_only=True)
class RuntimeBase:
    bytes: int  # resident bytes beyond the tensors at a step's peak
    torch: str  # the torch version measured (another version: measure again)
    measured_at: str  # ISO-8601


def load_runtime(torch_version: str, path: str | os.PathLike | None = None
                 ) -> RuntimeBase | None:
    """The stored runtime base for `torch_version`, or None (no file, another torch, or a
    file this code cannot read: measure again)."""
    file = Path(path if path is not None else RUNTIME_PATH).expanduser()
    try:
        data = json.loads(file.read_text())
        base = RuntimeBase(bytes=int(data["bytes"]), torch=str(data["torch"]),
                           measured_at=str(data["measured_at"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return base if base.torch == torch_version and base.bytes >= 0 else None


def save_runtime(base: RuntimeBase, path: str | os.PathLike | None = None) -> Path:
    return _write(Path(path if path is not None else RUNTIME_PATH).expanduser(),
                  dataclasses.asdict(base))


def resolve(path: str | os.PathLike | None = None) -> Path:
    return Path(path if path is not None else DEFAULT_PATH).expanduser()


def load(path: str | os.PathLike | None = None) -> Calibration | None:
    """The calibration at `path` (default DEFAULT_PATH), or None when there is none."""
    file = resolve(path)
    if not file.exists():
        return None
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file}: invalid calibration JSON: {e}; delete it or "
                          "re-measure") from None
    fields = {f.name: f.type for f in dataclasses.fields(Calibration) if f.name in data
              or f.default is dataclasses.MISSING}
    if not isinstance(data, dict) or set(fields) - set(data):
        missing = sorted(set(fields) - set(data)) if isinstance(data, dict) else list(fields)
        raise ConfigError(f"{file}: calibration lacks {', '.join(missing)}; re-measure")
    kinds = {"float": float, "int": int, "str": str,
             "float | None": lambda v: None if v is None else float(v)}
    try:
        return Calibration(**{name: kinds[kind](data[name]) for name, kind in fields.items()})
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{file}: a calibration value has the wrong type ({e}); "
                          "re-measure") from None


def save(calibration: Calibration, path: str | os.PathLike | None = None) -> Path:
    """Write the calibration atomically; returns the path."""
    return _write(resolve(path), dataclasses.asdict(calibration))


def _write(file: Path, data: dict) -> Path:
    """Write atomically (a temporary file renamed over the target); returns the path."""
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_suffix(file.suffix + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(file)
    return file

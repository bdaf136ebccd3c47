"""A link of the alpha-beta-gamma model (latency, inverse bandwidth, reduction cost) and
the cost of one collective over it. The forms that turn a link into a collective's time are
in collectives.py; hardware.py and calibration.py produce links from datasheets and from
measurements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

BACKENDS = ("nccl", "gloo")


@dataclass(frozen=True, kw_only=True)
class Link:
    """One tier of the network as seen by one rank: latency, inverse bandwidth, and the
    time per byte of the local reduction (gamma).

    `shared_s_per_byte` prices a medium every rank of the group shares, charged on the
    bytes all ranks send together: the memory bus and cores of one host when processes
    exchange through loopback or shared memory (there a ring and a tree that send the same
    total take the same time, whatever their critical paths). 0 on a network where each
    rank has a link of its own (full bisection bandwidth), the alpha-beta model proper."""

    alpha_s: float
    beta_s_per_byte: float
    gamma_s_per_byte: float = 0.0
    shared_s_per_byte: float = 0.0
    native_alpha_s: float | None = None  # the backend's own latency per round; None: alpha_s
    staging_s_per_byte: float = 0.0  # the backend's fresh temporaries (see the module doc)
    backend: str = "nccl"  # whose collectives `native` is: one of BACKENDS

    def __post_init__(self):
        if self.native_alpha_s is None:
            object.__setattr__(self, "native_alpha_s", self.alpha_s)
        if self.backend not in BACKENDS:
            raise ValueError(f"link backend {self.backend!r} is not one of {', '.join(BACKENDS)}")

    @classmethod
    def from_bandwidth(cls, *, bytes_per_s: float, latency_s: float,
                       reduce_bytes_per_s: float = math.inf,
                       shared_bytes_per_s: float = math.inf) -> Link:
        return cls(alpha_s=latency_s, beta_s_per_byte=1.0 / bytes_per_s,
                   gamma_s_per_byte=1.0 / reduce_bytes_per_s,
                   shared_s_per_byte=1.0 / shared_bytes_per_s)

    def figures(self) -> tuple[float, ...]:
        """(alpha, beta, gamma, shared, native alpha, staging): what travels between ranks
        and into files."""
        return (self.alpha_s, self.beta_s_per_byte, self.gamma_s_per_byte,
                self.shared_s_per_byte, self.native_alpha_s, self.staging_s_per_byte)

    @classmethod
    def from_figures(cls, figures, backend: str = "nccl") -> Link:
        """From `figures()` (or the first four alone: native's latency is then ours)."""
        values = [float(f) for f in figures]
        if len(values) not in (4, 6):
            raise ValueError(f"link figures are (alpha, beta, gamma, shared[, native alpha, "
                             f"staging]); got {len(values)} values")
        alpha, beta, gamma, shared = values[:4]
        native, staging = values[4:] or (alpha, 0.0)
        return cls(alpha_s=alpha, beta_s_per_byte=beta, gamma_s_per_byte=gamma,
                   shared_s_per_byte=shared, native_alpha_s=native, staging_s_per_byte=staging,
                   backend=backend)


@dataclass(frozen=True, kw_only=True)
class Cost:
    time_s: float
    sent_bytes: float  # the busiest rank
    sent_bytes_mean: float  # averaged over the ranks
    rounds: int

    def __add__(self, other: Cost) -> Cost:
        return Cost(time_s=self.time_s + other.time_s,
                    sent_bytes=self.sent_bytes + other.sent_bytes,
                    sent_bytes_mean=self.sent_bytes_mean + other.sent_bytes_mean,
                    rounds=self.rounds + other.rounds)


ZERO = Cost(time_s=0.0, sent_bytes=0.0, sent_bytes_mean=0.0, rounds=0)

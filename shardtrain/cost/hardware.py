"""Device presets: compute, memory and network figures per GPU kind, every one overridable.

Figures are vendor datasheet peaks (dense, no sparsity): bf16 tensor-core FLOP/s, fp32
FLOP/s without TF32 (PyTorch's default for fp32 matmuls), HBM capacity (the marketed
figure read as GiB, which is what nvidia-smi reports to within 1%) and bandwidth. Links
are per GPU and per direction: NVLink's marketed figure is bidirectional, so half of it
is used (A100 600 GB/s -> 300, H100/H200 900 -> 450, B200 1.8 TB/s -> 900); without
NVLink the intra-node link is PCIe. The network is the node's total per direction (DGX
A100: 8 x 200 Gb/s = 200 GB/s; DGX H100/H200/B200: 8 x 400 Gb/s = 400 GB/s; the H100 PCIe
server is assumed to carry 4 x 400 Gb/s), shared by its GPUs. Latencies, the achievable
fraction of peak (`efficiency`) and the usable fraction of memory are planning
assumptions, not measurements; override them (`--hw.FIELD VALUE`) with your own.

The `cpu` preset describes local processes on this machine: its figures come from the
calibration file (see calibration.py) or its documented defaults; all ranks share one
node (gpus_per_node = 0) and its physical memory (each gets an equal share), train in
fp32, and exchange through Gloo.

`runtime_link` is what a running process group prices `auto` and the hierarchical phases
with: the calibration on CPU, the preset of the GPU the process drives on CUDA (a generic
PCIe figure for a GPU no preset names), never one for the other.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from dataclasses import dataclass
from typing import Any

from shardtrain.config import ConfigError
from shardtrain.cost import calibration
from shardtrain.cost.link import BACKENDS, Link

GiB = 2 ** 30


@dataclass(frozen=True, kw_only=True)
class Hardware:
    name: str
    peak_flops: float  # dense bf16 FLOP/s per device
    peak_flops_fp32: float
    efficiency: float = 0.7  # achievable fraction of peak on a transformer's matmuls
    memory_bytes: float
    usable_fraction: float = 0.9  # the rest: CUDA context, allocator fragmentation
    memory_bw: float  # HBM bytes/s
    intra_bw: float  # per GPU per direction inside a node (NVLink or PCIe), bytes/s
    intra_latency_s: float = 2e-6
    inter_bw_per_node: float  # the node's network bandwidth per direction, bytes/s
    inter_latency_s: float = 5e-6
    gpus_per_node: int = 8  # 0: every device on one node
    host_bw: float  # device <-> host per GPU per direction (offload), bytes/s
    host_memory_bytes: float  # the node's host memory per GPU: what offload may fill
    nvme_bw: float  # per node, bytes/s
    reduce_bw: float = 0.0  # bytes/s of a local reduction; 0: one pass over memory_bw
    shared_bw: float = 0.0  # bytes/s of all ranks' traffic on a medium they share; 0: none
    native_latency_s: float = 0.0  # per round of the backend's own collectives; 0: the link's
    staging_bw: float = 0.0  # bytes/s of the backend's fresh temporaries (cost/collectives.py); 0: none
    backend: str = "nccl"  # whose collectives `native` prices (cost/collectives.py BACKENDS)
    default_precision: str = "bf16"

    def flops(self, precision: str) -> float:
        """Peak FLOP/s for the precision: the denominator of MFU and HFU."""
        return self.peak_flops_fp32 if precision == "fp32" else self.peak_flops

    def node_size(self, gpus: int) -> int:
        return self.gpus_per_node or gpus

    @property
    def usable_bytes(self) -> float:
        return self.memory_bytes * self.usable_fraction

    def intra_link(self) -> Link:
        return self._link(self.intra_bw, self.intra_latency_s)

    def inter_link(self) -> Link:
        """One GPU's share of the node's network: every GPU of the node runs its own group."""
        return self._link(self.inter_bw_per_node / max(1, self.gpus_per_node),
                          self.inter_latency_s)

    def _link(self, bytes_per_s: float, latency_s: float) -> Link:
        link = Link.from_bandwidth(bytes_per_s=bytes_per_s, latency_s=latency_s,
                                   reduce_bytes_per_s=self.reduce_bw or self.memory_bw,
                                   shared_bytes_per_s=self.shared_bw or math.inf)
        return dataclasses.replace(link, native_alpha_s=self.native_latency_s or latency_s,
                                   staging_s_per_byte=1 / self.staging_bw if self.staging_bw
                                   else 0.0, backend=self.backend)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: an unlimited bandwidth (inf) is null."""
        return {k: None if v == math.inf else v for k, v in dataclasses.asdict(self).items()}


_DGX_A100 = dict(peak_flops=312e12, peak_flops_fp32=19.5e12, intra_bw=300e9,
                 inter_bw_per_node=200e9, host_bw=32e9, nvme_bw=25e9)
# Host memory per GPU: DGX A100 1 TB (40 GB GPUs) or 2 TB (80 GB), DGX H100/H200 2 TB,
# DGX B200 4 TB, over 8 GPUs
_DGX_H100 = dict(peak_flops=989e12, peak_flops_fp32=67e12, memory_bytes=80 * GiB,
                 memory_bw=3.35e12, intra_bw=450e9, inter_bw_per_node=400e9, host_bw=64e9,
                 nvme_bw=50e9, host_memory_bytes=256 * GiB)

PRESETS: dict[str, Hardware] = {
    "a100-40gb": Hardware(name="a100-40gb", memory_bytes=40 * GiB, memory_bw=1.555e12,
                          host_memory_bytes=128 * GiB, **_DGX_A100),
    "a100-80gb": Hardware(name="a100-80gb", memory_bytes=80 * GiB, memory_bw=2.039e12,
                          host_memory_bytes=256 * GiB, **_DGX_A100),
    "h100-sxm": Hardware(name="h100-sxm", **_DGX_H100),
    "h100-pcie": Hardware(name="h100-pcie", peak_flops=756e12, peak_flops_fp32=51e12,
                          memory_bytes=80 * GiB, memory_bw=2.0e12, intra_bw=64e9,
                          inter_bw_per_node=200e9, host_bw=64e9, nvme_bw=25e9,
                          host_memory_bytes=256 * GiB),
    "h200": Hardware(name="h200", **(_DGX_H100 | dict(memory_bytes=141 * GiB,
                                                      memory_bw=4.8e12))),
    "b200": Hardware(name="b200", peak_flops=2.25e15, peak_flops_fp32=75e12,
                     memory_bytes=180 * GiB, memory_bw=8e12, intra_bw=900e9,
                     inter_bw_per_node=400e9, host_bw=64e9, nvme_bw=50e9,
                     host_memory_bytes=512 * GiB),
}
ALIASES = {"a100": "a100-80gb", "h100": "h100-sxm"}
NAMES = tuple(PRESETS) + tuple(ALIASES) + ("cpu",)


def cpu(calibration_path: str | os.PathLike | None = None, processes: int = 1) -> Hardware:
    """`processes` local processes on this machine, from the calibration (or its defaults)."""
    cal = calibration.load(calibration_path) or calibration.DEFAULT
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / max(1, processes)
    bandwidth = _inverse(cal.beta_s_per_byte)  # 0 when the shared medium is all that costs
    return Hardware(name="cpu", peak_flops=cal.flops_per_s, peak_flops_fp32=cal.flops_per_s,
                    efficiency=cal.efficiency, memory_bytes=float(pages), usable_fraction=0.8,
                    memory_bw=_inverse(cal.gamma_s_per_byte), intra_bw=bandwidth,
                    intra_latency_s=cal.alpha_s, inter_bw_per_node=bandwidth,
                    inter_latency_s=cal.alpha_s, gpus_per_node=0, host_bw=bandwidth,
                    host_memory_bytes=float(pages),
                    nvme_bw=1e9, reduce_bw=_inverse(cal.gamma_s_per_byte),
                    shared_bw=_inverse(cal.shared_s_per_byte) if cal.shared_s_per_byte else 0.0,
                    native_latency_s=cal.link().native_alpha_s,
                    staging_bw=_inverse(cal.staging_s_per_byte) if cal.staging_s_per_byte else 0.0,
                    backend="gloo", default_precision="fp32")


def _inverse(seconds_per_byte: float) -> float:
    return 1.0 / seconds_per_byte if seconds_per_byte > 0 else math.inf


def get(name: str, overrides: dict[str, str] | None = None, *,
        calibration_path: str | os.PathLike | None = None, processes: int = 1) -> Hardware:
    """A preset by name (or alias) with `field -> value` overrides applied; `processes`
    sharing the machine matters to the cpu preset only."""
    key = ALIASES.get(name.lower(), name.lower())
    if key == "cpu":
        hw = cpu(calibration_path, processes)
    elif key in PRESETS:
        hw = PRESETS[key]
    else:
        raise ConfigError(f"unknown --gpu {name!r}; one of {', '.join(NAMES)}")
    types = {f.name: f.type for f in dataclasses.fields(Hardware)}
    changes: dict[str, Any] = {}
    for field, raw in (overrides or {}).items():
        if field not in types or field == "name":
            close = difflib.get_close_matches(field, list(types), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"unknown hardware field --hw.{field}{hint} "
                            f"(valid: {', '.join(t for t in types if t != 'name')})")
        try:
            changes[field] = {"float": float, "int": int, "str": str}[types[field]](raw)
        except ValueError:
            raise ConfigError(f"--hw.{field}={raw!r} is not a valid {types[field]}") from None
    if changes.get("backend", hw.backend) not in BACKENDS:
        raise ConfigError(f"--hw.backend={changes['backend']!r} is not one of "
                          f"{', '.join(BACKENDS)}")
    return dataclasses.replace(hw, **changes)


# A GPU no preset names: PCIe 4.0 x16 between GPUs (about 25 GB/s per direction achieved),
# a 100 Gb/s NIC per node, modest HBM. Conservative on purpose: it only steers `auto`.
GENERIC_PCIE = Hardware(name="generic-pcie", peak_flops=100e12, peak_flops_fp32=20e12,
                        memory_bytes=24 * GiB, memory_bw=1e12, intra_bw=25e9,
                        intra_latency_s=10e-6, inter_bw_per_node=12.5e9, host_bw=25e9,
                        nvme_bw=5e9, host_memory_bytes=64 * GiB)
# CUDA device names (torch.cuda.get_device_name) -> preset, first match wins.
_GPU_NAMES = (("H100 PCIe", "h100-pcie"), ("H100", "h100-sxm"), ("H200", "h200"),
              ("B200", "b200"), ("A100-SXM4-40GB", "a100-40gb"), ("A100-PCIE-40GB", "a100-40gb"),
              ("A100", "a100-80gb"))


def gpu_preset(device_name: str) -> Hardware:
    """The preset of a CUDA device name ("NVIDIA H100 80GB HBM3"), or GENERIC_PCIE."""
    for needle, key in _GPU_NAMES:
        if needle.lower() in device_name.lower():
            return PRESETS[key]
    return GENERIC_PCIE


def runtime_link(device_type: str, *, gpu_name: str = "", across_nodes: bool = False,
                 calibration_path: str | os.PathLike | None = None) -> Link:
    """The link a runtime group on `device_type` ("cpu" or "cuda") prices its collectives
    with: a GPU's inter-node share when the group spans nodes, its intra-node link when not;
    on CPU this machine's calibration (or its defaults), local processes on Gloo."""
    if device_type == "cuda":
        hw = gpu_preset(gpu_name)
        return hw.inter_link() if across_nodes else hw.intra_link()
    return (calibration.load(calibration_path) or calibration.DEFAULT).link()

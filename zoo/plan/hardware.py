"""The machines the planner knows: one set of constants per GPU type, all in this file.

Data-sheet figures (NVIDIA's A100, H100, H200 and B200 data sheets; DGX system guides for the node layout):
dense bf16 tensor-core peak, memory, HBM bandwidth, NVLink bandwidth per GPU and direction, and the inter-node
bandwidth per GPU (DGX A100: one 200 Gb/s HDR InfiniBand port per GPU; DGX H100/H200/B200: one 400 Gb/s NDR port
per GPU).

Achieved fractions (the only constants not on a data sheet, the same for every layout and model):
``matmul_efficiency`` is the share of the peak that large bf16 GEMMs sustain (cuBLAS on an A100 reaches ~70-80%
on Transformer-sized shapes; the A100 value is the one figure set against Megatron's published runs, see
``zoo.plan``); ``attention_efficiency`` the share that fused (flash) attention sustains on its FLOPs, lower than
a GEMM's (FlashAttention-2 reports ~50-70% of an A100's peak); ``bandwidth_efficiency`` the share of a link's
or HBM's nominal bandwidth that NCCL rings and elementwise kernels reach (~80%). ``reserved_gb`` is what a
process holds besides tensors (CUDA context, NCCL buffers, allocator fragmentation).

A cluster YAML gives the same fields by name (``launch/plan.py --cluster FILE``); any field it leaves out takes
the value of the GPU named by its ``base`` field (default ``a100-80g``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path

GB = 1e9
GiB = 2**30


@dataclass(frozen=True)
class GPU:
    name: str
    peak_tflops: float  # dense bf16/fp16 tensor-core peak per GPU, TFLOP/s
    memory_gb: float  # usable device memory, GiB (what the allocator can hand out)
    hbm_gbps: float  # HBM bandwidth, GB/s
    gpus_per_node: int
    intra_node_gbps: float  # NVLink, per GPU and direction, GB/s
    inter_node_gbps: float  # network, per GPU and direction, GB/s
    matmul_efficiency: float = 0.72
    attention_efficiency: float = 0.50
    bandwidth_efficiency: float = 0.80
    intra_latency_us: float = 10.0  # per collective or message
    inter_latency_us: float = 25.0
    reserved_gb: float = 2.5
    fp32_tflops: float | None = None  # fp32 GEMM rate (TF32 off); None: peak / 16
    # what DeepSpeed's activation checkpointing keeps per block besides its input: the CPU generator's state
    # (5,056 bytes), the device's and the model-parallel tracker's (16 bytes each on CUDA)
    checkpoint_state_bytes: int = 5056 + 16 + 16

    @property
    def fp32_peak(self) -> float:
        return self.fp32_tflops if self.fp32_tflops is not None else self.peak_tflops / 16


GPUS: dict[str, GPU] = {g.name: g for g in [
    GPU("a100-40g", peak_tflops=312.0, memory_gb=40.0, hbm_gbps=1555.0, gpus_per_node=8, intra_node_gbps=300.0,
        inter_node_gbps=25.0, fp32_tflops=19.5),
    GPU("a100-80g", peak_tflops=312.0, memory_gb=80.0, hbm_gbps=2039.0, gpus_per_node=8, intra_node_gbps=300.0,
        inter_node_gbps=25.0, fp32_tflops=19.5),
    GPU("h100", peak_tflops=989.5, memory_gb=79.6, hbm_gbps=3350.0, gpus_per_node=8, intra_node_gbps=450.0,
        inter_node_gbps=50.0, fp32_tflops=67.0),
    GPU("h200", peak_tflops=989.5, memory_gb=140.4, hbm_gbps=4800.0, gpus_per_node=8, intra_node_gbps=450.0,
        inter_node_gbps=50.0, fp32_tflops=67.0),
    GPU("b200", peak_tflops=2250.0, memory_gb=179.0, hbm_gbps=8000.0, gpus_per_node=8, intra_node_gbps=900.0,
        inter_node_gbps=50.0, fp32_tflops=75.0),
]}


# A CPU host as the device (zoo's tests and laptop runs): only its memory figures are used, to hold the memory
# model against runs measured on it. There DeepSpeed's "device" generator is the CPU's own.
CPU = GPU("cpu", peak_tflops=1.0, memory_gb=16.0, hbm_gbps=20.0, gpus_per_node=1, intra_node_gbps=10.0,
          inter_node_gbps=1.0, reserved_gb=0.0, checkpoint_state_bytes=3 * 5056)


class HardwareError(ValueError):
    """An unknown GPU or a bad cluster file; the message is one line."""


def get_gpu(name: str) -> GPU:
    key = name.lower()
    if key not in GPUS:
        raise HardwareError(f"unknown GPU {name!r}; known: {', '.join(GPUS)} (or describe yours in a YAML file: "
                            f"--cluster FILE with the fields of zoo.plan.hardware.GPU)")
    return GPUS[key]


def load_cluster(path: str | Path) -> GPU:
    """A GPU description from YAML: ``base`` (a known GPU, default a100-80g) plus any fields of ``GPU``."""
    import yaml

    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except OSError as e:
        raise HardwareError(f"cannot read cluster file {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise HardwareError(f"cluster file {path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise HardwareError(f"cluster file {path} must hold a mapping of GPU fields, got {type(raw).__name__}")
    base = get_gpu(str(raw.pop("base", "a100-80g")))
    known = {f.name: f.type for f in fields(GPU)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise HardwareError(f"cluster file {path}: unknown field(s) {unknown}; known: base, {', '.join(known)}")
    for key, value in raw.items():
        if key != "name" and not (isinstance(value, (int, float)) and value > 0):
            raise HardwareError(f"cluster file {path}: {key} must be a positive number, got {value!r}")
    return replace(base, **{"name": f"{path.stem}", **raw})

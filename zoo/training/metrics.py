"""Throughput figures from the model's own FLOP count: TFLOP/s per device and MFU.

Forward FLOPs of one token at sequence length s (a multiply-add is 2 FLOPs; causal attention counted in full, as
Megatron does):

    per layer:  2h(nq + 2 nkv)d        QKV projection (grouped-query attention: nkv <= nq key/value heads)
              + 2 nq d h               attention output projection
              + 4 s nq d               scores QK^T and the weighted sum over V (a sliding-window layer, W < s:
                                       4 W nq d, its W keys per query counted in full as s are without one)
              + 2 h f k                MLP, k = 2 matrices (GELU) or 3 (SwiGLU: gate, up, down)
    MoE layers (zoo.models.moe) count the parameters one token uses, instead of the MLP:
              + 2 h E                  router logits over the E experts
              + K 2 h f_e k            the K = num_experts_per_tok experts the token is routed to
              + 2 h f_s k [+ 2 h]      the shared expert (and its sigmoid gate), if any
    head:       2 h V                  logits

Training costs 3 forwards (backward = 2), plus one more forward of every block when activations are recomputed.
For GPT-2 shapes (nq = nkv, nq d = h, f = 4h, GELU) with recomputation this is exactly Megatron-LM's
96 B s l h^2 (1 + s/6h + V/16lh) (Narayanan et al. 2021, eq. 3), as the tests check.
"""

from __future__ import annotations

import os
import resource
import sys
from pathlib import Path

# Dense bf16/fp16 tensor-core peaks in TFLOP/s, by a substring of the device name (vendor data sheets).
PEAK_TFLOPS_16BIT = {"H200": 989.5, "H100": 989.5, "H800": 989.5, "A100": 312.0, "A800": 312.0, "L40S": 362.0,
                     "A10G": 125.0, "V100": 125.0, "MI300X": 1307.4, "MI250X": 383.0}


def forward_flops_per_token(config, seq_length: int) -> float:
    h, L, s = config.hidden_size, config.num_hidden_layers, seq_length
    nq, f = config.num_attention_heads, config.intermediate_size
    mlp_matrices = 3 if config.gated_mlp else 2
    mlp = 2 * h * f * mlp_matrices
    window = getattr(config, "attention_window", lambda i: None)
    total = 0
    for i in range(L):
        # a GPT's layers may differ in head dim and kv heads (Gemma 4's full-attention layers), and hold no v rows
        d = config.layer_head_dim(i) if hasattr(config, "layer_head_dim") else config.head_dim
        nkv = config.layer_kv_heads(i) if hasattr(config, "layer_kv_heads") else config.num_key_value_heads
        kv = 1 if getattr(config, "layer_k_eq_v", lambda i: False)(i) else 2
        attention = 2 * h * (nq + kv * nkv) * d + 2 * nq * d * h + 4 * min(s, window(i) or s) * nq * d
        if getattr(config, "num_experts", 0) and config.is_moe_layer(i):
            total += attention + 2 * h * config.num_experts + 2 * h * mlp_matrices * (
                config.num_experts_per_tok * config.expert_intermediate_size + config.shared_intermediate_size)
            total += 2 * h * config.shared_expert_gate
        else:
            total += attention + mlp
    return total + 2 * h * config.vocab_size


def training_flops_per_token(config, seq_length: int, recompute: bool = False) -> float:
    fwd = forward_flops_per_token(config, seq_length)
    head = 2 * config.hidden_size * config.vocab_size
    blocks = fwd - head
    return 3 * fwd + (blocks if recompute else 0)


def peak_tflops(device_name: str | None, precision: str) -> float | None:
    """The device's dense peak for this precision where known (None on CPUs and unknown devices)."""
    if device_name is None or precision not in ("bf16", "fp16"):
        return None
    for key, value in PEAK_TFLOPS_16BIT.items():
        if key in device_name:
            return value
    return None


def device_name() -> str | None:
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    if accel.device_name() == "cpu":
        return None
    try:
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else accel.device_name()
    except Exception:
        return accel.device_name()


def peak_memory_gb() -> float:
    """Peak device memory allocated by this process; on CPU, the process's peak resident set size."""
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    if accel.device_name() != "cpu":
        return accel.max_memory_allocated() / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def resident_memory_gb() -> float | None:
    """This process's resident memory now (Linux: /proc/self/statm), for watching a long run stay flat."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**30

"""Qwen2MoeForCausalLM: the shared MoE pieces (``moe.py``) with Qwen2-MoE's differences.

q/k/v biases (``qkv_bias``); a shared expert of ``shared_expert_intermediate_size`` behind a sigmoid gate;
``norm_topk_prob``; dense layers where ``mlp_only_layers`` / ``decoder_sparse_step`` say (of ``intermediate_size``;
experts of ``moe_intermediate_size``); only the layers ``layer_types`` marks slide. Refused besides the shared
refusals: ``shared_expert_intermediate_size`` 0.
"""

from __future__ import annotations

import torch

from zoo.convert.hf import moe
from zoo.convert.hf.common import refusal
from zoo.models.gpt import GPTConfig

NAME = "Qwen2MoeForCausalLM"


def to_zoo(c) -> GPTConfig:
    fields = {**moe.base_fields(NAME, c, sliding_by_layer_types=True), **moe.qwen_fields(c)}
    refusal(NAME)(c.shared_expert_intermediate_size > 0, "shared_expert_intermediate_size 0 is not supported")
    return moe.gpt_config({**fields, "qkv_bias": bool(c.qkv_bias), "num_shared_experts": 1,
                           "shared_expert_intermediate_size": c.shared_expert_intermediate_size,
                           "shared_expert_gate": True})


def exports(cfg: GPTConfig) -> bool:
    return bool(cfg.num_experts) and cfg.qk_norm not in ("head", "full") and bool(cfg.num_shared_experts)


def rules(cfg: GPTConfig) -> list:
    return [(cfg.shared_expert_gate, "the shared expert behind its sigmoid gate (shared_expert_gate)")]


def to_hf(cfg: GPTConfig, dtype: torch.dtype, special: dict):
    from transformers import Qwen2MoeConfig

    c = Qwen2MoeConfig(shared_expert_intermediate_size=cfg.shared_intermediate_size, qkv_bias=cfg.use_qkv_bias,
                       **moe.qwen_hf_fields(cfg), **moe.hf_fields(cfg, NAME, special))
    c.dtype = dtype
    return c


def _config_class():
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig


ARCHITECTURES = moe.architecture(NAME, _config_class, to_zoo, to_hf, "qwen2_moe", exports, rules)

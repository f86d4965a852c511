"""Qwen3MoeForCausalLM: the shared MoE pieces (``moe.py``) with Qwen3-MoE's differences.

Qwen2-MoE's layer choice and widths, no shared expert, no biases, RMSNorm of q and k over each head
(``qk_norm="head"``), any ``head_dim``.
"""

from __future__ import annotations

import torch

from zoo.convert.hf import moe
from zoo.models.gpt import GPTConfig

NAME = "Qwen3MoeForCausalLM"


def to_zoo(c) -> GPTConfig:
    return moe.gpt_config({**moe.base_fields(NAME, c), **moe.qwen_fields(c), "qk_norm": "head"})


def exports(cfg: GPTConfig) -> bool:
    return bool(cfg.num_experts) and cfg.qk_norm == "head"


def rules(cfg: GPTConfig) -> list:
    return [(not cfg.num_shared_experts, "no shared expert"), (not cfg.use_qkv_bias, "no q/k/v bias")]


def to_hf(cfg: GPTConfig, dtype: torch.dtype, special: dict):
    from transformers import Qwen3MoeConfig

    c = Qwen3MoeConfig(attention_bias=False, **moe.qwen_hf_fields(cfg), **moe.hf_fields(cfg, NAME, special))
    c.dtype = dtype
    return c


def _config_class():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig


ARCHITECTURES = moe.architecture(NAME, _config_class, to_zoo, to_hf, "qwen3_moe", exports, rules)

"""Qwen3MoeForCausalLM: the shared MoE pieces (``moe.py``) with Qwen3-MoE's differences.

Qwen2-MoE's layer choice and widths, no shared expert, no biases, RMSNorm of q and k over each head
(``qk_norm="head"``), any ``head_dim``. Its window is Mistral's: with ``use_sliding_window`` every layer slides
(Qwen3MoeConfig has no ``max_window_layers`` or ``layer_types``; its model reads ``sliding_window`` on every layer),
so a window shorter than the context imports as zoo's ``sliding_window`` with ``layer_types`` None, and exports
back with ``use_sliding_window``; a zoo MoE GPT whose layers' windows differ is refused.
"""

from __future__ import annotations

import torch

from zoo.convert.hf import llama, moe
from zoo.models.gpt import GPTConfig

NAME = "Qwen3MoeForCausalLM"


def to_zoo(c) -> GPTConfig:
    fields = moe.base_fields(NAME, c, windows=llama.window_every_layer)
    return moe.gpt_config({**fields, **moe.qwen_fields(c), "qk_norm": "head"})


def exports(cfg: GPTConfig) -> bool:
    return bool(cfg.num_experts) and cfg.qk_norm == "head"


def rules(cfg: GPTConfig) -> list:
    return [(not cfg.num_shared_experts, "no shared expert"), (not cfg.use_qkv_bias, "no q/k/v bias"),
            (moe.one_window(cfg), "one sliding_window on every layer or none (no layer_types)")]


def to_hf(cfg: GPTConfig, dtype: torch.dtype, special: dict):
    from transformers import Qwen3MoeConfig

    c = Qwen3MoeConfig(attention_bias=False, **moe.qwen_hf_fields(cfg), **moe.hf_fields(cfg, NAME, special))
    c.dtype = dtype
    return c


def _config_class():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig


ARCHITECTURES = moe.architecture(NAME, _config_class, to_zoo, to_hf, "qwen3_moe", exports, rules)

"""Qwen2MoeForCausalLM: the shared MoE pieces (``moe.py``) with Qwen2-MoE's differences.

q/k/v biases (``qkv_bias``); a shared expert of ``shared_expert_intermediate_size`` behind a sigmoid gate;
``norm_topk_prob``; dense layers where ``mlp_only_layers`` / ``decoder_sparse_step`` say (of ``intermediate_size``;
experts of ``moe_intermediate_size``); only the layers ``layer_types`` marks slide (transformers derives it from
``use_sliding_window`` and ``max_window_layers`` when absent: the even-numbered layers, 0-based, below
``max_window_layers``), so a window shorter than the context imports as zoo's ``sliding_window`` with those
``layer_types``, and exports back with them written out. Refused besides the shared refusals:
``shared_expert_intermediate_size`` 0, sliding layers without ``use_sliding_window`` (their window would be 0).
"""

from __future__ import annotations

import torch

from zoo.convert.hf import llama, moe
from zoo.convert.hf.common import refusal
from zoo.models.gpt import GPTConfig

NAME = "Qwen2MoeForCausalLM"


def windows(c) -> dict:
    """The layers ``layer_types`` marks slide; Qwen2MoeConfig sets ``sliding_window`` 0 without
    ``use_sliding_window``."""
    types = list(getattr(c, "layer_types", None) or [])
    refusal(NAME)(c.use_sliding_window or "sliding_attention" not in types,
                  "layer_types has 'sliding_attention' layers but use_sliding_window is false (transformers gives "
                  "them a window of 0): set use_sliding_window true or make those layers full_attention")
    return llama.window_by_layer_types(c) if c.use_sliding_window else {}


def to_zoo(c) -> GPTConfig:
    fields = {**moe.base_fields(NAME, c, windows=windows), **moe.qwen_fields(c)}
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

    types = {} if llama.is_windowless(cfg) else {"layer_types": [
        "full_attention" if cfg.attention_window(i) is None else "sliding_attention"
        for i in range(cfg.num_hidden_layers)]}
    c = Qwen2MoeConfig(shared_expert_intermediate_size=cfg.shared_intermediate_size, qkv_bias=cfg.use_qkv_bias,
                       **moe.qwen_hf_fields(cfg), **types, **moe.hf_fields(cfg, NAME, special))
    c.dtype = dtype
    return c


def _config_class():
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig


ARCHITECTURES = moe.architecture(NAME, _config_class, to_zoo, to_hf, "qwen2_moe", exports, rules)

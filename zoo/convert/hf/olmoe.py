"""OlmoeForCausalLM: the shared MoE pieces (``moe.py``) with OLMoE's differences.

Every layer sparse; RMSNorm of q and k over the whole projection (``qk_norm="full"``); ``norm_topk_prob``.
Refused besides the shared refusals: ``clip_qkv`` (zoo does not clamp q, k, v).
"""

from __future__ import annotations

import torch

from zoo.convert.hf import moe
from zoo.convert.hf.common import refusal
from zoo.models.gpt import GPTConfig

NAME = "OlmoeForCausalLM"


def to_zoo(c) -> GPTConfig:
    fields = moe.base_fields(NAME, c)
    refusal(NAME)(c.clip_qkv is None, f"clip_qkv {c.clip_qkv} is not supported (zoo does not clamp q, k, v)")
    return moe.gpt_config({**fields, "norm_topk_prob": bool(c.norm_topk_prob), "qk_norm": "full"})


def exports(cfg: GPTConfig) -> bool:
    return bool(cfg.num_experts) and cfg.qk_norm == "full"


def rules(cfg: GPTConfig) -> list:
    return [(not cfg.num_shared_experts, "no shared expert"), (not cfg.use_qkv_bias, "no q/k/v bias"),
            (moe.all_sparse(cfg), "every layer sparse")]


def to_hf(cfg: GPTConfig, dtype: torch.dtype, special: dict):
    from transformers import OlmoeConfig

    c = OlmoeConfig(intermediate_size=cfg.expert_intermediate_size, num_experts=cfg.num_experts,
                    norm_topk_prob=cfg.norm_topk_prob, attention_bias=False, clip_qkv=None,
                    **moe.hf_fields(cfg, NAME, special))
    c.dtype = dtype
    return c


def _config_class():
    from transformers import OlmoeConfig

    return OlmoeConfig


ARCHITECTURES = moe.architecture(NAME, _config_class, to_zoo, to_hf, "olmoe", exports, rules)

"""Gemma3ForCausalLM (Gemma 3's text model) <-> zoo's GPT: Gemma 2's block (``gemma2.py``) with q/k norm and two
RoPE settings.

The differences: RMSNorm (1 + w) of q and k over each head (``qk_norm="head"`` with Gemma's ``norm_weight_offset=1``;
Qwen3's two norm rows, ``moe.qk_norm_rows``), and RoPE per layer type (transformers 5's nested ``rope_parameters``):
the full-attention layers use ``rope_theta`` with its scaling (Gemma 3 4B+: linear, factor 8), the sliding ones
plain RoPE with ``rope_local_base_freq`` (zoo's field of Gemma 3's old name). Soft-capping is off in its releases
but read as Gemma 2's. Refused, one line each: a scaled RoPE on the sliding layers, and what Gemma 2 refuses.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from zoo.convert.hf import gemma2, llama
from zoo.convert.hf.common import hf_special, refusal
from zoo.convert.hf.moe import qk_norm_rows
from zoo.convert.registry import Architecture
from zoo.convert.tables import Row, blocks
from zoo.models.gpt import FAMILY, GPTConfig

NAME = "Gemma3ForCausalLM"
FULL, SLIDING = "full_attention", "sliding_attention"


def table(cfg: GPTConfig) -> list[Row]:
    return gemma2.table(cfg) + qk_norm_rows(cfg)


def groups(cfg: GPTConfig, **_) -> list[list[Row]]:
    return list(blocks(table(cfg), cfg.num_hidden_layers))


def to_zoo(c) -> GPTConfig:
    need = refusal(NAME)
    params = dict(c.rope_parameters or {})
    full, sliding = params.get(FULL) or {}, params.get(SLIDING) or {}
    theta, scaling = llama.rope(c, full)
    local, local_scaling = llama.rope(c, sliding)
    need(local_scaling is None, f"rope_parameters[{SLIDING!r}] rope_type {sliding.get('rope_type')!r} is not "
                                f"supported (zoo's sliding layers take plain RoPE with rope_local_base_freq)")
    return gemma2.to_zoo(c, arch=NAME, rope_theta=theta, rope_scaling=scaling, rope_local_base_freq=local,
                         qk_norm="head")


def exports(cfg: GPTConfig) -> bool:
    """Gemma 2's block with per-head q/k norm (any local theta)."""
    return cfg.qk_norm == "head" and gemma2.exports(replace(cfg, qk_norm=None, rope_local_base_freq=None))


def to_hf(cfg: GPTConfig, dtype: torch.dtype, special: dict):
    from transformers import Gemma3TextConfig

    L = cfg.num_hidden_layers
    types = ["sliding_attention" if cfg.attention_window(i) else "full_attention" for i in range(L)]
    local = cfg.rope_theta if cfg.rope_local_base_freq is None else cfg.rope_local_base_freq
    rope = {FULL: llama.rope_parameters(cfg), SLIDING: llama.rope_parameters(cfg, local, None)}
    c = Gemma3TextConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=L, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=cfg.max_position_embeddings, initializer_range=cfg.initializer_range,
        rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_word_embeddings, rope_parameters=rope,
        attention_bias=False, attention_dropout=cfg.attention_dropout,
        query_pre_attn_scalar=cfg.query_pre_attn_scalar or cfg.head_dim,  # zoo's None: 1/sqrt(head_dim)
        sliding_window=cfg.sliding_window or cfg.max_position_embeddings, layer_types=types,
        final_logit_softcapping=cfg.final_logit_softcapping, attn_logit_softcapping=cfg.attn_logit_softcapping,
        architectures=[NAME], **hf_special(special))
    c.dtype = dtype
    return c


def _config_class():
    from transformers import Gemma3TextConfig  # imported on use: the registry imports every file

    return Gemma3TextConfig


ARCHITECTURES = {NAME: Architecture(
    NAME, FAMILY, _config_class, to_zoo, groups, to_hf, model_type="gemma3_text", exports=exports,
    export_needs="Gemma3ForCausalLM the same with qk_norm head")}

"""Gemma2ForCausalLM <-> zoo's GPT: Llama's keys (``llama.py``) with Gemma 2's differences as GPT config fields.

The differences: sandwich norms (``norm_placement="sandwich"``: HF's ``post_attention_layernorm`` is the norm of the
attention's output, zoo's ``attention_output_norm``; ``pre_feedforward_layernorm`` the MLP's input norm, zoo's
``post_attention_norm``; ``post_feedforward_layernorm`` zoo's ``mlp_output_norm``), RMSNorm as x (1 + w)
(``norm_weight_offset=1``), GeGLU (``hidden_activation="gelu_pytorch_tanh"``), the embeddings times sqrt(h), sliding
and full layers (``layer_types``, ``sliding_window``), attention and final logit soft-capping, the query scale
``query_pre_attn_scalar^-1/2`` and any ``head_dim``. Tied embeddings (no ``lm_head``) as released, untied read too.
Refused, one line each: another activation, attention biases, bidirectional attention.
"""

from __future__ import annotations

import math

import torch

from zoo.convert.hf import llama
from zoo.convert.hf.common import fields_off, hf_special, refusal, zoo_config
from zoo.convert.registry import Architecture
from zoo.convert.tables import Row, blocks, same
from zoo.models.gpt import FAMILY, GPTConfig

NAME = "Gemma2ForCausalLM"
LAYER = "model.layers.{}."
# zoo's block norm -> Gemma 2's: llama's row for post_attention_norm is renamed, the output norms are added.
NORMS = {"{}.post_attention_norm.weight": LAYER + "pre_feedforward_layernorm.weight",
         "{}.attention_output_norm.weight": LAYER + "post_attention_layernorm.weight",
         "{}.mlp_output_norm.weight": LAYER + "post_feedforward_layernorm.weight"}


def table(cfg: GPTConfig) -> list[Row]:
    h = cfg.hidden_size
    rows = [r for r in llama.table(cfg) if r.zoo not in NORMS]
    at = next(i for i, r in enumerate(rows) if r.zoo == "{}.mlp.fc1.weight")  # the block's norms in HF's order
    norms = [Row(zoo, (hf,), ((h,),), same, same) for zoo, hf in NORMS.items()]
    return rows[:at] + [norms[1], norms[0]] + rows[at:at + 2] + [norms[2]] + rows[at + 2:]


def groups(cfg: GPTConfig, **_) -> list[list[Row]]:
    return list(blocks(table(cfg), cfg.num_hidden_layers))


def to_zoo(c) -> GPTConfig:
    """The GPTConfig computing what Gemma 2 computes; refuses (one line, naming the field) what zoo cannot."""
    need = refusal(NAME)
    need(c.hidden_activation == "gelu_pytorch_tanh",
         f"hidden_activation {c.hidden_activation!r} is not supported (zoo's GeGLU uses gelu_pytorch_tanh)")
    need(not getattr(c, "attention_bias", False), "attention_bias=True is not supported (Gemma 2 has no biases)")
    need(not getattr(c, "use_bidirectional_attention", False),
         "use_bidirectional_attention=True is not supported (zoo's GPT is causal)")
    theta, scaling = llama.rope(c)
    return zoo_config(GPTConfig, dict(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads or c.num_attention_heads,
        head_dim=c.head_dim, intermediate_size=c.intermediate_size, max_position_embeddings=c.max_position_embeddings,
        position_embedding_type="rope", normalization="rmsnorm", norm_eps=c.rms_norm_eps, activation="geglu",
        add_bias=False, tie_word_embeddings=bool(c.tie_word_embeddings), rope_theta=theta, rope_scaling=scaling,
        initializer_range=c.initializer_range, attention_dropout=float(c.attention_dropout or 0.0),
        sliding_window=c.sliding_window, layer_types=list(c.layer_types) if c.layer_types else None,
        attn_logit_softcapping=c.attn_logit_softcapping, final_logit_softcapping=c.final_logit_softcapping,
        query_pre_attn_scalar=c.query_pre_attn_scalar, norm_weight_offset=1.0, norm_placement="sandwich",
        embedding_multiplier=math.sqrt(c.hidden_size)))


def exports(cfg: GPTConfig) -> bool:
    """A dense zoo GPT with Gemma 2's block: GeGLU, sandwich (1 + w) RMSNorms, embeddings times sqrt(h)."""
    return (not cfg.num_experts and cfg.qk_norm is None and fields_off(cfg)
            and (cfg.position_embedding_type, cfg.normalization, cfg.activation, cfg.add_bias, cfg.use_qkv_bias,
                 cfg.norm_weight_offset, cfg.norm_placement) == ("rope", "rmsnorm", "geglu", False, False, 1.0,
                                                                 "sandwich")
            and cfg.embedding_multiplier == math.sqrt(cfg.hidden_size))


def to_hf(cfg: GPTConfig, dtype: torch.dtype, special: dict):
    from transformers import Gemma2Config

    types = cfg.layer_types or ["sliding_attention" if cfg.attention_window(i) else "full_attention"
                                for i in range(cfg.num_hidden_layers)]
    c = Gemma2Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=cfg.max_position_embeddings, initializer_range=cfg.initializer_range,
        rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_word_embeddings,
        rope_parameters=llama.rope_parameters(cfg), attention_bias=False, attention_dropout=cfg.attention_dropout,
        query_pre_attn_scalar=cfg.query_pre_attn_scalar or cfg.head_dim,  # zoo's None: 1/sqrt(head_dim)
        sliding_window=cfg.sliding_window or cfg.max_position_embeddings, layer_types=list(types),
        final_logit_softcapping=cfg.final_logit_softcapping, attn_logit_softcapping=cfg.attn_logit_softcapping,
        architectures=[NAME], **hf_special(special))
    c.dtype = dtype
    return c


def _config_class():
    from transformers import Gemma2Config  # imported on use: the registry imports every file

    return Gemma2Config


ARCHITECTURES = {NAME: Architecture(
    NAME, FAMILY, _config_class, to_zoo, groups, to_hf, model_type="gemma2", exports=exports,
    export_needs="Gemma2ForCausalLM needs rope, rmsnorm, geglu, norm_weight_offset=1, norm_placement='sandwich', "
                 "embedding_multiplier=sqrt(hidden_size), no biases")}

"""GPTNeoXForCausalLM (Pythia, GPT-NeoX-20B) <-> zoo's GPT: RoPE, LayerNorm, exact GELU, parallel residual.

The block: x + attn(ln1(x)) + mlp(ln2(x)) (``use_parallel_residual``; False: sequential as GPT-2), multi-head
attention, the MLP with biases always (``mlp_bias=True``) and ``attention_bias`` on query_key_value and dense
(zoo's ``add_bias``), ``hidden_act="gelu"`` (erf: zoo's ``gelu_exact``), an untied ``embed_out`` head (tied read too).
``query_key_value`` is per-head interleaved: its rows are ``[q_0, k_0, v_0, q_1, k_1, v_1, ...]`` (d each), which
is zoo's fused layout per key-value group when every head is its own group: the weight and bias are taken as they
are (``neox_qkv`` checks the split both ways). Refused, one line each: partial rotary (``rotary_pct`` < 1), another
activation, a RoPE type other than default/linear/llama3.
Notation: h hidden, f intermediate, V vocabulary (unpadded), L blocks, n heads, d head dim.
"""

from __future__ import annotations

import torch

from zoo.convert.hf import llama
from zoo.convert.hf.common import hf_special, refusal, zoo_config
from zoo.convert.hf.gpt2 import embed_prefix, head_rows
from zoo.convert.registry import Architecture
from zoo.convert.tables import Row, blocks, same
from zoo.models.gpt import FAMILY, GPTConfig

NAME = "GPTNeoXForCausalLM"
P = "gpt_neox."
LAYER = P + "layers.{}."


def neox_qkv(w):
    """HF's ``query_key_value`` ``[n * 3d, ...]`` (per head: q, k, v) -> zoo's fused QKV: per key-value group
    [q heads of the group, k, v], one head per group under multi-head attention, so the same rows. Its own inverse."""
    return w


def table(cfg: GPTConfig) -> list[Row]:
    h, f, V, L = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers
    qkv = 3 * h
    bias = cfg.add_bias
    return [
        Row(f"{embed_prefix(cfg)}.word_embeddings.weight", (P + "embed_in.weight",), ((V, h),), same, same),
        Row("{}.input_norm.weight", (LAYER + "input_layernorm.weight",), ((h,),), same, same),
        Row("{}.input_norm.bias", (LAYER + "input_layernorm.bias",), ((h,),), same, same),
        Row("{}.attention.qkv.weight", (LAYER + "attention.query_key_value.weight",), ((qkv, h),), neox_qkv, neox_qkv),
        *([Row("{}.attention.qkv.bias", (LAYER + "attention.query_key_value.bias",), ((qkv,),), neox_qkv, neox_qkv),
           Row("{}.attention.dense.bias", (LAYER + "attention.dense.bias",), ((h,),), same, same)] if bias else []),
        Row("{}.attention.dense.weight", (LAYER + "attention.dense.weight",), ((h, h),), same, same),
        Row("{}.post_attention_norm.weight", (LAYER + "post_attention_layernorm.weight",), ((h,),), same, same),
        Row("{}.post_attention_norm.bias", (LAYER + "post_attention_layernorm.bias",), ((h,),), same, same),
        Row("{}.mlp.fc1.weight", (LAYER + "mlp.dense_h_to_4h.weight",), ((f, h),), same, same),
        Row("{}.mlp.fc1.bias", (LAYER + "mlp.dense_h_to_4h.bias",), ((f,),), same, same),
        Row("{}.mlp.fc2.weight", (LAYER + "mlp.dense_4h_to_h.weight",), ((h, f),), same, same),
        Row("{}.mlp.fc2.bias", (LAYER + "mlp.dense_4h_to_h.bias",), ((h,),), same, same),
        Row(f"{L + 1}.weight", (P + "final_layer_norm.weight",), ((h,),), same, same),
        Row(f"{L + 1}.bias", (P + "final_layer_norm.bias",), ((h,),), same, same),
        *head_rows(cfg, key="embed_out.weight"),
    ]


def groups(cfg: GPTConfig, **_) -> list[list[Row]]:
    return list(blocks(table(cfg), cfg.num_hidden_layers))


def to_zoo(c) -> GPTConfig:
    need = refusal(NAME)
    need(c.hidden_act == "gelu", f"hidden_act {c.hidden_act!r} is not supported (zoo's NeoX MLP uses the exact gelu)")
    params = dict(getattr(c, "rope_parameters", None) or {})
    partial = float(params.get("partial_rotary_factor", getattr(c, "rotary_pct", 1.0)))
    # TODO(rope merge): partial rotary (the rope helper's partial_rotary_factor field) takes rotary_pct < 1.
    need(partial == 1.0, f"rotary_pct {partial} < 1 (partial rotary) is not supported yet; zoo rotates whole heads")
    theta, scaling = llama.rope(c)
    return zoo_config(GPTConfig, dict(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, intermediate_size=c.intermediate_size,
        max_position_embeddings=c.max_position_embeddings, position_embedding_type="rope",
        normalization="layernorm", norm_eps=c.layer_norm_eps, activation="gelu_exact",
        add_bias=bool(c.attention_bias), mlp_bias=True, use_parallel_residual=bool(c.use_parallel_residual),
        tie_word_embeddings=bool(c.tie_word_embeddings), rope_theta=theta, rope_scaling=scaling,
        initializer_range=c.initializer_range, hidden_dropout=float(c.hidden_dropout or 0.0),
        attention_dropout=float(c.attention_dropout or 0.0)))


def exports(cfg: GPTConfig) -> bool:
    """RoPE, LayerNorm, exact GELU with MLP biases, multi-head attention, q/k/v biased as dense is; no other
    block feature (norms pre, no q/k norm, window, multiplier or soft-cap)."""
    return (not cfg.num_experts and cfg.qk_norm is None and llama.is_windowless(cfg)
            and (cfg.position_embedding_type, cfg.normalization, cfg.activation, cfg.use_mlp_bias, cfg.norm_placement)
            == ("rope", "layernorm", "gelu_exact", True, "pre")
            and cfg.use_qkv_bias == cfg.add_bias and cfg.num_key_value_heads == cfg.num_attention_heads
            and cfg.head_dim == cfg.hidden_size // cfg.num_attention_heads
            and all(getattr(cfg, name) is None for name in (
                "attn_logit_softcapping", "query_pre_attn_scalar", "embedding_multiplier", "final_logit_softcapping",
                "residual_multiplier", "attention_multiplier", "logits_scaling"))
            and cfg.norm_weight_offset == 0.0)


def to_hf(cfg: GPTConfig, dtype: torch.dtype, special: dict):
    from transformers import GPTNeoXConfig

    c = GPTNeoXConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, intermediate_size=cfg.intermediate_size, hidden_act="gelu",
        max_position_embeddings=cfg.max_position_embeddings, layer_norm_eps=cfg.norm_eps,
        rope_parameters={**llama.rope_parameters(cfg), "partial_rotary_factor": 1.0},  # TODO(rope merge): the field
        use_parallel_residual=cfg.use_parallel_residual, attention_bias=cfg.add_bias,
        hidden_dropout=cfg.hidden_dropout, attention_dropout=cfg.attention_dropout,
        initializer_range=cfg.initializer_range, tie_word_embeddings=cfg.tie_word_embeddings,
        architectures=[NAME], **hf_special(special))
    c.dtype = dtype
    return c


def _config_class():
    from transformers import GPTNeoXConfig  # imported on use: the registry imports every file

    return GPTNeoXConfig


ARCHITECTURES = {NAME: Architecture(
    NAME, FAMILY, _config_class, to_zoo, groups, to_hf, model_type="gpt_neox", exports=exports,
    export_needs="GPTNeoXForCausalLM needs rope, layernorm, gelu_exact with mlp_bias, multi-head attention, "
                 "qkv_bias = add_bias, no window")}

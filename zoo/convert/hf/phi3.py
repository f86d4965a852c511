"""Phi3ForCausalLM (Phi-3, Phi-4-mini) <-> zoo's GPT: Llama (``llama.py``) with fused projections and partial RoPE.

The differences: one ``qkv_proj`` ``[q (nq d); k (nkv d); v (nkv d)]`` (split and regrouped per key-value group into
zoo's QKV, and back: exact), one ``gate_up_proj`` ``[gate; up]`` (zoo's SwiGLU fc1 as it is), LongRoPE
(``rope_type="longrope"``: short and long factors, ``original_max_position_embeddings``), ``partial_rotary_factor``
(Phi-4-mini rotates 3/4 of each head), a window on every layer (``sliding_window``), the residual dropout as zoo's
``hidden_dropout``. A zoo GPT exports as this class when it rotates part of each head (whole-head ones go back as
Llama or Mistral: the same computation). Refused, one line each: ``embd_pdrop`` other than ``resid_pdrop``, and what
``llama.to_zoo`` refuses.
"""

from __future__ import annotations

import torch

from zoo.convert.hf import llama
from zoo.convert.hf.common import refusal
from zoo.convert.hf.gpt2 import embed_prefix, head_rows
from zoo.convert.registry import Architecture
from zoo.convert.tables import Row, blocks, qkv_groups, qkv_ungroup, same
from zoo.models.gpt import FAMILY, GPTConfig
from zoo.models.rope import rope_kind

NAME = "Phi3ForCausalLM"
LAYER = "model.layers.{}."


def table(cfg: GPTConfig) -> list[Row]:
    h, f, V, L = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers
    d, nq, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads

    def qkv(w):  # [q; k; v] -> zoo's per-group layout
        return qkv_groups(*w.split([nq * d, nkv * d, nkv * d]), cfg)

    def qkv_back(w):
        return torch.cat(qkv_ungroup(w, cfg))

    return [
        Row(f"{embed_prefix(cfg)}.word_embeddings.weight", ("model.embed_tokens.weight",), ((V, h),), same, same),
        Row("{}.input_norm.weight", (LAYER + "input_layernorm.weight",), ((h,),), same, same),
        Row("{}.attention.qkv.weight", (LAYER + "self_attn.qkv_proj.weight",), (((nq + 2 * nkv) * d, h),), qkv,
            qkv_back),
        Row("{}.attention.dense.weight", (LAYER + "self_attn.o_proj.weight",), ((h, nq * d),), same, same),
        Row("{}.post_attention_norm.weight", (LAYER + "post_attention_layernorm.weight",), ((h,),), same, same),
        Row("{}.mlp.fc1.weight", (LAYER + "mlp.gate_up_proj.weight",), ((2 * f, h),), same, same),  # [gate; up]
        Row("{}.mlp.fc2.weight", (LAYER + "mlp.down_proj.weight",), ((h, f),), same, same),
        Row(f"{L + 1}.weight", ("model.norm.weight",), ((h,),), same, same),  # final norm
        *head_rows(cfg),
    ]


def groups(cfg: GPTConfig, **_) -> list[list[Row]]:
    return list(blocks(table(cfg), cfg.num_hidden_layers))


def to_zoo(c) -> GPTConfig:
    resid, embd = float(c.resid_pdrop or 0.0), float(c.embd_pdrop or 0.0)
    refusal(NAME)(resid == embd, f"embd_pdrop {embd} != resid_pdrop {resid} is not supported (zoo's hidden_dropout "
                                 f"is one rate for both)")
    return llama.to_zoo(c, arch=NAME, windows=llama.window_every_layer, hidden_dropout=resid,
                        partial_rotary_factor=llama.partial_rotary_factor(c))


def exports(cfg: GPTConfig) -> bool:
    """Llama's features rotating part of each head (default RoPE or LongRoPE), no window or one on every layer."""
    windows = {cfg.attention_window(i) for i in range(cfg.num_hidden_layers)}
    return (cfg.partial_rotary_factor < 1.0 and rope_kind(cfg.rope_scaling) in (None, "longrope")
            and llama.is_llama(cfg, partial=True) and len(windows) == 1
            and cfg.head_dim * cfg.num_attention_heads == cfg.hidden_size)  # Phi3Config has no head_dim


def to_hf(cfg: GPTConfig, dtype: torch.dtype, special: dict):
    from transformers import Phi3Config

    scaling = cfg.rope_scaling or {}
    original = scaling.get("original_max_position_embeddings", cfg.max_position_embeddings)
    c = Phi3Config(intermediate_size=cfg.intermediate_size, original_max_position_embeddings=original,
                   sliding_window=cfg.sliding_window, resid_pdrop=cfg.hidden_dropout, embd_pdrop=cfg.hidden_dropout,
                   **llama.common_hf_fields(cfg, NAME, special))
    c.dtype = dtype
    return c


def _config_class():
    from transformers import Phi3Config  # imported on use: the registry imports every file

    return Phi3Config


ARCHITECTURES = {NAME: Architecture(
    NAME, FAMILY, _config_class, to_zoo, groups, to_hf, model_type="phi3", exports=exports,
    export_needs="Phi3ForCausalLM the same with partial_rotary_factor < 1, default RoPE or longrope, no window or "
                 "one on every layer, head_dim = hidden_size / num_attention_heads")}

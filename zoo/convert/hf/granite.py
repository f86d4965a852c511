"""GraniteForCausalLM <-> zoo's GPT: Llama (``llama.py``) with IBM Granite's four multipliers and optional biases.

The differences, each a GPT config field of the same name: ``embedding_multiplier`` (token embeddings times it),
``residual_multiplier`` (each sublayer's output times it before the residual add), ``attention_multiplier`` (the
scores' scale itself, instead of 1/sqrt(d); HF's default 1.0 is kept as it is) and ``logits_scaling`` (logits
divided by it; the fused LM head + loss divides the head's input instead). ``attention_bias`` biases q, k, v and o
(zoo's ``add_bias``), ``mlp_bias`` gate, up and down (zoo's ``mlp_bias``), each on its own. A multiplier of 1 is
read as none (the same product, bit for bit). The bias rows here are OLMo 2's too (``olmo2.py``).
"""

from __future__ import annotations

import copy

import torch

from zoo.convert.hf import llama
from zoo.convert.hf.common import refusal
from zoo.convert.registry import Architecture
from zoo.convert.tables import Row, blocks, cat_gate_up, same, split_gate_up
from zoo.models.gpt import FAMILY, GPTConfig

NAME = "GraniteForCausalLM"
MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "logits_scaling")  # 1: none


def bias_rows(cfg: GPTConfig) -> list[Row]:
    """o_proj's bias where ``add_bias`` (q/k/v's come with llama's table, ``use_qkv_bias``); gate/up/down's where
    ``use_mlp_bias`` (gate and up fused into fc1's bias as their weights are)."""
    h, f = cfg.hidden_size, cfg.intermediate_size
    rows = [Row("{}.attention.dense.bias", (llama.ATTN + "o_proj.bias",), ((h,),), same, same)] if cfg.add_bias else []
    if cfg.use_mlp_bias:
        rows += [Row("{}.mlp.fc1.bias", (llama.MLP + "gate_proj.bias", llama.MLP + "up_proj.bias"), ((f,), (f,)),
                     cat_gate_up, split_gate_up),
                 Row("{}.mlp.fc2.bias", (llama.MLP + "down_proj.bias",), ((h,),), same, same)]
    return rows


def with_bias_rows(rows: list[Row], cfg: GPTConfig) -> list[Row]:
    """``rows`` with :func:`bias_rows` after the last per-block row (so ``tables.blocks`` groups them per block)."""
    last = max(i for i, r in enumerate(rows) if "{}" in r.zoo)
    return rows[:last + 1] + bias_rows(cfg) + rows[last + 1:]


def table(cfg: GPTConfig) -> list[Row]:
    return with_bias_rows(llama.table(cfg), cfg)


def groups(cfg: GPTConfig, **_) -> list[list[Row]]:
    return list(blocks(table(cfg), cfg.num_hidden_layers))


def _multiplier(value) -> float | None:
    return None if value is None or float(value) == 1.0 else float(value)


def bias_fields(c) -> dict:
    """zoo's bias fields for HF's ``attention_bias`` (q, k, v, o) and ``mlp_bias`` (gate, up, down)."""
    attention, mlp = bool(getattr(c, "attention_bias", False)), bool(getattr(c, "mlp_bias", False))
    return dict(add_bias=attention, qkv_bias=attention, mlp_bias=mlp)


def to_zoo(c) -> GPTConfig:
    """Llama's mapping with the biases and multipliers (llama.to_zoo's own bias refusals do not apply here)."""
    need = refusal(NAME)
    need(float(c.attention_multiplier) > 0, f"attention_multiplier {c.attention_multiplier} must be positive")
    plain = copy.copy(c)  # the biases are mapped below, not refused as Llama's
    plain.attention_bias = plain.mlp_bias = False
    cfg = llama.to_zoo(plain, arch=NAME, attention_multiplier=float(c.attention_multiplier),
                       **{name: _multiplier(getattr(c, name)) for name in MULTIPLIERS})
    return GPTConfig.from_dict({**cfg.to_dict(), **bias_fields(c)})


def exports(cfg: GPTConfig) -> bool:
    """Llama's features but for one of Granite's multipliers, biases on the attention (all four) and/or MLP."""
    llama_like = GPTConfig.from_dict({**cfg.to_dict(), "add_bias": False, "qkv_bias": False, "mlp_bias": False,
                                      "attention_multiplier": None, "residual_multiplier": None,
                                      "logits_scaling": None, "embedding_multiplier": None})
    granite = any(getattr(cfg, name) is not None for name in (*MULTIPLIERS, "attention_multiplier"))
    return (granite and cfg.use_qkv_bias == cfg.add_bias and llama.is_llama(llama_like)
            and llama.is_windowless(cfg))


def head_dim_field(cfg: GPTConfig) -> dict:
    """``head_dim`` where it is not h / heads: Granite's and OLMo's configs have no such field, their attention reads
    one set on the config (``getattr(config, "head_dim", h // heads)``)."""
    return {} if cfg.head_dim == cfg.hidden_size // cfg.num_attention_heads else {"head_dim": cfg.head_dim}


def to_hf(cfg: GPTConfig, dtype: torch.dtype, special: dict):
    from transformers import GraniteConfig

    scale = cfg.attention_multiplier if cfg.attention_multiplier is not None else cfg.head_dim ** -0.5
    c = GraniteConfig(intermediate_size=cfg.intermediate_size, attention_bias=cfg.add_bias, **head_dim_field(cfg),
                      mlp_bias=cfg.use_mlp_bias, attention_multiplier=scale,
                      **{name: 1.0 if getattr(cfg, name) is None else getattr(cfg, name) for name in MULTIPLIERS},
                      **llama.common_hf_fields(cfg, NAME, special))
    c.dtype = dtype
    return c


def _config_class():
    from transformers import GraniteConfig  # imported on use: the registry imports every file

    return GraniteConfig


ARCHITECTURES = {NAME: Architecture(
    NAME, FAMILY, _config_class, to_zoo, groups, to_hf, model_type="granite", exports=exports,
    export_needs="GraniteForCausalLM Llama's features with embedding/residual/attention multipliers or "
                 "logits_scaling, biases on all of q/k/v/o (add_bias) and/or the MLP (mlp_bias), no window")}

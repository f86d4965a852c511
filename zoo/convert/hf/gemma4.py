"""Gemma4ForCausalLM (the text model) <-> zoo's GPT: Gemma 2's block (``gemma2.py``) with Gemma 4's differences.

The differences, each a GPT config field: the full-attention layers have heads of their own width and number
(``global_head_dim``, ``num_global_key_value_heads``; transformers states them per layer in ``per_layer_config``) and
may take the values from the keys' projection (``attention_k_eq_v``: no ``v_proj`` there); q and k RMS-normed per
head (``qk_norm="head"``), v without a weight (``v_norm``); RMSNorm as x w (no 1 + w); scores unscaled
(``query_pre_attn_scalar=1``); each block's output times its ``layer_scalar`` buffer; RoPE per layer type from
``rope_parameters`` (the sliding layers' plain theta is zoo's ``rope_local_base_freq``, the full layers'
``proportional`` RoPE zoo's ``rope_scaling``). The key table differs per layer type, so it is built per block.

Refused, one line each, with what supporting them would take: per-layer input embeddings
(``hidden_size_per_layer_input`` > 0, the E2B/E4B models: a second embedding table feeding every block, gated),
key/value sharing across layers (``num_kv_shared_layers`` > 0: later layers attend with an earlier layer's keys and
values, one cache for both), the mixture-of-experts block (``enable_moe_block``: a dense MLP and routed experts side
by side, each with its own norms), bidirectional attention, attention biases, another activation.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from zoo.convert.hf import gemma2
from zoo.convert.hf.common import hf_special, refusal, zoo_config
from zoo.convert.hf.moe import qk_norm_rows
from zoo.convert.registry import Architecture
from zoo.convert.tables import Row, same
from zoo.models.gpt import FAMILY, GPTConfig

NAME = "Gemma4ForCausalLM"
ATTN = "model.layers.{}.self_attn."
PER_LAYER = {"head_dim", "num_key_value_heads"}  # what per_layer_config may override (on full-attention layers)


def _qk_groups(q, k, cfg):
    """Q [nq*d], K [nkv*d] -> zoo's QKV of a k = v layer: per key-value group its q heads then its k head."""
    d, nq, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    rest = q.shape[1:]
    return torch.cat([q.reshape(nkv, nq // nkv * d, *rest), k.reshape(nkv, d, *rest)], dim=1).reshape(-1, *rest)


def _qk_ungroup(w, cfg):
    d, nq, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    rest = w.shape[1:]
    q, k = w.reshape(nkv, (nq // nkv + 1) * d, *rest).split([nq // nkv * d, d], dim=1)
    return q.reshape(nq * d, *rest), k.reshape(nkv * d, *rest)


def _layer_config(cfg: GPTConfig, i: int) -> GPTConfig:
    """Block i's shapes as a uniform config (its head dim and kv heads everywhere), for the rows of its table."""
    if cfg.layer_head_dim(i) == cfg.head_dim and cfg.layer_kv_heads(i) == cfg.num_key_value_heads:
        return cfg
    return replace(cfg, head_dim=cfg.layer_head_dim(i), num_key_value_heads=cfg.layer_kv_heads(i),
                   global_head_dim=None, num_global_key_value_heads=None, attention_k_eq_v=False)


def _block_rows(cfg: GPTConfig, i: int) -> list[Row]:
    """Block i's rows, ``{}`` unfilled: Gemma 2's (with this block's shapes), the q/k norms and the layer scalar; a
    k = v block's QKV row made from q_proj and k_proj alone."""
    lc = _layer_config(cfg, i)
    rows = [r for r in gemma2.table(lc) if "{}" in r.zoo] + qk_norm_rows(lc)
    if cfg.layer_k_eq_v(i):
        h, d, nq, nkv = cfg.hidden_size, lc.head_dim, cfg.num_attention_heads, lc.num_key_value_heads
        qk = Row("{}.attention.qkv.weight", (ATTN + "q_proj.weight", ATTN + "k_proj.weight"),
                 ((nq * d, h), (nkv * d, h)), lambda q, k: _qk_groups(q, k, lc), lambda w: _qk_ungroup(w, lc))
        rows = [qk if r.zoo == "{}.attention.qkv.weight" else r for r in rows]
    return rows + [Row("{}.layer_scalar", ("model.layers.{}.layer_scalar",), ((1,),), same, same)]


def groups(cfg: GPTConfig, **_) -> list[list[Row]]:
    """The embedding, one group per block (each with its own layer type's shapes), the final norm and the head."""
    rest = [r for r in gemma2.table(cfg) if "{}" not in r.zoo]
    first = next(i for i, r in enumerate(rest) if not r.zoo.startswith(("0.", "tied_modules.")))
    return [rest[:first], *([r.at(i) for r in _block_rows(cfg, i)] for i in range(cfg.num_hidden_layers)),
            rest[first:]]


def _per_layer(c) -> dict[int, dict]:
    """transformers' per-layer overrides (``per_layer_config`` as config.json holds it), keyed by layer index."""
    raw = c.to_dict().get("per_layer_config") or {}
    return {int(i): dict(v) for i, v in raw.items()}


def _rope(c, need) -> dict:
    """zoo's RoPE fields from Gemma 4's per-layer-type ``rope_parameters``."""
    params, types = dict(c.rope_parameters or {}), set(c.layer_types)
    out = {}
    if "sliding_attention" in types:
        local = dict(params.get("sliding_attention") or {})
        need(local.get("rope_type", "default") == "default",
             f"rope_parameters['sliding_attention'] rope_type {local.get('rope_type')!r} is not supported (zoo's "
             f"sliding layers use plain RoPE)")
        out["rope_local_base_freq"] = float(local.get("rope_theta", 10000.0))
    glob = dict(params.get("full_attention") or {})
    kind = glob.get("rope_type", "default")
    need(kind in ("default", "proportional"), f"rope_parameters['full_attention'] rope_type {kind!r} is not "
                                              f"supported (zoo reads default and proportional)")
    out["rope_theta"] = float(glob.get("rope_theta", 10000.0))
    if kind == "proportional":
        out["rope_scaling"] = {"rope_type": "proportional",
                               "partial_rotary_factor": float(glob.get("partial_rotary_factor", 1.0)),
                               **({"factor": float(glob["factor"])} if "factor" in glob else {})}
    return out


def to_zoo(c) -> GPTConfig:
    """The GPTConfig computing what Gemma 4's text model computes; refuses (one line, naming the field) the rest."""
    need = refusal(NAME)
    need(c.hidden_activation == "gelu_pytorch_tanh",
         f"hidden_activation {c.hidden_activation!r} is not supported (zoo's GeGLU uses gelu_pytorch_tanh)")
    need(not c.attention_bias, "attention_bias=True is not supported (Gemma 4 has no biases)")
    need(c.use_bidirectional_attention is None,
         f"use_bidirectional_attention={c.use_bidirectional_attention!r} is not supported (zoo's GPT is causal)")
    need(not c.hidden_size_per_layer_input,
         f"hidden_size_per_layer_input={c.hidden_size_per_layer_input} (per-layer input embeddings) is not supported; "
         f"zoo converts the Gemma 4 models without them (0)")
    need(not c.num_kv_shared_layers, f"num_kv_shared_layers={c.num_kv_shared_layers} (key/value sharing across "
                                     f"layers) is not supported; zoo converts Gemma 4 models with 0")
    need(not c.enable_moe_block, "enable_moe_block=True (the mixture-of-experts block) is not supported")
    overrides = _per_layer(c)
    extra = sorted({k for v in overrides.values() for k in v} - PER_LAYER)
    need(not extra, f"per_layer_config overrides {extra} are not supported (zoo reads head_dim and "
                    f"num_key_value_heads of the full-attention layers)")
    full = [i for i, t in enumerate(c.layer_types) if t == "full_attention"]
    sliding = sorted(set(overrides) - set(full))
    need(not sliding, f"per_layer_config overrides sliding layers {sliding}; zoo reads overrides of the full-attention "
                      f"layers only")
    shapes = {(c.per_layer_config[i].head_dim, c.per_layer_config[i].num_key_value_heads) for i in full}
    need(len(shapes) <= 1, f"the full-attention layers differ in (head_dim, num_key_value_heads): {sorted(shapes)}")
    raw = c.to_dict()  # the model-wide head_dim and kv heads (transformers refuses them as attributes per layer)
    d, nkv = raw["head_dim"], raw["num_key_value_heads"]
    global_d, global_kv = shapes.pop() if shapes else (d, nkv)
    h = c.hidden_size
    return zoo_config(GPTConfig, dict(
        vocab_size=c.vocab_size, hidden_size=h, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=nkv, head_dim=d,
        global_head_dim=None if global_d == d else global_d,
        num_global_key_value_heads=None if global_kv == nkv else global_kv,
        attention_k_eq_v=bool(c.attention_k_eq_v), intermediate_size=c.intermediate_size,
        max_position_embeddings=c.max_position_embeddings, position_embedding_type="rope", normalization="rmsnorm",
        norm_eps=c.rms_norm_eps, activation="geglu", add_bias=False, tie_word_embeddings=bool(c.tie_word_embeddings),
        initializer_range=c.initializer_range, attention_dropout=float(c.attention_dropout or 0.0),
        sliding_window=c.sliding_window, layer_types=list(c.layer_types),
        final_logit_softcapping=c.final_logit_softcapping,
        query_pre_attn_scalar=1.0, norm_placement="sandwich", qk_norm="head", v_norm=True, layer_scalar=True,
        embedding_multiplier=math.sqrt(h), **_rope(c, need)))


def exports(cfg: GPTConfig) -> bool:
    """A dense zoo GPT with Gemma 4's block: GeGLU, sandwich RMSNorms (x w), q/k norm per head and the weightless v
    norm, unscaled scores, layer scalars, embeddings times sqrt(h), RoPE plain or proportional."""
    return (not cfg.num_experts and cfg.qk_norm == "head" and cfg.v_norm and cfg.layer_scalar
            and (cfg.position_embedding_type, cfg.normalization, cfg.activation, cfg.add_bias, cfg.use_qkv_bias,
                 cfg.norm_weight_offset, cfg.norm_placement) == ("rope", "rmsnorm", "geglu", False, False, 0.0,
                                                                 "sandwich")
            and cfg.query_pre_attn_scalar == 1.0 and cfg.attn_logit_softcapping is None and not cfg.use_mlp_bias
            and not cfg.use_parallel_residual and cfg.residual_multiplier is None and cfg.logits_scaling is None
            and cfg.embedding_multiplier == math.sqrt(cfg.hidden_size) and cfg.partial_rotary_factor == 1.0
            and cfg.no_rope_layers is None
            and (cfg.rope_scaling or {}).get("rope_type", "proportional") == "proportional")


def to_hf(cfg: GPTConfig, dtype: torch.dtype, special: dict):
    from transformers import Gemma4TextConfig

    L = cfg.num_hidden_layers
    types = cfg.layer_types or ["sliding_attention" if cfg.attention_window(i) else "full_attention" for i in range(L)]
    full = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        full = {**cfg.rope_scaling, "rope_theta": cfg.rope_theta}
    rope = {"full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_local_base_freq or cfg.rope_theta}}
    per_layer = {i: {"head_dim": cfg.layer_head_dim(i), "num_key_value_heads": cfg.layer_kv_heads(i)}
                 for i in range(L) if types[i] == "full_attention"}
    c = Gemma4TextConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=L, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=cfg.max_position_embeddings, initializer_range=cfg.initializer_range,
        rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_word_embeddings,
        rope_parameters=rope, attention_bias=False, attention_dropout=cfg.attention_dropout,
        sliding_window=cfg.sliding_window or cfg.max_position_embeddings, layer_types=list(types),
        final_logit_softcapping=cfg.final_logit_softcapping, hidden_size_per_layer_input=0,
        attention_k_eq_v=cfg.attention_k_eq_v, num_kv_shared_layers=0, enable_moe_block=False,
        per_layer_config=per_layer, architectures=[NAME], **hf_special(special))
    c.dtype = dtype
    return c


def _config_class():
    from transformers import Gemma4TextConfig  # imported on use: the registry imports every file

    return Gemma4TextConfig


ARCHITECTURES = {NAME: Architecture(
    NAME, FAMILY, _config_class, to_zoo, groups, to_hf, model_type="gemma4_text", exports=exports,
    export_needs="Gemma4ForCausalLM needs rope, rmsnorm, geglu, norm_placement='sandwich', qk_norm head, v_norm, "
                 "layer_scalar, query_pre_attn_scalar=1, embedding_multiplier=sqrt(hidden_size), no biases")}

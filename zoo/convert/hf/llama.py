"""LlamaForCausalLM <-> zoo's GPT (RoPE, RMSNorm, SwiGLU, no biases, grouped-query attention).

The pieces here are the base other architectures read as differences from: Mistral (``mistral.py``), Qwen2
(``qwen2.py``, q/k/v biases), Qwen3 (``qwen3.py``, q/k norm) and the mixture-of-experts GPTs (``moe.py``, their
attention and dense rows). RoPE is rotate-half in both HF and zoo, so the q/k rows need no permutation within a head
(unlike Meta's original checkpoints); q, k, v are fused per key-value group, gate and up into zoo's SwiGLU fc1.
Refused, one line each: attention/MLP biases, a RoPE type other than default/linear/llama3, layer types zoo does
not have. The sliding-window mappings both ways (Mistral's on every layer, Qwen2's and Qwen3's by ``layer_types``)
are here; any ``head_dim`` is read and written.
Notation: h hidden, f intermediate, V vocabulary (unpadded), L blocks, nq/nkv query/key-value heads, d head dim.
"""

from __future__ import annotations

from functools import partial

import torch

from zoo.convert.errors import ConvertError
from zoo.convert.hf.common import fields_off, hf_special, refusal, zoo_config
from zoo.convert.hf.gpt2 import embed_prefix, head_rows
from zoo.convert.registry import Architecture
from zoo.convert.tables import (
    Row,
    blocks,
    cat_gate_up,
    qkv_groups,
    qkv_ungroup,
    same,
    split_gate_up,
)
from zoo.models.gpt import FAMILY, GPTConfig

NAME = "LlamaForCausalLM"
ATTN, MLP = "model.layers.{}.self_attn.", "model.layers.{}.mlp."
LAYER_TYPES = {"full_attention", "sliding_attention"}


def table(cfg: GPTConfig) -> list[Row]:
    """Llama's keys (Mistral's and Qwen2's too; Qwen2 adds q/k/v biases, present when ``cfg.use_qkv_bias``)."""
    h, f, V, L = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers
    d, nq, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads

    def qkv(q, k, v):
        return qkv_groups(q, k, v, cfg)  # three projections fused, per key-value group

    def qkv_back(w):
        return qkv_ungroup(w, cfg)

    q, k, v = ATTN + "q_proj", ATTN + "k_proj", ATTN + "v_proj"
    return [
        Row(f"{embed_prefix(cfg)}.word_embeddings.weight", ("model.embed_tokens.weight",), ((V, h),), same, same),
        Row("{}.input_norm.weight", ("model.layers.{}.input_layernorm.weight",), ((h,),), same, same),
        Row("{}.attention.qkv.weight", (q + ".weight", k + ".weight", v + ".weight"),
            ((nq * d, h), (nkv * d, h), (nkv * d, h)), qkv, qkv_back),
        *([Row("{}.attention.qkv.bias", (q + ".bias", k + ".bias", v + ".bias"), ((nq * d,), (nkv * d,), (nkv * d,)),
               qkv, qkv_back)] if cfg.use_qkv_bias else []),
        Row("{}.attention.dense.weight", (ATTN + "o_proj.weight",), ((h, nq * d),), same, same),
        Row("{}.post_attention_norm.weight", ("model.layers.{}.post_attention_layernorm.weight",), ((h,),), same, same),
        Row("{}.mlp.fc1.weight", (MLP + "gate_proj.weight", MLP + "up_proj.weight"), ((f, h), (f, h)), cat_gate_up,
            split_gate_up),
        Row("{}.mlp.fc2.weight", (MLP + "down_proj.weight",), ((h, f),), same, same),
        Row(f"{L + 1}.weight", ("model.norm.weight",), ((h,),), same, same),  # final norm
        *head_rows(cfg),
    ]


def groups(cfg: GPTConfig, **_) -> list[list[Row]]:
    return list(blocks(table(cfg), cfg.num_hidden_layers))


def rope(c) -> tuple[float, dict | None]:
    """``(rope_theta, zoo rope_scaling)`` from transformers 5's ``rope_parameters`` (or 4.x's two fields)."""
    params = dict(getattr(c, "rope_parameters", None) or {})
    theta = float(params.get("rope_theta", getattr(c, "rope_theta", None) or 10000.0))
    legacy = getattr(c, "rope_scaling", None) if not params else None
    params = {**(legacy or {}), **params}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, {"rope_type": "linear", "factor": float(params["factor"])}
    if kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        return theta, {"rope_type": "llama3", **{k: params[k] for k in keys}}
    raise ConvertError(f"rope_type {kind!r} is not supported; zoo implements default, linear and llama3")


def rope_parameters(cfg: GPTConfig) -> dict:
    """transformers 5's ``rope_parameters`` (theta included) for a zoo GPT's RoPE settings."""
    out = {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta}
    out.pop("type", None)
    return out


def refuse_window(need, c, window, sliding: bool = True) -> None:
    """A window shorter than the context is refused where layers slide (the MoE classes: their converters do not
    map windows yet, though zoo's block has them)."""
    need(not sliding or window is None or window >= c.max_position_embeddings,
         f"sliding_window {window} < max_position_embeddings {c.max_position_embeddings}: zoo does not convert a "
         f"sliding window for this class")


def short_window(c) -> int | None:
    """The config's sliding window where it is shorter than the context (a longer one masks nothing: full)."""
    window = getattr(c, "sliding_window", None)  # Qwen2Config / Qwen3Config: None unless use_sliding_window
    return window if window is not None and window < c.max_position_embeddings else None


def no_window(c) -> dict:
    return {}


def window_every_layer(c) -> dict:
    """Mistral: every layer slides when ``sliding_window`` is shorter than the context (zoo's ``layer_types`` None)."""
    window = short_window(c)
    return {} if window is None else {"sliding_window": window}


def window_by_layer_types(c) -> dict:
    """Qwen2 / Qwen3: the layers ``layer_types`` marks slide (transformers derives it from ``max_window_layers`` when
    config.json has none, so it is the source of truth); no sliding layer or no short window: full attention."""
    window, types = short_window(c), list(getattr(c, "layer_types", None) or [])
    if window is None or "sliding_attention" not in types:
        return {}
    return {"sliding_window": window, "layer_types": types}


def to_zoo(c, *, arch: str = NAME, qkv_bias: bool = False, windows=no_window, **fields) -> GPTConfig:
    """The GPTConfig computing what the HF model computes; refuses (one line) what zoo's GPT cannot express.
    ``qkv_bias``: the class has q/k/v biases always (Qwen2); ``windows(c)``: the class's sliding-window fields
    (``window_every_layer``, ``window_by_layer_types``); ``fields``: further GPTConfig fields (Qwen3's q/k norm)."""
    need = refusal(arch)
    need(c.hidden_act == "silu", f"hidden_act {c.hidden_act!r} is not supported (zoo's SwiGLU uses silu)")
    need(not getattr(c, "attention_bias", False), "attention_bias=True is not supported (zoo's Llama has no biases)")
    need(not getattr(c, "mlp_bias", False), "mlp_bias=True is not supported (zoo's Llama has no biases)")
    layer_types = getattr(c, "layer_types", None) or []
    need(set(layer_types) <= LAYER_TYPES, f"layer_types {sorted(set(layer_types) - LAYER_TYPES)} are not supported")
    theta, scaling = rope(c)
    return zoo_config(GPTConfig, dict(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads or c.num_attention_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        intermediate_size=c.intermediate_size, max_position_embeddings=c.max_position_embeddings,
        position_embedding_type="rope", normalization="rmsnorm", norm_eps=c.rms_norm_eps, activation="swiglu",
        add_bias=False, **({"qkv_bias": True} if qkv_bias else {}), tie_word_embeddings=bool(c.tie_word_embeddings),
        rope_theta=theta, rope_scaling=scaling, initializer_range=c.initializer_range,
        attention_dropout=float(getattr(c, "attention_dropout", 0.0) or 0.0), **windows(c), **fields))


def is_llama(cfg: GPTConfig, qkv_bias: bool = False, qk_norm: str | None = None) -> bool:
    """A dense zoo GPT with Llama's features (and q/k/v biases or not, q/k norm or not), any windows; the scores
    scaled and uncapped as Llama's, plain pre-norm RMSNorms, unscaled embeddings and uncapped logits."""
    return (not cfg.num_experts and cfg.qk_norm == qk_norm and cfg.attn_logit_softcapping is None
            and cfg.query_pre_attn_scalar is None and cfg.norm_weight_offset == 0.0 and cfg.norm_placement == "pre"
            and cfg.embedding_multiplier is None and cfg.final_logit_softcapping is None and fields_off(cfg)
            and (cfg.position_embedding_type, cfg.normalization, cfg.activation, cfg.add_bias, cfg.use_qkv_bias)
            == ("rope", "rmsnorm", "swiglu", False, qkv_bias))


def is_windowless(cfg: GPTConfig) -> bool:
    return all(cfg.attention_window(i) is None for i in range(cfg.num_hidden_layers))


def exports(cfg: GPTConfig) -> bool:
    """Llama: the Llama features without a window (a windowed one is Mistral's or Qwen2's)."""
    return is_llama(cfg) and is_windowless(cfg)


def window_hf_fields(cfg: GPTConfig) -> dict:
    """Qwen2's and Qwen3's window fields for a zoo GPT: ``layer_types`` written out (what transformers reads first),
    ``max_window_layers`` the full layers before the first sliding one (what it would derive them from)."""
    L = cfg.num_hidden_layers
    if is_windowless(cfg):
        return dict(use_sliding_window=False, sliding_window=None, max_window_layers=L)
    types = ["full_attention" if cfg.attention_window(i) is None else "sliding_attention" for i in range(L)]
    return dict(use_sliding_window=True, sliding_window=cfg.sliding_window, layer_types=types,
                max_window_layers=types.index("sliding_attention"))


def common_hf_fields(cfg: GPTConfig, arch: str, special: dict) -> dict:
    """The config fields every Llama-like class shares, for a zoo GPT."""
    return dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
                num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.norm_eps,
                rope_parameters=rope_parameters(cfg), hidden_act="silu", attention_dropout=cfg.attention_dropout,
                initializer_range=cfg.initializer_range, tie_word_embeddings=cfg.tie_word_embeddings,
                architectures=[arch], **hf_special(special))


def to_hf(cfg: GPTConfig, dtype: torch.dtype, special: dict):
    from transformers import LlamaConfig

    c = LlamaConfig(intermediate_size=cfg.intermediate_size, head_dim=cfg.head_dim, attention_bias=False,
                    mlp_bias=False, **common_hf_fields(cfg, NAME, special))
    c.dtype = dtype
    return c


def _config_class():
    from transformers import LlamaConfig

    return LlamaConfig


ARCHITECTURES = {NAME: Architecture(
    NAME, FAMILY, _config_class, partial(to_zoo, arch=NAME), groups, to_hf, model_type="llama", exports=exports,
    export_needs="LlamaForCausalLM needs rope, rmsnorm, swiglu, add_bias=False, qkv_bias=False, no qk_norm, no "
                 "sliding window, no soft-capping or query_pre_attn_scalar")}

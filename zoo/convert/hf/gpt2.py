"""GPT2LMHeadModel <-> zoo's GPT (learned positions, LayerNorm, gelu MLP, biases everywhere).

HF's Conv1D stores [in, out] (transposed to zoo's nn.Linear [out, in]); ``c_attn``'s rows [Q; K; V] are regrouped
per head into zoo's fused QKV. Old checkpoints saved from GPT2Model have no "transformer." prefix (read as is).
Refused, one line each: another activation than gelu_new, unusual attention scaling, cross-attention.
Notation: h hidden, f intermediate, V vocabulary (unpadded), P positions, L blocks.
"""

from __future__ import annotations

import torch

from zoo.convert.hf.common import hf_special, plain_block, refusal, zoo_config
from zoo.convert.registry import Architecture
from zoo.convert.tables import Row, blocks, qkv_groups, qkv_ungroup, same, transpose
from zoo.models.gpt import FAMILY, GPTConfig

NAME = "GPT2LMHeadModel"


def embed_prefix(cfg: GPTConfig) -> str:
    """Tied: the embedding lives in DeepSpeed's tied_modules (also the LM head); untied: it is layer 0."""
    return "tied_modules.embed" if cfg.tie_word_embeddings else "0"


def head_rows(cfg: GPTConfig, key: str = "lm_head.weight") -> list[Row]:
    """The untied LM head (layer L + 2); none when tied to the embedding."""
    if cfg.tie_word_embeddings:
        return []
    L = cfg.num_hidden_layers
    return [Row(f"{L + 2}.linear.weight", (key,), ((cfg.vocab_size, cfg.hidden_size),), same, same)]


def table(cfg: GPTConfig, prefix: str = "transformer.") -> list[Row]:
    """GPT2LMHeadModel. ``prefix`` is "" for old checkpoints saved from GPT2Model (keys "h.0...", "wte.weight")."""
    h, f, V, P, L = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.max_position_embeddings, \
        cfg.num_hidden_layers
    p, e = prefix, embed_prefix(cfg)

    def c_attn(w):
        # Conv1D -> [out, in]; c_attn's rows are [Q (all heads); K; V]: regroup per head as zoo's fused QKV.
        return qkv_groups(*w.t().chunk(3, dim=0), cfg)

    def c_attn_back(w):
        return torch.cat(qkv_ungroup(w, cfg), dim=0).t()

    def c_attn_bias(b):
        return qkv_groups(*b.chunk(3, dim=0), cfg)  # the bias follows the weight's output rows

    def c_attn_bias_back(b):
        return torch.cat(qkv_ungroup(b, cfg), dim=0)

    return [
        Row(f"{e}.word_embeddings.weight", (f"{p}wte.weight",), ((V, h),), same, same),  # also the head when tied
        Row(f"{e}.position_embeddings.weight", (f"{p}wpe.weight",), ((P, h),), same, same),
        Row("{}.input_norm.weight", (p + "h.{}.ln_1.weight",), ((h,),), same, same),
        Row("{}.input_norm.bias", (p + "h.{}.ln_1.bias",), ((h,),), same, same),
        Row("{}.attention.qkv.weight", (p + "h.{}.attn.c_attn.weight",), ((h, 3 * h),), c_attn, c_attn_back),
        Row("{}.attention.qkv.bias", (p + "h.{}.attn.c_attn.bias",), ((3 * h,),), c_attn_bias, c_attn_bias_back),
        Row("{}.attention.dense.weight", (p + "h.{}.attn.c_proj.weight",), ((h, h),), transpose, transpose),
        Row("{}.attention.dense.bias", (p + "h.{}.attn.c_proj.bias",), ((h,),), same, same),
        Row("{}.post_attention_norm.weight", (p + "h.{}.ln_2.weight",), ((h,),), same, same),
        Row("{}.post_attention_norm.bias", (p + "h.{}.ln_2.bias",), ((h,),), same, same),
        Row("{}.mlp.fc1.weight", (p + "h.{}.mlp.c_fc.weight",), ((h, f),), transpose, transpose),
        Row("{}.mlp.fc1.bias", (p + "h.{}.mlp.c_fc.bias",), ((f,),), same, same),
        Row("{}.mlp.fc2.weight", (p + "h.{}.mlp.c_proj.weight",), ((f, h),), transpose, transpose),
        Row("{}.mlp.fc2.bias", (p + "h.{}.mlp.c_proj.bias",), ((h,),), same, same),
        Row(f"{L + 1}.weight", (f"{p}ln_f.weight",), ((h,),), same, same),  # final norm
        Row(f"{L + 1}.bias", (f"{p}ln_f.bias",), ((h,),), same, same),
        *head_rows(cfg),
    ]


def groups(cfg: GPTConfig, prefix: str = "transformer.", **_) -> list[list[Row]]:
    return list(blocks(table(cfg, prefix), cfg.num_hidden_layers))


def read_options(shapes) -> dict:
    """Checkpoints saved from GPT2Model lack the "transformer." prefix."""
    return {"prefix": "" if "wte.weight" in shapes and "transformer.wte.weight" not in shapes else "transformer."}


def to_zoo(c) -> GPTConfig:
    """The GPTConfig computing what the HF GPT-2 computes; refuses (one line) what zoo's GPT cannot express."""
    need = refusal(NAME)
    act = c.activation_function
    need(act in ("gelu_new", "gelu_pytorch_tanh"),
         f"activation_function {act!r} is not supported; zoo's GPT-2 uses gelu_new (the tanh approximation)")
    need(c.scale_attn_weights, "scale_attn_weights=False is not supported (zoo scales scores by 1/sqrt(d))")
    need(not c.scale_attn_by_inverse_layer_idx, "scale_attn_by_inverse_layer_idx=True is not supported")
    need(not getattr(c, "add_cross_attention", False), "add_cross_attention=True is not supported")
    return zoo_config(GPTConfig, dict(
        vocab_size=c.vocab_size, hidden_size=c.n_embd, num_hidden_layers=c.n_layer, num_attention_heads=c.n_head,
        intermediate_size=c.n_inner or 4 * c.n_embd, max_position_embeddings=c.n_positions,
        position_embedding_type="learned", normalization="layernorm", norm_eps=c.layer_norm_epsilon,
        activation="gelu", add_bias=True, tie_word_embeddings=bool(c.tie_word_embeddings),
        initializer_range=c.initializer_range, hidden_dropout=c.resid_pdrop, attention_dropout=c.attn_pdrop))


def exports(cfg: GPTConfig) -> bool:
    return not cfg.num_experts and plain_block(cfg) and (
        cfg.position_embedding_type, cfg.normalization, cfg.activation, cfg.add_bias, cfg.use_qkv_bias) == (
        "learned", "layernorm", "gelu", True, True)


def to_hf(cfg: GPTConfig, dtype: torch.dtype, special: dict):
    from transformers import GPT2Config

    c = GPT2Config(n_embd=cfg.hidden_size, n_layer=cfg.num_hidden_layers, n_head=cfg.num_attention_heads,
                   n_inner=cfg.intermediate_size, n_positions=cfg.max_position_embeddings,
                   activation_function="gelu_new", layer_norm_epsilon=cfg.norm_eps, resid_pdrop=cfg.hidden_dropout,
                   embd_pdrop=cfg.hidden_dropout, attn_pdrop=cfg.attention_dropout, vocab_size=cfg.vocab_size,
                   tie_word_embeddings=cfg.tie_word_embeddings, initializer_range=cfg.initializer_range,
                   architectures=[NAME], **hf_special(special))
    c.dtype = dtype
    return c


def _config_class():
    from transformers import GPT2Config

    return GPT2Config


ARCHITECTURES = {NAME: Architecture(
    NAME, FAMILY, _config_class, to_zoo, groups, to_hf, model_type="gpt2", exports=exports,
    export_needs="GPT2LMHeadModel needs learned, layernorm, gelu, add_bias=True (and qkv_bias)",
    read_options=read_options)}

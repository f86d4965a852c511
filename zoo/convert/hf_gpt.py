"""HuggingFace <-> zoo for the GPT family: GPT-2 (GPT2LMHeadModel), Llama (LlamaForCausalLM), Mistral, Qwen2.

Each architecture is one key table of ``Row(zoo key, HF keys, HF shapes, to_zoo, to_hf)`` (torchtitan's style):
``{}`` is the block index, ``i + 1`` on zoo's side (layer 0 is the embedding) and ``i`` on HF's side. Every
transform is pure data movement (transpose, split, concatenate), so HF -> zoo -> HF is bit-exact; the tables are
checked against transformers' logits (tests/convert/test_hf_gpt.py, tests/models/test_gpt_vs_transformers.py).

Both directions stream: one block's tensors are read (each safetensors file mapped only while they are read),
transformed and handed to ``io.ShardedWriter``, which writes each tensor to disk as it comes, so memory stays
near one block (the largest being the embedding).

Mixture-of-experts GPTs (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) take Llama's rows here and their MoE rows, q/k norms
and config mapping from ``zoo.convert.hf_moe``; the functions below call into it for those architectures.

Qwen2 is Llama with biases on q/k/v (not on o_proj or the MLP): ``GPTConfig(add_bias=False, qkv_bias=True)``,
the three biases fused per key-value group exactly like the weights; such a zoo GPT exports as Qwen2ForCausalLM.

Refused, each with one line saying why: other architectures; GPT-2 with another activation than gelu_new or with
unusual attention scaling; Llama with attention/MLP biases, a head_dim other than hidden/heads, or a RoPE type
other than default/linear/llama3; Mistral or Qwen2 with a sliding window shorter than its context; pickle
checkpoints without ``allow_pickle``.
Notation: h hidden, f intermediate, V vocabulary (unpadded), P positions, nq/nkv query/key-value heads, d head dim.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import safe_open

from zoo.convert import io
from zoo.models.gpt import GPTConfig

DENSE = ("GPT2LMHeadModel", "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# Mixture-of-experts GPTs: their MoE rows and configs are zoo.convert.hf_moe's; everything else is this module's.
MOE = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM")
SUPPORTED = DENSE + MOE
MODEL_TYPES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
               "qwen2": "Qwen2ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
               "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
GENERATION_CONFIG = "generation_config.json"
SAFE_INDEX, SAFE_SINGLE = "model.safetensors.index.json", "model.safetensors"
PICKLE_INDEX, PICKLE_SINGLE = "pytorch_model.bin.index.json", "pytorch_model.bin"
# Buffers some checkpoints carry that are not weights: GPT-2's causal mask, Llama's RoPE frequencies.
IGNORED = re.compile(r"(\.attn\.(masked_)?bias|\.rotary_emb\.inv_freq)$")
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


class ConvertError(ValueError):
    """Input that cannot be converted; the message is one line naming the file, tensor or field."""


# ---------------------------------------------------------------------------------------------------------------
# Transforms (each direction's inverse sits next to it)
# ---------------------------------------------------------------------------------------------------------------


def same(w):
    """Same layout on both sides."""
    return w


def transpose(w):
    """HF GPT-2's Conv1D stores [in, out]; zoo's linear layers are nn.Linear, [out, in]. Its own inverse."""
    return w.t()


def qkv_groups(q, k, v, cfg: GPTConfig):
    """Separate Q [nq*d], K [nkv*d], V [nkv*d] (rows) -> zoo's fused QKV, one block per key-value group:
    [q heads g*nq/nkv ... (g+1)*nq/nkv - 1, k head g, v head g] for g < nkv (Megatron's layout, so a
    contiguous TP split hands each rank whole groups)."""
    d, nq, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    rest = q.shape[1:]  # () for a bias, (h,) for a weight
    q = q.reshape(nkv, nq // nkv * d, *rest)
    k = k.reshape(nkv, d, *rest)
    v = v.reshape(nkv, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)  # [nkv * (nq/nkv + 2) * d, ...]


def qkv_ungroup(w, cfg: GPTConfig):
    """zoo's fused QKV -> (Q [nq*d], K [nkv*d], V [nkv*d]), the inverse of :func:`qkv_groups`."""
    d, nq, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    rest = w.shape[1:]
    w = w.reshape(nkv, (nq // nkv + 2) * d, *rest)  # [nkv, (q_per_group + 2) * d, ...]
    q, k, v = w.split([nq // nkv * d, d, d], dim=1)
    return q.reshape(nq * d, *rest), k.reshape(nkv * d, *rest), v.reshape(nkv * d, *rest)


@dataclass(frozen=True)
class Row:
    """One zoo tensor made from one or more HF tensors. ``to_hf`` returns a tensor or a tuple (one per HF key)."""

    zoo: str
    hf: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    to_zoo: Callable
    to_hf: Callable

    def at(self, i: int | None) -> "Row":
        if i is None:
            return self
        return Row(self.zoo.format(i + 1), tuple(k.format(i) for k in self.hf), self.hf_shapes, self.to_zoo, self.to_hf)

    def hf_tensors(self, zoo_tensor) -> tuple:
        out = self.to_hf(zoo_tensor)
        return out if isinstance(out, tuple) else (out,)

    def zoo_shape(self) -> tuple[int, ...]:
        """The zoo tensor's shape, found by running ``to_zoo`` on meta tensors of the HF shapes."""
        return tuple(self.to_zoo(*(torch.empty(s, device="meta") for s in self.hf_shapes)).shape)


def _embed_prefix(cfg: GPTConfig) -> str:
    # Tied: the embedding lives in DeepSpeed's tied_modules (also the LM head); untied: it is layer 0.
    return "tied_modules.embed" if cfg.tie_word_embeddings else "0"


# ---------------------------------------------------------------------------------------------------------------
# Key tables
# ---------------------------------------------------------------------------------------------------------------


def gpt2_table(cfg: GPTConfig, prefix: str = "transformer.") -> list[Row]:
    """GPT2LMHeadModel. ``prefix`` is "" for old checkpoints saved from GPT2Model (keys "h.0...", "wte.weight")."""
    h, f, V, P, L = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.max_position_embeddings, \
        cfg.num_hidden_layers
    p, e = prefix, _embed_prefix(cfg)

    def c_attn(w):
        # Conv1D -> [out, in]; c_attn's rows are [Q (all heads); K; V]: regroup per head as zoo's fused QKV.
        return qkv_groups(*w.t().chunk(3, dim=0), cfg)

    def c_attn_back(w):
        return torch.cat(qkv_ungroup(w, cfg), dim=0).t()

    def c_attn_bias(b):
        return qkv_groups(*b.chunk(3, dim=0), cfg)  # the bias follows the weight's output rows

    def c_attn_bias_back(b):
        return torch.cat(qkv_ungroup(b, cfg), dim=0)

    table = [
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
    ]
    if not cfg.tie_word_embeddings:
        table.append(Row(f"{L + 2}.linear.weight", ("lm_head.weight",), ((V, h),), same, same))
    return table


def llama_table(cfg: GPTConfig) -> list[Row]:
    """LlamaForCausalLM, MistralForCausalLM and Qwen2ForCausalLM (same keys; Qwen2 adds q/k/v biases, present
    when ``cfg.use_qkv_bias``). RoPE is rotate-half in both HF and zoo, so the q/k rows need no permutation within
    a head (unlike Meta's original checkpoints)."""
    h, f, V, L = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers
    d, nq, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads

    def qkv(q, k, v):
        return qkv_groups(q, k, v, cfg)  # three projections fused, per key-value group

    def qkv_back(w):
        return qkv_ungroup(w, cfg)

    def gate_up(gate, up):
        return torch.cat([gate, up], dim=0)  # zoo's SwiGLU fc1 is [gate; up]: silu(gate x) * up x

    def gate_up_back(w):
        return tuple(w.chunk(2, dim=0))

    attn, mlp = "model.layers.{}.self_attn.", "model.layers.{}.mlp."
    table = [
        Row(f"{_embed_prefix(cfg)}.word_embeddings.weight", ("model.embed_tokens.weight",), ((V, h),), same, same),
        Row("{}.input_norm.weight", ("model.layers.{}.input_layernorm.weight",), ((h,),), same, same),
        Row("{}.attention.qkv.weight", (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"),
            ((nq * d, h), (nkv * d, h), (nkv * d, h)), qkv, qkv_back),
        *([Row("{}.attention.qkv.bias", (attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias"),
               ((nq * d,), (nkv * d,), (nkv * d,)), qkv, qkv_back)] if cfg.use_qkv_bias else []),
        Row("{}.attention.dense.weight", (attn + "o_proj.weight",), ((h, nq * d),), same, same),
        Row("{}.post_attention_norm.weight", ("model.layers.{}.post_attention_layernorm.weight",), ((h,),), same, same),
        Row("{}.mlp.fc1.weight", (mlp + "gate_proj.weight", mlp + "up_proj.weight"), ((f, h), (f, h)), gate_up,
            gate_up_back),
        Row("{}.mlp.fc2.weight", (mlp + "down_proj.weight",), ((h, f),), same, same),
        Row(f"{L + 1}.weight", ("model.norm.weight",), ((h,),), same, same),  # final norm
    ]
    if not cfg.tie_word_embeddings:
        table.append(Row(f"{L + 2}.linear.weight", ("lm_head.weight",), ((V, h),), same, same))
    return table


def table_for(arch: str, cfg: GPTConfig, gpt2_prefix: str = "transformer.") -> list[Row]:
    return gpt2_table(cfg, gpt2_prefix) if arch == "GPT2LMHeadModel" else llama_table(cfg)


def groups_for(arch: str, cfg: GPTConfig, gpt2_prefix: str = "transformer.", expert_layout: str = "per-expert") \
        -> list[list[Row]]:
    """The conversion groups of ``arch`` (see :func:`blocks`); MoE architectures: ``hf_moe.moe_blocks`` in
    ``expert_layout`` ("per-expert" or "fused")."""
    if arch in MOE:
        from zoo.convert import hf_moe

        return hf_moe.moe_blocks(cfg, arch, expert_layout)
    return list(blocks(table_for(arch, cfg, gpt2_prefix), cfg.num_hidden_layers))


def blocks(table: list[Row], num_layers: int) -> Iterator[list[Row]]:
    """The table's rows with ``{}`` filled in, grouped so a group can be converted at once: the rows before the
    first per-block row, then one group per block, then the rest."""
    per_block = [r for r in table if "{}" in r.zoo]
    first = table.index(per_block[0])
    yield table[:first]
    for i in range(num_layers):
        yield [r.at(i) for r in per_block]
    yield [r for r in table[first:] if "{}" not in r.zoo]


# ---------------------------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------------------------


def architecture_of(meta: dict, where: str) -> str:
    archs = meta.get("architectures") or []
    arch = archs[0] if archs else MODEL_TYPES.get(meta.get("model_type", ""), meta.get("model_type") or "unknown")
    if arch not in SUPPORTED:
        raise ConvertError(f"{where}: architecture {arch} is not supported; supported: {', '.join(SUPPORTED)}")
    return arch


def read_hf_meta(folder: Path) -> dict:
    """The parsed ``config.json`` of a HF model folder; a missing or broken file, or a zoo folder, refused."""
    path = folder / "config.json"
    if not path.is_file():
        raise ConvertError(f"{folder} has no config.json; pass a HuggingFace model folder")
    try:
        meta = json.loads(path.read_text())
    except ValueError as e:
        raise ConvertError(f"{path} is not valid JSON ({e})") from None
    if "zoo_format" in meta:
        raise ConvertError(f"{folder} is a zoo model folder, not a HuggingFace one (use zoo-to-hf)")
    return meta


def read_hf_config(folder: Path):
    """``(architecture, transformers config object)`` of a HF model folder (no remote code is ever run)."""
    meta = read_hf_meta(folder)
    arch = architecture_of(meta, str(folder / "config.json"))
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

    if arch in MOE:
        from zoo.convert import hf_moe

        return arch, hf_moe.config_classes()[arch].from_dict(meta)
    cls = {"GPT2LMHeadModel": GPT2Config, "LlamaForCausalLM": LlamaConfig, "MistralForCausalLM": MistralConfig,
           "Qwen2ForCausalLM": Qwen2Config}[arch]
    return arch, cls.from_dict(meta)


def _rope(c) -> tuple[float, dict | None]:
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


def gpt_config(fields: dict) -> GPTConfig:
    """GPTConfig from a dict, its validation errors as ConvertError (one line for the command line)."""
    try:
        return GPTConfig.from_dict(fields)
    except ValueError as e:
        raise ConvertError(str(e)) from None


def gpt_config_from_hf(arch: str, c) -> GPTConfig:
    """The GPTConfig computing what the HF model computes; refuses (one line) what zoo's GPT cannot express."""

    if arch in MOE:
        from zoo.convert import hf_moe

        return hf_moe.gpt_config_from_moe(arch, c)

    def need(ok, msg):
        if not ok:
            raise ConvertError(f"{arch}: {msg}")

    if arch == "GPT2LMHeadModel":
        act = c.activation_function
        need(act in ("gelu_new", "gelu_pytorch_tanh"),
             f"activation_function {act!r} is not supported; zoo's GPT-2 uses gelu_new (the tanh approximation)")
        need(c.scale_attn_weights, "scale_attn_weights=False is not supported (zoo scales scores by 1/sqrt(d))")
        need(not c.scale_attn_by_inverse_layer_idx, "scale_attn_by_inverse_layer_idx=True is not supported")
        need(not getattr(c, "add_cross_attention", False), "add_cross_attention=True is not supported")
        return gpt_config(dict(vocab_size=c.vocab_size, hidden_size=c.n_embd, num_hidden_layers=c.n_layer,
                         num_attention_heads=c.n_head, intermediate_size=c.n_inner or 4 * c.n_embd,
                         max_position_embeddings=c.n_positions, position_embedding_type="learned",
                         normalization="layernorm", norm_eps=c.layer_norm_epsilon, activation="gelu", add_bias=True,
                         tie_word_embeddings=bool(c.tie_word_embeddings), initializer_range=c.initializer_range,
                         hidden_dropout=c.resid_pdrop, attention_dropout=c.attn_pdrop))
    # Llama, Mistral and Qwen2 (q/k/v biases, always)
    qwen2 = arch == "Qwen2ForCausalLM"
    need(c.hidden_act == "silu", f"hidden_act {c.hidden_act!r} is not supported (zoo's SwiGLU uses silu)")
    need(not getattr(c, "attention_bias", False), "attention_bias=True is not supported (zoo's Llama has no biases)")
    need(not getattr(c, "mlp_bias", False), "mlp_bias=True is not supported (zoo's Llama has no biases)")
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    need(head_dim * c.num_attention_heads == c.hidden_size,
         f"head_dim {head_dim} x num_attention_heads {c.num_attention_heads} != hidden_size {c.hidden_size}; "
         f"zoo needs head_dim = hidden_size / num_attention_heads")
    window = getattr(c, "sliding_window", None)  # Qwen2Config sets it None unless use_sliding_window
    layer_types = getattr(c, "layer_types", None) or []
    need(set(layer_types) <= {"full_attention", "sliding_attention"},
         f"layer_types {sorted(set(layer_types) - {'full_attention', 'sliding_attention'})} are not supported")
    sliding = "sliding_attention" in layer_types if qwen2 else True  # Qwen2: only layers >= max_window_layers slide
    need(not sliding or window is None or window >= c.max_position_embeddings,
         f"sliding_window {window} < max_position_embeddings {c.max_position_embeddings}: zoo has no sliding-window "
         f"attention")
    theta, scaling = _rope(c)
    return gpt_config(dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers,
                     num_attention_heads=c.num_attention_heads,
                     num_key_value_heads=c.num_key_value_heads or c.num_attention_heads,
                     intermediate_size=c.intermediate_size, max_position_embeddings=c.max_position_embeddings,
                     position_embedding_type="rope", normalization="rmsnorm", norm_eps=c.rms_norm_eps,
                     activation="swiglu", add_bias=False, **({"qkv_bias": True} if qwen2 else {}),
                     tie_word_embeddings=bool(c.tie_word_embeddings),
                     rope_theta=theta, rope_scaling=scaling, initializer_range=c.initializer_range,
                     attention_dropout=float(getattr(c, "attention_dropout", 0.0) or 0.0)))


def export_architecture(cfg: GPTConfig) -> str:
    """The HF architecture computing what this zoo GPT computes (Mistral imports come back as Llama)."""
    if cfg.num_experts:
        from zoo.convert import hf_moe

        return hf_moe.export_architecture(cfg)
    features = (cfg.position_embedding_type, cfg.normalization, cfg.activation, cfg.add_bias, cfg.use_qkv_bias)
    if features == ("learned", "layernorm", "gelu", True, True):
        return "GPT2LMHeadModel"
    if features == ("rope", "rmsnorm", "swiglu", False, False):
        return "LlamaForCausalLM"
    if features == ("rope", "rmsnorm", "swiglu", False, True):
        return "Qwen2ForCausalLM"
    raise ConvertError(f"this zoo GPT (position {cfg.position_embedding_type}, {cfg.normalization}, {cfg.activation}, "
                       f"add_bias={cfg.add_bias}, qkv_bias={cfg.use_qkv_bias}) matches no HF architecture: "
                       f"GPT2LMHeadModel needs learned, layernorm, gelu, add_bias=True (and qkv_bias); "
                       f"LlamaForCausalLM needs rope, rmsnorm, swiglu, add_bias=False, qkv_bias=False; "
                       f"Qwen2ForCausalLM the same with qkv_bias=True")


def _rope_parameters(cfg: GPTConfig) -> dict:
    """transformers 5's ``rope_parameters`` (theta included) for a zoo GPT's RoPE settings."""
    rope = {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta}
    rope.pop("type", None)
    return rope


def hf_config_from_gpt(cfg: GPTConfig, arch: str, dtype: torch.dtype, special: dict):
    """The transformers config (GPT2Config, LlamaConfig or Qwen2Config, ``architectures`` set) for a zoo GPT."""
    from transformers import GPT2Config, LlamaConfig, Qwen2Config

    if arch in MOE:
        from zoo.convert import hf_moe

        return hf_moe.hf_config_from_moe(cfg, arch, dtype, special)
    common = dict(vocab_size=cfg.vocab_size, tie_word_embeddings=cfg.tie_word_embeddings,
                  initializer_range=cfg.initializer_range, architectures=[arch],
                  **{k: special.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")})
    if arch == "GPT2LMHeadModel":
        c = GPT2Config(n_embd=cfg.hidden_size, n_layer=cfg.num_hidden_layers, n_head=cfg.num_attention_heads,
                       n_inner=cfg.intermediate_size, n_positions=cfg.max_position_embeddings,
                       activation_function="gelu_new", layer_norm_epsilon=cfg.norm_eps, resid_pdrop=cfg.hidden_dropout,
                       embd_pdrop=cfg.hidden_dropout, attn_pdrop=cfg.attention_dropout, **common)
    elif arch == "Qwen2ForCausalLM":  # q/k/v biases built in; head_dim is hidden / heads, as in zoo
        c = Qwen2Config(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
                        num_key_value_heads=cfg.num_key_value_heads,
                        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.norm_eps,
                        rope_parameters=_rope_parameters(cfg), hidden_act="silu",
                        use_sliding_window=False, sliding_window=None, max_window_layers=cfg.num_hidden_layers,
                        attention_dropout=cfg.attention_dropout, **common)
    else:
        c = LlamaConfig(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
                        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.norm_eps,
                        rope_parameters=_rope_parameters(cfg), attention_bias=False, mlp_bias=False, hidden_act="silu",
                        attention_dropout=cfg.attention_dropout, **common)
    c.dtype = dtype
    return c


# ---------------------------------------------------------------------------------------------------------------
# Reading a HF folder
# ---------------------------------------------------------------------------------------------------------------


def _offline() -> bool:
    from huggingface_hub import constants

    return constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def resolve_hf_folder(src: str | os.PathLike, *, allow_pickle: bool = False, cache_dir=None) -> Path:
    """A local HF model folder as is (the network is never touched); otherwise a Hub id through huggingface_hub's
    cache (``snapshot_download``; cache only when HF_HUB_OFFLINE is set)."""
    path = Path(src).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ConvertError(f"{src} is a file; pass the HuggingFace model folder (or a Hub id)")
    text = str(src)
    if not REPO_ID.fullmatch(text) or text.count("/") > 1:
        raise ConvertError(f"HF model folder {src} does not exist")
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"] + (["*.bin"] if allow_pickle else [])
    offline = _offline()
    try:
        return Path(snapshot_download(text, allow_patterns=patterns, local_files_only=offline, cache_dir=cache_dir))
    except Exception as e:  # huggingface_hub raises many kinds; the message is what matters
        if offline:
            raise ConvertError(f"HF model folder {src} does not exist, nor is it a model id in the local HF cache "
                               f"(HF_HUB_OFFLINE is set)") from None
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConvertError(f"HF model folder {src} does not exist, nor could it be fetched from the Hub: {reason}") \
            from None


# Copy tensors out of a safetensors file without pinning its memory map (see io.read_tensors).
read_safetensors = io.read_tensors


def refuse_pickle_only(folder: Path) -> None:
    """``--init`` reads safetensors only (it has no --allow-pickle): a folder with nothing but a pickle checkpoint is
    refused in one line, naming the one-off conversion that can read it."""
    safe = any((folder / name).is_file() for name in (SAFE_INDEX, SAFE_SINGLE))
    if not safe and any((folder / name).is_file() for name in (PICKLE_INDEX, PICKLE_SINGLE)):
        raise ConvertError(f"{folder} holds only a pickle checkpoint ({PICKLE_SINGLE}), which can run code when "
                           f"loaded; --init reads safetensors only: convert it once with launch/convert.py hf-to-zoo "
                           f"--src {folder} --out DIR --allow-pickle (if you trust it) and pass --init DIR")


class HFCheckpoint:
    """The weights of a HF folder: names and shapes from the file headers, values read on demand.

    safetensors only, unless ``allow_pickle`` (then ``torch.load(weights_only=True)``, which unpickles tensors
    and plain containers only).
    """

    def __init__(self, folder: Path, allow_pickle: bool = False):
        self.folder, self.pickled = folder, False
        self.files: dict[str, str] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._loaded: dict[str, dict] = {}
        if (folder / SAFE_INDEX).is_file():
            self.files = dict(json.loads((folder / SAFE_INDEX).read_text())["weight_map"])
        elif (folder / SAFE_SINGLE).is_file():
            self.files = {k: SAFE_SINGLE for k in self._keys(SAFE_SINGLE)}
        elif (folder / PICKLE_INDEX).is_file() or (folder / PICKLE_SINGLE).is_file():
            if not allow_pickle:
                raise ConvertError(f"{folder} holds only a pickle checkpoint ({PICKLE_SINGLE}), which can run code "
                                   f"when loaded; convert it to safetensors, or pass --allow-pickle if you trust it")
            self.pickled = True
            if (folder / PICKLE_INDEX).is_file():
                self.files = dict(json.loads((folder / PICKLE_INDEX).read_text())["weight_map"])
            else:
                self.files = {k: PICKLE_SINGLE for k in self._load(PICKLE_SINGLE)}
        else:
            raise ConvertError(f"{folder} has no weights ({SAFE_SINGLE}, {SAFE_INDEX} or {PICKLE_SINGLE})")
        for fname in sorted(set(self.files.values())):
            if not (folder / fname).is_file():
                raise ConvertError(f"{folder / fname} is listed in the index but missing")
            if self.pickled:
                self.shapes.update({k: tuple(v.shape) for k, v in self._load(fname).items()})
            else:
                with safe_open(folder / fname, "pt") as f:
                    self.shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})

    def _keys(self, fname: str) -> list[str]:
        with safe_open(self.folder / fname, "pt") as f:
            return list(f.keys())

    def _load(self, fname: str) -> dict:
        if fname not in self._loaded:
            path = self.folder / fname
            try:
                try:
                    self._loaded[fname] = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                except RuntimeError:  # the legacy (non-zip) format cannot be memory-mapped
                    self._loaded[fname] = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as e:  # weights_only refuses anything but tensors and plain containers
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise ConvertError(f"{path} could not be read with torch.load(weights_only=True): {first}") from None
        return self._loaded[fname]

    def read(self, keys) -> dict[str, torch.Tensor]:
        """The tensors named by ``keys``, copied out of their files (see :func:`read_safetensors`)."""
        by_file: dict[str, list[str]] = {}
        for k in keys:
            by_file.setdefault(self.files[k], []).append(k)
        out = {}
        for fname, names in by_file.items():
            if self.pickled:
                out.update({k: self._load(fname)[k].clone() for k in names})
            else:
                out.update(read_safetensors(self.folder / fname, names))
        return out


def _check_shapes(rows: list[Row], shapes: dict[str, tuple], where: str) -> None:
    for row in rows:
        for key, expected in zip(row.hf, row.hf_shapes):
            if key not in shapes:
                raise ConvertError(f"tensor {key} is missing from {where}")
            if tuple(shapes[key]) != tuple(expected):
                raise ConvertError(f"tensor {key}: checkpoint has shape {tuple(shapes[key])}, config.json implies "
                                   f"{tuple(expected)}")


def _gpt2_prefix(keys) -> str:
    return "" if "wte.weight" in keys and "transformer.wte.weight" not in keys else "transformer."


# ---------------------------------------------------------------------------------------------------------------
# The two conversions
# ---------------------------------------------------------------------------------------------------------------


def hf_to_zoo(src, out, *, dtype: torch.dtype | None = None, allow_pickle: bool = False,
              max_shard_bytes: int = io.DEFAULT_SHARD_BYTES, cache_dir=None) -> Path:
    """Write the HF model ``src`` (folder or Hub id) as a zoo model folder ``out`` (family "gpt"), streaming.

    Everything is checked (architecture, config, every tensor's presence and shape, no unused tensor) before a
    byte is written. ``dtype`` None keeps the checkpoint's dtypes.
    """
    folder = resolve_hf_folder(src, allow_pickle=allow_pickle, cache_dir=cache_dir)
    arch, hf_cfg = read_hf_config(folder)
    cfg = gpt_config_from_hf(arch, hf_cfg)
    ckpt = HFCheckpoint(folder, allow_pickle)
    if arch in MOE:  # either expert layout (hf_moe's docstring)
        from zoo.convert import hf_moe

        layout = hf_moe.expert_layout(ckpt.shapes)
        groups = groups_for(arch, cfg, expert_layout=layout)
        hf_moe.check_experts(groups, cfg, arch, layout, ckpt.shapes, str(folder))
    else:
        groups = groups_for(arch, cfg, _gpt2_prefix(ckpt.shapes))
    rows = [r for g in groups for r in g]
    _check_shapes(rows, ckpt.shapes, str(folder))
    used = {k for r in rows for k in r.hf}
    if cfg.tie_word_embeddings:
        used.add("lm_head.weight")  # some checkpoints store the tied head too: it is the embedding
    unused = sorted(k for k in set(ckpt.shapes) - used if not IGNORED.search(k))
    if unused:
        raise ConvertError(f"{folder}: {len(unused)} tensor(s) the {arch} table does not use, e.g. {unused[:3]}; "
                           f"the model has a feature zoo does not convert")

    def tensors():
        for group in groups:
            values = ckpt.read([k for r in group for k in r.hf])
            for row in group:
                t = row.to_zoo(*(values.pop(k) for k in row.hf))
                yield row.zoo, t if dtype is None else t.to(dtype)

    return io.write_model_folder(out, "gpt", cfg.to_dict(), tensors(), tokenizer_dir=folder,
                                 max_shard_bytes=max_shard_bytes,
                                 extra_files={GENERATION_CONFIG: _generation_config(folder, hf_cfg)})


def _generation_config(folder: Path, hf_cfg) -> str | bytes:
    """The special token ids and generation defaults to keep beside the zoo folder (zoo's config has no place for
    them): the HF folder's generation_config.json as is, or one derived from its config (as save_pretrained
    writes it)."""
    if (folder / GENERATION_CONFIG).is_file():
        return (folder / GENERATION_CONFIG).read_bytes()
    from transformers import GenerationConfig

    return GenerationConfig.from_model_config(hf_cfg).to_json_string(use_diff=True, keys_to_pop=["compile_config"])


def _special_ids(zoo_folder: Path) -> dict:
    path = zoo_folder / GENERATION_CONFIG
    if not path.is_file():
        return {}
    meta = json.loads(path.read_text())
    return {k: meta.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}


MODEL_CARD = """---
library_name: transformers
pipeline_tag: text-generation
---

# {name}

A {arch} ({params:,} parameters, {dtype}) exported from the zoo model folder `{src}` by
`launch/convert.py zoo-to-hf`. The weights are zoo's, unchanged except for layout (fused QKV and SwiGLU
projections split, HF's naming); no tokenizer or training details are added here beyond the files passed through.

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("{name}")
tokenizer = AutoTokenizer.from_pretrained("{name}")  # if tokenizer files were present in the zoo folder
```

Check it against the zoo folder with `launch/convert.py verify --hf {name} --zoo {src}`.
"""


def read_zoo_gpt(folder, refusal: str) -> GPTConfig:
    """The GPTConfig of the zoo model folder ``folder``; a folder of another family is refused in one line,
    ``"<folder> holds a <family> model; <refusal>"``."""
    try:
        family, meta = io.read_config(folder)
    except io.CheckpointError as e:
        raise ConvertError(str(e)) from None
    if family != "gpt":
        raise ConvertError(f"{folder} holds a {family!r} model; {refusal}")
    return gpt_config(meta)


def zoo_weights(src: Path) -> tuple[dict[str, str], dict[str, tuple]]:
    """``(tensor -> file, tensor -> shape)`` of a zoo model folder, the shapes from the safetensors headers."""
    try:
        files = io.weight_map(src)
    except io.CheckpointError as e:
        raise ConvertError(str(e)) from None
    shapes: dict[str, tuple] = {}
    for fname in sorted(set(files.values())):
        with safe_open(src / fname, "pt") as f:
            shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
    return files, shapes


def check_zoo_rows(groups: list[list[Row]], shapes: dict[str, tuple], src: Path) -> None:
    """Every zoo tensor the rows export is in the folder, in the shape its config implies."""
    for row in (r for g in groups for r in g):
        if row.zoo not in shapes:
            raise ConvertError(f"tensor {row.zoo} is missing from {src}")
        if shapes[row.zoo] != row.zoo_shape():
            raise ConvertError(f"tensor {row.zoo}: checkpoint has shape {shapes[row.zoo]}, its config implies "
                               f"{row.zoo_shape()}")


def export_rows(src: Path, out, groups: list[list[Row]], files: dict[str, str], dtype: torch.dtype | None, *,
                max_shard_bytes: int = io.DEFAULT_SHARD_BYTES) -> tuple[Path, torch.dtype]:
    """The HF tensors of ``groups`` (read from the zoo folder ``src``, one group at a time, each file mapped only
    while it is read) written by ``io.ShardedWriter`` into a fresh staging folder for ``out``, with the index.

    Returns ``(staging folder, dtype for config.json)``: ``dtype``, or when None (tensors kept as stored) that of
    the first row's tensor, the word embedding. The caller adds the config files and ``io.publish``-es it."""
    if dtype is None:
        first = groups[0][0].zoo
        with safe_open(src / files[first], "pt") as f:
            dtype_name = f.get_slice(first).get_dtype()
        out_dtype = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}.get(dtype_name, torch.float32)
    else:
        out_dtype = dtype
    staging = io.staging_folder(Path(out))
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    writer = io.ShardedWriter(staging, prefix="model", max_shard_bytes=max_shard_bytes)
    for group in groups:
        by_file: dict[str, list[str]] = {}
        for row in group:
            by_file.setdefault(files[row.zoo], []).append(row.zoo)
        values = {}
        for fname, names in by_file.items():
            values.update(read_safetensors(src / fname, names))
        for row in group:
            for key, t in zip(row.hf, row.hf_tensors(values.pop(row.zoo))):
                writer.add(key, t if dtype is None else t.to(dtype))
    io.write_index(staging, writer.close(), writer.total_bytes)
    return staging, out_dtype


def zoo_to_hf(src, out, *, dtype: torch.dtype | None = None, max_shard_bytes: int = io.DEFAULT_SHARD_BYTES,
              fused_experts: bool = False) -> Path:
    """Write the zoo model folder ``src`` as a HF model folder ``out``: safetensors (one file or sharded with an
    index), config.json, generation_config.json, tokenizer files, README.md. Streams one block at a time.

    Mixture-of-experts models are written one tensor per expert (``save_pretrained``'s default), or with
    ``fused_experts`` as transformers 5 holds them (``save_pretrained(save_original_format=False)``)."""
    src = Path(src)
    cfg = read_zoo_gpt(src, "this converter exports the gpt family")
    if fused_experts and not cfg.num_experts:
        raise ConvertError(f"{src} holds a dense GPT (num_experts 0); fused experts are for mixture-of-experts "
                           f"models: leave out --fused-experts")
    arch = export_architecture(cfg)
    groups = groups_for(arch, cfg, expert_layout="fused" if fused_experts else "per-expert")
    files, shapes = zoo_weights(src)
    check_zoo_rows(groups, shapes, src)
    final = Path(out)
    staging, out_dtype = export_rows(src, final, groups, files, dtype, max_shard_bytes=max_shard_bytes)
    special = _special_ids(src)
    hf_cfg = hf_config_from_gpt(cfg, arch, out_dtype, special)
    hf_cfg.save_pretrained(staging)
    if (src / GENERATION_CONFIG).is_file():
        shutil.copy2(src / GENERATION_CONFIG, staging / GENERATION_CONFIG)
    else:
        from transformers import GenerationConfig

        GenerationConfig.from_model_config(hf_cfg).save_pretrained(staging)
    io.copy_tokenizer(src, staging)
    (staging / "README.md").write_text(MODEL_CARD.format(name=final.name, arch=arch, params=cfg.num_parameters(),
                                                         dtype=str(out_dtype).replace("torch.", ""), src=src))
    io.publish(staging, final)
    return final

"""Olmo2ForCausalLM and Olmo3ForCausalLM <-> zoo's GPT: Llama's keys (``llama.py``) with OLMo 2's block.

The differences: post-norm (``norm_placement="post"``: x + norm(f(x)); HF's ``post_attention_layernorm`` is zoo's
``attention_output_norm``, ``post_feedforward_layernorm`` its ``mlp_output_norm``; no input norms), RMSNorm of q and
k over the whole projection (``qk_norm="full"``, OLMoE's rows: ``[nq d]`` and ``[nkv d]`` weights), optional
``attention_bias`` on q, k, v and o (Granite's rows, ``granite.bias_rows``), any ``head_dim``. OLMo 3 adds sliding
windows on the layers ``layer_types`` marks, and RoPE parameters per layer type (``rope_parameters`` keyed
``full_attention`` / ``sliding_attention``): read where both types share them; different ones are refused in one
line until zoo has per-layer-type RoPE.
"""

from __future__ import annotations

import copy

import torch

from zoo.convert.hf import granite, llama
from zoo.convert.hf.common import refusal
from zoo.convert.hf.moe import qk_norm_rows
from zoo.convert.registry import Architecture
from zoo.convert.tables import Row, blocks, same
from zoo.models.gpt import FAMILY, GPTConfig

NAME, OLMO3 = "Olmo2ForCausalLM", "Olmo3ForCausalLM"
LAYER = "model.layers.{}."
# zoo's block norm -> OLMo 2's: llama's two input norms dropped, the two output norms added.
NORMS = {"{}.attention_output_norm.weight": LAYER + "post_attention_layernorm.weight",
         "{}.mlp_output_norm.weight": LAYER + "post_feedforward_layernorm.weight"}
INPUT_NORMS = ("{}.input_norm.weight", "{}.post_attention_norm.weight")


def table(cfg: GPTConfig) -> list[Row]:
    h = cfg.hidden_size
    rows = [r for r in llama.table(cfg) if r.zoo not in INPUT_NORMS]
    last = max(i for i, r in enumerate(rows) if "{}" in r.zoo)
    norms = [Row(zoo, (hf,), ((h,),), same, same) for zoo, hf in NORMS.items()]
    return granite.with_bias_rows(rows[:last + 1] + norms + qk_norm_rows(cfg) + rows[last + 1:], cfg)


def groups(cfg: GPTConfig, **_) -> list[list[Row]]:
    return list(blocks(table(cfg), cfg.num_hidden_layers))


def per_type_rope(c, arch: str):
    """OLMo 3's ``rope_parameters`` per layer type, as one set when every type has the same (else refused)."""
    params = dict(getattr(c, "rope_parameters", None) or {})
    kinds = {k: v for k, v in params.items() if k in llama.LAYER_TYPES and isinstance(v, dict)}
    if not kinds:
        return c
    used = [kinds.get(t) for t in set(c.layer_types or [])]
    one = used[0]
    # TODO(rope merge): per-layer-type RoPE parameters (the rope helper's Gemma 3 field) would take these.
    refusal(arch)(all(p == one for p in used), f"rope_parameters differ per layer type ({kinds}); zoo's GPT has one "
                                               f"RoPE for every layer")
    flat = copy.copy(c)
    flat.rope_parameters = dict(one)
    return flat


def to_zoo(c, arch: str = NAME, windows=llama.no_window) -> GPTConfig:
    need = refusal(arch)
    need(c.hidden_act == "silu", f"hidden_act {c.hidden_act!r} is not supported (zoo's SwiGLU uses silu)")
    plain = per_type_rope(c, arch)
    if plain is c:
        plain = copy.copy(c)
    plain.attention_bias = False  # mapped below (granite.bias_fields), not refused as Llama's
    cfg = llama.to_zoo(plain, arch=arch, windows=windows, qk_norm="full", norm_placement="post")
    return GPTConfig.from_dict({**cfg.to_dict(), **granite.bias_fields(c)})


def is_olmo2(cfg: GPTConfig) -> bool:
    """Llama's features with OLMo 2's post-norm and q/k norm over the projection; q/k/v/o biases or none."""
    llama_like = GPTConfig.from_dict({**cfg.to_dict(), "norm_placement": "pre", "qk_norm": None, "add_bias": False,
                                      "qkv_bias": False, "mlp_bias": False})
    return (cfg.norm_placement == "post" and cfg.qk_norm == "full" and cfg.use_qkv_bias == cfg.add_bias
            and not cfg.use_mlp_bias and llama.is_llama(llama_like))


def exports(cfg: GPTConfig) -> bool:
    return is_olmo2(cfg) and llama.is_windowless(cfg)


def hf_fields(cfg: GPTConfig, arch: str, special: dict) -> dict:
    return dict(intermediate_size=cfg.intermediate_size, attention_bias=cfg.add_bias, **granite.head_dim_field(cfg),
                **llama.common_hf_fields(cfg, arch, special))


def to_hf(cfg: GPTConfig, dtype: torch.dtype, special: dict):
    from transformers import Olmo2Config

    c = Olmo2Config(**hf_fields(cfg, NAME, special))
    c.dtype = dtype
    return c


def olmo3_to_hf(cfg: GPTConfig, dtype: torch.dtype, special: dict):
    from transformers import Olmo3Config

    fields = hf_fields(cfg, OLMO3, special)
    rope = fields.pop("rope_parameters")
    L = cfg.num_hidden_layers
    types = ["full_attention" if cfg.attention_window(i) is None else "sliding_attention" for i in range(L)]
    c = Olmo3Config(rope_parameters={t: dict(rope) for t in llama.LAYER_TYPES}, layer_types=types,
                    sliding_window=cfg.sliding_window or cfg.max_position_embeddings, **fields)
    c.dtype = dtype
    return c


def _config_class():
    from transformers import Olmo2Config  # imported on use: the registry imports every file

    return Olmo2Config


def _olmo3_config_class():
    from transformers import Olmo3Config

    return Olmo3Config


ARCHITECTURES = {
    NAME: Architecture(NAME, FAMILY, _config_class, to_zoo, groups, to_hf, model_type="olmo2", exports=exports,
                       export_needs="Olmo2ForCausalLM Llama's features with norm_placement post, qk_norm full, "
                                    "no window"),
    OLMO3: Architecture(OLMO3, FAMILY, _olmo3_config_class,
                        lambda c: to_zoo(c, arch=OLMO3, windows=llama.window_by_layer_types), groups, olmo3_to_hf,
                        model_type="olmo3", exports=lambda cfg: is_olmo2(cfg) and not llama.is_windowless(cfg),
                        export_needs="Olmo3ForCausalLM the same with sliding windows"),
}

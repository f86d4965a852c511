"""Olmo2ForCausalLM and Olmo3ForCausalLM <-> zoo's GPT: Llama's keys (``llama.py``) with OLMo 2's block.

The differences: post-norm (``norm_placement="post"``: x + norm(f(x)); HF's ``post_attention_layernorm`` is zoo's
``attention_output_norm``, ``post_feedforward_layernorm`` its ``mlp_output_norm``; no input norms), RMSNorm of q and
k over the whole projection (``qk_norm="full"``, OLMoE's rows: ``[nq d]`` and ``[nkv d]`` weights), optional
``attention_bias`` on q, k, v and o (Granite's rows, ``granite.bias_rows``), any ``head_dim``. OLMo 3 adds sliding
windows on the layers ``layer_types`` marks, and RoPE parameters per layer type (``rope_parameters`` keyed
``full_attention`` / ``sliding_attention``; transformers puts a legacy ``rope_scaling``, YaRN, on the full layers
only): the full layers' are zoo's ``rope_theta`` / ``rope_scaling``, the sliding layers' plain theta, where it
differs, zoo's ``rope_local_base_freq``; a scaled RoPE on the sliding layers is refused in one line.
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
    """OLMo 3's ``rope_parameters`` per layer type: ``(a config copy holding the full layers' set as its one set,
    the sliding layers' theta where their set differs, else None)``; a scaled RoPE there is refused."""
    params = dict(getattr(c, "rope_parameters", None) or {})
    kinds = {k: v for k, v in params.items() if k in llama.LAYER_TYPES and isinstance(v, dict)}
    if not kinds:
        return c, None
    full = kinds.get("full_attention") or kinds.get("sliding_attention")
    sliding = kinds.get("sliding_attention", full)
    local = None
    if "sliding_attention" in (c.layer_types or []) and sliding != full:
        local, scaling = llama.rope(c, sliding)
        refusal(arch)(scaling is None, f"rope_parameters['sliding_attention'] rope_type {sliding.get('rope_type')!r} "
                                       f"is not supported (zoo's sliding layers take plain RoPE)")
    flat = copy.copy(c)
    flat.rope_parameters = dict(full)
    return flat, local


def to_zoo(c, arch: str = NAME, windows=llama.no_window) -> GPTConfig:
    need = refusal(arch)
    need(c.hidden_act == "silu", f"hidden_act {c.hidden_act!r} is not supported (zoo's SwiGLU uses silu)")
    plain, local = per_type_rope(c, arch)
    if plain is c:
        plain = copy.copy(c)
    plain.attention_bias = False  # mapped below (granite.bias_fields), not refused as Llama's
    cfg = llama.to_zoo(plain, arch=arch, windows=windows, qk_norm="full", norm_placement="post")
    return GPTConfig.from_dict({**cfg.to_dict(), **granite.bias_fields(c),
                                **({} if local is None else {"rope_local_base_freq": local})})


def is_olmo2(cfg: GPTConfig, local_theta: bool = False) -> bool:
    """Llama's features with OLMo 2's post-norm and q/k norm over the projection; q/k/v/o biases or none;
    ``local_theta``: the sliding layers' own theta allowed (OLMo 3)."""
    llama_like = GPTConfig.from_dict({**cfg.to_dict(), "norm_placement": "pre", "qk_norm": None, "add_bias": False,
                                      "qkv_bias": False, "mlp_bias": False,
                                      **({"rope_local_base_freq": None} if local_theta else {})})
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
    local = llama.rope_parameters(cfg, cfg.rope_local_base_freq, None) if cfg.rope_local_base_freq else dict(rope)
    c = Olmo3Config(rope_parameters={"full_attention": rope, "sliding_attention": local}, layer_types=types,
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
                        model_type="olmo3",
                        exports=lambda cfg: is_olmo2(cfg, local_theta=True) and not llama.is_windowless(cfg),
                        export_needs="Olmo3ForCausalLM the same with sliding windows (and their own theta)"),
}

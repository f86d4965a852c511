"""SmolLM3ForCausalLM <-> zoo's GPT: Llama (``llama.py``) with NoPE layers and Qwen2-style windows.

The differences: ``no_rope_layers`` (per layer, 1 RoPE, 0 none: zoo's field of the same name, written back as it
was read, so a SmolLM3 folder exports as SmolLM3), the sliding window on the layers ``layer_types`` marks when
``use_sliding_window`` is set (``llama.window_by_layer_types``), any ``head_dim``. Refused, one line each: biases,
sliding layer types without ``use_sliding_window`` (transformers would mask them but not window them).
"""

from __future__ import annotations

import torch

from zoo.convert.hf import llama
from zoo.convert.hf.common import refusal
from zoo.convert.registry import Architecture
from zoo.models.gpt import FAMILY, GPTConfig

NAME = "SmolLM3ForCausalLM"


def windows(c) -> dict:
    types = list(getattr(c, "layer_types", None) or [])
    if not c.use_sliding_window:
        refusal(NAME)("sliding_attention" not in types,
                      "layer_types has sliding_attention layers but use_sliding_window is false; set one or the other")
        return {}
    return llama.window_by_layer_types(c)


def to_zoo(c) -> GPTConfig:
    return llama.to_zoo(c, arch=NAME, windows=windows, no_rope_layers=[int(v) for v in c.no_rope_layers])


def exports(cfg: GPTConfig) -> bool:
    """Llama's features with a ``no_rope_layers`` list, any windows."""
    return cfg.no_rope_layers is not None and llama.is_llama(cfg, nope=True)


def to_hf(cfg: GPTConfig, dtype: torch.dtype, special: dict):
    from transformers import SmolLM3Config

    L = cfg.num_hidden_layers
    types = ["full_attention" if cfg.attention_window(i) is None else "sliding_attention" for i in range(L)]
    c = SmolLM3Config(intermediate_size=cfg.intermediate_size, head_dim=cfg.head_dim, attention_bias=False,
                      mlp_bias=False, no_rope_layers=list(cfg.no_rope_layers), layer_types=types,
                      use_sliding_window=not llama.is_windowless(cfg), sliding_window=cfg.sliding_window,
                      **llama.common_hf_fields(cfg, NAME, special))
    c.dtype = dtype
    return c


def _config_class():
    from transformers import SmolLM3Config  # imported on use: the registry imports every file

    return SmolLM3Config


ARCHITECTURES = {NAME: Architecture(
    NAME, FAMILY, _config_class, to_zoo, llama.groups, to_hf, model_type="smollm3", exports=exports,
    export_needs="SmolLM3ForCausalLM the same with no_rope_layers")}

"""MistralForCausalLM: Llama's keys, config and refusals (``llama.py``) under Mistral's class name.

Mistral's one difference is its sliding window, on every layer: a ``sliding_window`` shorter than the context
imports as zoo's ``sliding_window`` (``layer_types`` None: every layer slides), a longer one (or none) as full
attention. A zoo GPT with Llama's features and a window on every layer exports as MistralForCausalLM; without a
window it exports as LlamaForCausalLM (the same computation), as Mistral v0.2+ checkpoints come back.
"""

from __future__ import annotations

from functools import partial

import torch

from zoo.convert.hf import llama
from zoo.convert.registry import Architecture
from zoo.models.gpt import FAMILY, GPTConfig

NAME = "MistralForCausalLM"


def exports(cfg: GPTConfig) -> bool:
    """Llama's features with the same window on every layer."""
    windows = {cfg.attention_window(i) for i in range(cfg.num_hidden_layers)}
    return llama.is_llama(cfg) and cfg.sliding_window is not None and windows == {cfg.sliding_window}


def to_hf(cfg: GPTConfig, dtype: torch.dtype, special: dict):
    from transformers import MistralConfig

    c = MistralConfig(intermediate_size=cfg.intermediate_size, head_dim=cfg.head_dim,
                      sliding_window=cfg.sliding_window, **llama.common_hf_fields(cfg, NAME, special))
    c.dtype = dtype
    return c


def _config_class():
    from transformers import MistralConfig  # imported on use: the registry imports every file

    return MistralConfig


ARCHITECTURES = {NAME: Architecture(
    NAME, FAMILY, _config_class, partial(llama.to_zoo, arch=NAME, windows=llama.window_every_layer), llama.groups,
    to_hf, model_type="mistral", exports=exports,
    export_needs="MistralForCausalLM the same with one sliding_window on every layer")}

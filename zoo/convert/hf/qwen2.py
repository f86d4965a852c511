"""Qwen2ForCausalLM: Llama (``llama.py``) with biases on q, k and v (not on o_proj or the MLP).

The differences: ``GPTConfig(add_bias=False, qkv_bias=True)``, the three biases fused per key-value group exactly
like the weights (llama's table adds their row when ``cfg.use_qkv_bias``); only the layers ``layer_types`` marks
slide (transformers derives it from ``max_window_layers`` when absent), so a window shorter than the context
imports as zoo's ``sliding_window`` with those ``layer_types`` (``llama.window_by_layer_types``) and exports back
with them written out. Qwen2Config has no ``head_dim``: it is hidden / heads. Such a zoo GPT exports as
Qwen2ForCausalLM.
"""

from __future__ import annotations

from functools import partial

import torch

from zoo.convert.hf import llama
from zoo.convert.registry import Architecture
from zoo.models.gpt import FAMILY, GPTConfig

NAME = "Qwen2ForCausalLM"


def exports(cfg: GPTConfig) -> bool:
    return llama.is_llama(cfg, qkv_bias=True) and cfg.head_dim * cfg.num_attention_heads == cfg.hidden_size


def to_hf(cfg: GPTConfig, dtype: torch.dtype, special: dict):
    """Qwen2Config: q/k/v biases built in; head_dim is hidden / heads, as :func:`exports` asks; the window fields."""
    from transformers import Qwen2Config

    c = Qwen2Config(intermediate_size=cfg.intermediate_size, **llama.window_hf_fields(cfg),
                    **llama.common_hf_fields(cfg, NAME, special))
    c.dtype = dtype
    return c


def _config_class():
    from transformers import Qwen2Config

    return Qwen2Config


ARCHITECTURES = {NAME: Architecture(
    NAME, FAMILY, _config_class, partial(llama.to_zoo, arch=NAME, qkv_bias=True, windows=llama.window_by_layer_types),
    llama.groups, to_hf, model_type="qwen2", exports=exports,
    export_needs="Qwen2ForCausalLM the same with qkv_bias=True and head_dim = hidden / heads, any sliding windows")}

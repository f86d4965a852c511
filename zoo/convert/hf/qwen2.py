"""Qwen2ForCausalLM: Llama (``llama.py``) with biases on q, k and v (not on o_proj or the MLP).

The differences: ``GPTConfig(add_bias=False, qkv_bias=True)``, the three biases fused per key-value group exactly
like the weights (llama's table adds their row when ``cfg.use_qkv_bias``); only the layers ``layer_types`` marks
slide (from ``max_window_layers`` on), so a window is refused only where one does. Such a zoo GPT exports as
Qwen2ForCausalLM.
"""

from __future__ import annotations

from functools import partial

import torch

from zoo.convert.hf import llama
from zoo.convert.registry import Architecture
from zoo.models.gpt import FAMILY, GPTConfig

NAME = "Qwen2ForCausalLM"


def to_hf(cfg: GPTConfig, dtype: torch.dtype, special: dict):
    """Qwen2Config: q/k/v biases built in; head_dim is hidden / heads, as in zoo; no window."""
    from transformers import Qwen2Config

    c = Qwen2Config(intermediate_size=cfg.intermediate_size, use_sliding_window=False, sliding_window=None,
                    max_window_layers=cfg.num_hidden_layers, **llama.common_hf_fields(cfg, NAME, special))
    c.dtype = dtype
    return c


def _config_class():
    from transformers import Qwen2Config

    return Qwen2Config


ARCHITECTURES = {NAME: Architecture(
    NAME, FAMILY, _config_class, partial(llama.to_zoo, arch=NAME, qkv_bias=True, sliding_by_layer_types=True),
    llama.groups, to_hf, model_type="qwen2", exports=partial(llama.is_llama, qkv_bias=True),
    export_needs="Qwen2ForCausalLM the same with qkv_bias=True")}

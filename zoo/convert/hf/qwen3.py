"""Qwen3ForCausalLM (dense Qwen3): Llama (``llama.py``) with RMSNorm of q and k over each head, Qwen2's windows.

The differences: ``GPTConfig(qk_norm="head")`` with the two norm rows Qwen3-MoE has (``moe.qk_norm_rows``: one
``[head_dim]`` weight each for q and k per block), any ``head_dim`` (Qwen3Config states it; zoo's ``head_dim``),
and Qwen2's sliding windows on the layers ``layer_types`` marks (``llama.window_by_layer_types`` one way,
``llama.window_hf_fields`` the other). ``attention_bias=True`` puts a bias on o_proj too, which zoo's block has only
with MLP biases: refused. A dense zoo GPT with Llama's features and ``qk_norm="head"`` exports as this class.
"""

from __future__ import annotations

from functools import partial

import torch

from zoo.convert.hf import llama
from zoo.convert.hf.common import refusal
from zoo.convert.hf.moe import qk_norm_rows
from zoo.convert.registry import Architecture
from zoo.convert.tables import Row, blocks
from zoo.models.gpt import FAMILY, GPTConfig

NAME = "Qwen3ForCausalLM"


def table(cfg: GPTConfig) -> list[Row]:
    return llama.table(cfg) + qk_norm_rows(cfg)


def groups(cfg: GPTConfig, **_) -> list[list[Row]]:
    return list(blocks(table(cfg), cfg.num_hidden_layers))


def to_zoo(c) -> GPTConfig:
    refusal(NAME)(not c.attention_bias, "attention_bias=True is not supported (its o_proj bias: zoo's block has one "
                                        "only with add_bias, which biases the MLP too)")
    return llama.to_zoo(c, arch=NAME, windows=llama.window_by_layer_types, qk_norm="head")


def to_hf(cfg: GPTConfig, dtype: torch.dtype, special: dict):
    from transformers import Qwen3Config

    c = Qwen3Config(intermediate_size=cfg.intermediate_size, head_dim=cfg.head_dim, attention_bias=False,
                    **llama.window_hf_fields(cfg), **llama.common_hf_fields(cfg, NAME, special))
    c.dtype = dtype
    return c


def _config_class():
    from transformers import Qwen3Config

    return Qwen3Config


ARCHITECTURES = {NAME: Architecture(
    NAME, FAMILY, _config_class, to_zoo, groups, to_hf, model_type="qwen3",
    exports=partial(llama.is_llama, qk_norm="head"),
    export_needs="Qwen3ForCausalLM the same with qk_norm head, any head_dim and sliding windows")}

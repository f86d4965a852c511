"""MixtralForCausalLM: the shared MoE pieces (``moe.py``) with Mixtral's differences.

Every layer sparse; softmax top-k renormalised (``norm_topk_prob``); no biases, no q/k norm; the expert count is
``num_local_experts`` and ``intermediate_size`` the expert width. Mistral's window: a ``sliding_window`` shorter
than the context imports as zoo's ``sliding_window`` on every layer (``layer_types`` None) and exports back; a zoo
MoE GPT whose layers' windows differ is refused. Per-expert checkpoints keep the experts in
``block_sparse_moe.experts.{j}.w1 / w3 / w2`` (gate, up, down). Refused besides the shared refusals:
``router_jitter_noise`` (zoo's router has no jitter).
"""

from __future__ import annotations

import torch

from zoo.convert.hf import llama, moe
from zoo.convert.hf.common import refusal
from zoo.models.gpt import GPTConfig

NAME = "MixtralForCausalLM"
COUNT = "num_local_experts"


def groups(cfg: GPTConfig, layout: str = moe.PER_EXPERT, **_):
    return moe.moe_blocks(cfg, layout, per_expert_module="block_sparse_moe.", names=("w1", "w3", "w2"))


def to_zoo(c) -> GPTConfig:
    fields = moe.base_fields(NAME, c, count_field=COUNT, windows=llama.window_every_layer)
    refusal(NAME)(not c.router_jitter_noise, f"router_jitter_noise {c.router_jitter_noise} is not supported (zoo's "
                                             f"router has no jitter; it only perturbs training): set it to 0 in "
                                             f"config.json")
    return moe.gpt_config({**fields, "norm_topk_prob": True})


def exports(cfg: GPTConfig) -> bool:
    return bool(cfg.num_experts) and cfg.qk_norm not in ("head", "full") and not cfg.num_shared_experts


def rules(cfg: GPTConfig) -> list:
    return [(not cfg.use_qkv_bias, "no q/k/v bias"), (cfg.norm_topk_prob, "norm_topk_prob"),
            (moe.all_sparse(cfg), "every layer sparse"),
            (moe.one_window(cfg), "one sliding_window on every layer or none (no layer_types)")]


def to_hf(cfg: GPTConfig, dtype: torch.dtype, special: dict):
    from transformers import MixtralConfig

    c = MixtralConfig(intermediate_size=cfg.expert_intermediate_size, num_local_experts=cfg.num_experts,
                      sliding_window=None if llama.is_windowless(cfg) else cfg.sliding_window, router_jitter_noise=0.0,
                      **moe.hf_fields(cfg, NAME, special))
    c.dtype = dtype
    return c


def _config_class():
    from transformers import MixtralConfig

    return MixtralConfig


ARCHITECTURES = moe.architecture(NAME, _config_class, to_zoo, to_hf, "mixtral", exports, rules, count_field=COUNT,
                                 groups=groups)

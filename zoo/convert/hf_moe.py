"""HuggingFace <-> zoo for mixture-of-experts GPTs: Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE.

The attention, norm, embedding and dense-MLP rows are Llama's (``hf_gpt.llama_table``); this module adds the rows
of the MoE blocks and the q/k norms, and the config mapping both ways. ``zoo.convert.hf_gpt`` calls in here for
these architectures, so its streaming ``hf_to_zoo`` / ``zoo_to_hf`` (one block's tensors at a time, through
``io.ShardedWriter``), ``verify`` and ``launch/train.py --init`` serve them unchanged.

Two on-disk expert layouts, both written by transformers 5's ``save_pretrained`` and both read by its
``from_pretrained`` (its ``conversion_mapping`` fuses the per-expert tensors on load, and splits them again on save
unless ``save_original_format=False``):

  per expert (the default; what transformers 4 reads)   fused (``save_original_format=False``)
  Mixtral  model.layers.{i}.block_sparse_moe.gate.weight                     model.layers.{i}.mlp.gate.weight
           ...block_sparse_moe.experts.{j}.w1 / w3 / w2.weight               ...mlp.experts.gate_up_proj [E, 2I, h]
  others   model.layers.{i}.mlp.experts.{j}.gate_proj / up_proj / down_proj  ...mlp.experts.down_proj [E, h, I]

zoo holds the experts as transformers does in memory (``experts.gate_up_proj`` [E, 2I, h], rows [gate; up];
``experts.down_proj`` [E, h, I]), so the fused layout is a copy and the per-expert one a stack (import) or an unbind
(export): pure data movement, bit-exact both ways. Import reads either layout (whichever the checkpoint holds);
export writes the per-expert one unless asked for the fused one. A block of the table is one layer, so a conversion
holds one layer's experts at a time, never all of them.

What each architecture fixes (anything else in config.json is refused in one line):
  Mixtral    every layer sparse; softmax top-k renormalised; no biases, no q/k norm; ``intermediate_size`` is the
             expert width
  Qwen2-MoE  q/k/v biases (``qkv_bias``); a shared expert of ``shared_expert_intermediate_size`` behind a sigmoid
             gate; ``norm_topk_prob``; dense layers where ``mlp_only_layers`` / ``decoder_sparse_step`` say (of
             ``intermediate_size``; experts of ``moe_intermediate_size``)
  Qwen3-MoE  Qwen2-MoE's layer choice and widths, no shared expert, no biases, RMSNorm of q and k over each head,
             any ``head_dim``
  OLMoE      every layer sparse; RMSNorm of q and k over the whole projection; ``norm_topk_prob``; no ``clip_qkv``

The router loss coefficients are training settings and stay at zoo's 0 on import (HF adds its own loss only with
``output_router_logits``, pooled over layers and k times zoo's per-layer one); Mixtral's ``router_jitter_noise``
must be 0. zoo's ``capacity_factor`` (token dropping, a training setting) has no HF field: transformers runs
dropless. Notation: h hidden, E experts, I expert width, I_s shared-expert width, d head dim.
"""

from __future__ import annotations

import re

import torch

from zoo.convert.hf_gpt import MOE as SUPPORTED
from zoo.convert.hf_gpt import ConvertError, Row, _rope, _rope_parameters, gpt_config, llama_table, same
from zoo.models.gpt import GPTConfig

FUSED, PER_EXPERT = "fused", "per-expert"
EXPERT_COUNT_FIELD = {"MixtralForCausalLM": "num_local_experts"}  # the others: num_experts
FUSED_KEY = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")
PER_EXPERT_KEY = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.")


# ---------------------------------------------------------------------------------------------------------------
# Transforms
# ---------------------------------------------------------------------------------------------------------------


def stack_gate_up(*ws):
    """[gate_0, up_0, gate_1, up_1, ...] (each [I, h]) -> zoo's [E, 2I, h], rows [gate; up] per expert."""
    return torch.stack([torch.cat(ws[j:j + 2], dim=0) for j in range(0, len(ws), 2)])


def unstack_gate_up(w):
    return tuple(t for expert in w for t in expert.chunk(2, dim=0))


def stack(*ws):
    """[down_0, down_1, ...] (each [h, I]) -> [E, h, I]."""
    return torch.stack(ws)


def unstack(w):
    return tuple(w.unbind(0))


def cat_gate_up(gate, up):
    return torch.cat([gate, up], dim=0)  # the shared expert's SwiGLU fc1 is [gate; up], as zoo's dense MLP


def split_gate_up(w):
    return tuple(w.chunk(2, dim=0))


# ---------------------------------------------------------------------------------------------------------------
# Key tables
# ---------------------------------------------------------------------------------------------------------------


def moe_rows(cfg: GPTConfig, arch: str, layout: str) -> list[Row]:
    """The rows of one sparse block (``{}`` the block index), in ``layout``."""
    h, E, I, Is = cfg.hidden_size, cfg.num_experts, cfg.expert_intermediate_size, cfg.shared_intermediate_size
    mixtral = arch == "MixtralForCausalLM"
    moe = "model.layers.{}." + ("block_sparse_moe." if mixtral and layout == PER_EXPERT else "mlp.")
    rows = [Row("{}.mlp.router.weight", (moe + "gate.weight",), ((E, h),), same, same)]
    if layout == FUSED:
        rows += [Row("{}.mlp.experts.gate_up_proj", (moe + "experts.gate_up_proj",), ((E, 2 * I, h),), same, same),
                 Row("{}.mlp.experts.down_proj", (moe + "experts.down_proj",), ((E, h, I),), same, same)]
    else:
        gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        gate_up = tuple(moe + f"experts.{j}.{name}.weight" for j in range(E) for name in (gate, up))
        rows += [Row("{}.mlp.experts.gate_up_proj", gate_up, ((I, h),) * (2 * E), stack_gate_up, unstack_gate_up),
                 Row("{}.mlp.experts.down_proj", tuple(moe + f"experts.{j}.{down}.weight" for j in range(E)),
                     ((h, I),) * E, stack, unstack)]
    if cfg.num_shared_experts:  # Qwen2-MoE
        shared = moe + "shared_expert."
        rows += [Row("{}.mlp.shared_expert.gate_up_proj", (shared + "gate_proj.weight", shared + "up_proj.weight"),
                     ((Is, h), (Is, h)), cat_gate_up, split_gate_up),
                 Row("{}.mlp.shared_expert.down_proj", (shared + "down_proj.weight",), ((h, Is),), same, same)]
    if cfg.shared_expert_gate:
        rows.append(Row("{}.mlp.shared_expert_gate.weight", (moe + "shared_expert_gate.weight",), ((1, h),), same,
                        same))
    return rows


def qk_norm_rows(cfg: GPTConfig) -> list[Row]:
    """Qwen3-MoE normalizes q and k per head ([d]); OLMoE over the whole projection ([nq d], [nkv d])."""
    if cfg.qk_norm is None:
        return []
    d = cfg.head_dim
    q, k = (d, d) if cfg.qk_norm == "head" else (cfg.num_attention_heads * d, cfg.num_key_value_heads * d)
    attn = "model.layers.{}.self_attn."
    return [Row("{}.attention.q_norm.weight", (attn + "q_norm.weight",), ((q,),), same, same),
            Row("{}.attention.k_norm.weight", (attn + "k_norm.weight",), ((k,),), same, same)]


def moe_blocks(cfg: GPTConfig, arch: str, layout: str = PER_EXPERT) -> list[list[Row]]:
    """The table in conversion groups, ``{}`` filled in: the embedding, then one group per block (attention, norms,
    and the block's MLP: the MoE rows where ``cfg.is_moe_layer(i)``, else Llama's dense rows), then the final norm
    and the head. Each group is converted at once, so memory holds one block (one layer's experts)."""
    dense = llama_table(cfg)
    per_block = [r for r in dense if "{}" in r.zoo]
    first = dense.index(per_block[0])
    common = [r for r in per_block if ".mlp." not in r.zoo] + qk_norm_rows(cfg)
    mlp = [r for r in per_block if ".mlp." in r.zoo]
    sparse = moe_rows(cfg, arch, layout)
    groups = [dense[:first]]
    for i in range(cfg.num_hidden_layers):
        groups.append([r.at(i) for r in common + (sparse if cfg.is_moe_layer(i) else mlp)])
    groups.append([r for r in dense[first:] if "{}" not in r.zoo])
    return groups


def moe_table(cfg: GPTConfig, arch: str, layout: str = PER_EXPERT) -> list[Row]:
    """Every row of :func:`moe_blocks`, in one list."""
    return [r for group in moe_blocks(cfg, arch, layout) for r in group]


def expert_layout(shapes: dict) -> str:
    """Which layout a checkpoint's tensor names are in; per expert when it holds no fused expert tensor."""
    return FUSED if any(FUSED_KEY.search(k) for k in shapes) else PER_EXPERT


def check_experts(groups: list[list[Row]], cfg: GPTConfig, arch: str, layout: str, shapes: dict, where: str) -> None:
    """What the generic shape check would report as one tensor, said in experts: a fused tensor with fewer (or
    more) experts than config.json's count, or a layer lacking some experts' tensors."""
    field = EXPERT_COUNT_FIELD.get(arch, "num_experts")
    E = cfg.num_experts
    for row in (r for g in groups for r in g if ".mlp.experts." in r.zoo):
        if layout == FUSED:
            key = row.hf[0]
            if key in shapes and shapes[key][0] != E:
                raise ConvertError(f"{where}: tensor {key} holds {shapes[key][0]} experts but config.json's {field} "
                                   f"is {E}; the checkpoint lacks experts or config.json is wrong")
            continue
        if not row.zoo.endswith("gate_up_proj"):  # down_proj names the same experts
            continue
        missing = sorted({int(PER_EXPERT_KEY.match(k).group(2)) for k in row.hf if k not in shapes})
        if missing and len(missing) < E:
            layer = int(row.zoo.split(".")[0]) - 1
            raise ConvertError(f"{where}: layer {layer} lacks expert(s) {missing} of {field} {E} (tensor "
                               f"{next(k for k in row.hf if k not in shapes)} is missing); the checkpoint is "
                               f"incomplete")


# ---------------------------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------------------------


def config_classes() -> dict:
    from transformers import MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

    return {"MixtralForCausalLM": MixtralConfig, "Qwen2MoeForCausalLM": Qwen2MoeConfig,
            "Qwen3MoeForCausalLM": Qwen3MoeConfig, "OlmoeForCausalLM": OlmoeConfig}


def gpt_config_from_moe(arch: str, c) -> GPTConfig:
    """The GPTConfig computing what the HF MoE model computes; refuses (one line) what zoo cannot express."""

    def need(ok, msg):
        if not ok:
            raise ConvertError(f"{arch}: {msg}")

    need(c.hidden_act == "silu", f"hidden_act {c.hidden_act!r} is not supported (zoo's SwiGLU experts use silu)")
    need(not getattr(c, "attention_bias", False), "attention_bias=True is not supported (only Qwen2-MoE's q/k/v "
                                                  "biases are)")
    window = getattr(c, "sliding_window", None)
    if arch == "Qwen2MoeForCausalLM":  # only the layers layer_types marks slide
        window = window if "sliding_attention" in (getattr(c, "layer_types", None) or []) else None
    need(window is None or window >= c.max_position_embeddings,
         f"sliding_window {window} < max_position_embeddings {c.max_position_embeddings}: zoo has no sliding-window "
         f"attention")
    E = getattr(c, EXPERT_COUNT_FIELD.get(arch, "num_experts"))
    need(E >= 1, f"{EXPERT_COUNT_FIELD.get(arch, 'num_experts')} {E}: a mixture of experts needs at least one")
    heads = c.num_attention_heads
    theta, scaling = _rope(c)
    fields = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers,
                  num_attention_heads=heads, num_key_value_heads=c.num_key_value_heads or heads,
                  head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
                  intermediate_size=c.intermediate_size, max_position_embeddings=c.max_position_embeddings,
                  position_embedding_type="rope", normalization="rmsnorm", norm_eps=c.rms_norm_eps,
                  activation="swiglu", add_bias=False, tie_word_embeddings=bool(c.tie_word_embeddings),
                  rope_theta=theta, rope_scaling=scaling, initializer_range=c.initializer_range,
                  attention_dropout=float(getattr(c, "attention_dropout", 0.0) or 0.0),
                  num_experts=E, num_experts_per_tok=c.num_experts_per_tok)
    if arch == "MixtralForCausalLM":
        need(not c.router_jitter_noise, f"router_jitter_noise {c.router_jitter_noise} is not supported (zoo's router "
                                        f"has no jitter; it only perturbs training): set it to 0 in config.json")
        return gpt_config({**fields, "norm_topk_prob": True})
    fields.update(norm_topk_prob=bool(c.norm_topk_prob))
    if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        fields.update(moe_intermediate_size=c.moe_intermediate_size, decoder_sparse_step=c.decoder_sparse_step,
                      mlp_only_layers=sorted(c.mlp_only_layers or []))
    if arch == "Qwen2MoeForCausalLM":
        need(c.shared_expert_intermediate_size > 0, "shared_expert_intermediate_size 0 is not supported")
        fields.update(qkv_bias=bool(c.qkv_bias), num_shared_experts=1,
                      shared_expert_intermediate_size=c.shared_expert_intermediate_size, shared_expert_gate=True)
    elif arch == "Qwen3MoeForCausalLM":
        fields.update(qk_norm="head")
    else:  # OLMoE
        need(c.clip_qkv is None, f"clip_qkv {c.clip_qkv} is not supported (zoo does not clamp q, k, v)")
        fields.update(qk_norm="full")
    return gpt_config(fields)


def export_architecture(cfg: GPTConfig) -> str:
    """The HF MoE architecture computing what this zoo MoE GPT computes, or a one-line refusal."""
    common = [(cfg.position_embedding_type == "rope" and cfg.normalization == "rmsnorm" and cfg.activation == "swiglu"
               and not cfg.add_bias, "RoPE, RMSNorm, SwiGLU and no biases"),
              (cfg.scoring_func == "softmax" and cfg.n_group == 1 and not cfg.moe_expert_bias
               and cfg.routed_scaling_factor == 1.0, "softmax routing without groups, bias or scaling (DeepSeek's)")]
    all_sparse = all(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    if cfg.qk_norm == "full":
        arch = "OlmoeForCausalLM"
        rules = [(not cfg.num_shared_experts, "no shared expert"), (not cfg.use_qkv_bias, "no q/k/v bias"),
                 (all_sparse, "every layer sparse")]
    elif cfg.qk_norm == "head":
        arch = "Qwen3MoeForCausalLM"
        rules = [(not cfg.num_shared_experts, "no shared expert"), (not cfg.use_qkv_bias, "no q/k/v bias")]
    elif cfg.num_shared_experts:
        arch = "Qwen2MoeForCausalLM"
        rules = [(cfg.shared_expert_gate, "the shared expert behind its sigmoid gate (shared_expert_gate)")]
    else:
        arch = "MixtralForCausalLM"
        rules = [(not cfg.use_qkv_bias, "no q/k/v bias"), (cfg.norm_topk_prob, "norm_topk_prob"),
                 (all_sparse, "every layer sparse")]
    broken = [what for ok, what in common + rules if not ok]
    if broken:
        raise ConvertError(f"this zoo MoE GPT matches no HF architecture: as {arch} (chosen by qk_norm "
                           f"{cfg.qk_norm} and num_shared_experts {cfg.num_shared_experts}) it needs "
                           f"{'; '.join(broken)}. Supported: {', '.join(SUPPORTED)} (Qwen2-MoE: gated shared expert; "
                           f"Qwen3-MoE: qk_norm head; OLMoE: qk_norm full; Mixtral: none of these)")
    return arch


def hf_config_from_moe(cfg: GPTConfig, arch: str, dtype: torch.dtype, special: dict):
    """The transformers config (``architectures`` set) of :func:`export_architecture`'s class for a zoo MoE GPT."""
    cls = config_classes()[arch]
    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
                  num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                  max_position_embeddings=cfg.max_position_embeddings,
                  rms_norm_eps=cfg.norm_eps, rope_parameters=_rope_parameters(cfg), hidden_act="silu",
                  attention_dropout=cfg.attention_dropout, initializer_range=cfg.initializer_range,
                  tie_word_embeddings=cfg.tie_word_embeddings, num_experts_per_tok=cfg.num_experts_per_tok,
                  architectures=[arch], **{k: special.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")})
    if cfg.head_dim != cfg.hidden_size // cfg.num_attention_heads:  # Qwen3-MoE; the others read it if present
        common["head_dim"] = cfg.head_dim
    # zoo's first_k_dense_replace has no field in Qwen's configs; those layers join mlp_only_layers (the same model).
    dense_layers = sorted(set(cfg.mlp_only_layers) | set(range(min(cfg.first_k_dense_replace, cfg.num_hidden_layers))))
    qwen = dict(intermediate_size=cfg.intermediate_size, moe_intermediate_size=cfg.expert_intermediate_size,
                num_experts=cfg.num_experts, decoder_sparse_step=cfg.decoder_sparse_step, mlp_only_layers=dense_layers,
                norm_topk_prob=cfg.norm_topk_prob, use_sliding_window=False, sliding_window=None)
    if arch == "MixtralForCausalLM":
        c = cls(intermediate_size=cfg.expert_intermediate_size, num_local_experts=cfg.num_experts, sliding_window=None,
                router_jitter_noise=0.0, **common)
    elif arch == "Qwen2MoeForCausalLM":
        c = cls(shared_expert_intermediate_size=cfg.shared_intermediate_size, qkv_bias=cfg.use_qkv_bias, **qwen,
                **common)
    elif arch == "Qwen3MoeForCausalLM":
        c = cls(attention_bias=False, **qwen, **common)
    else:
        c = cls(intermediate_size=cfg.expert_intermediate_size, num_experts=cfg.num_experts,
                norm_topk_prob=cfg.norm_topk_prob, attention_bias=False, clip_qkv=None, **common)
    c.dtype = dtype
    return c

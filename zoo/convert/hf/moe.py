"""What the mixture-of-experts GPTs share: Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE (one file each beside this).

The attention, norm, embedding and dense-MLP rows are Llama's (``llama.table``); this module adds the rows of the
MoE blocks and the q/k norms, and the config mapping both ways that the four share; each architecture's file says
its differences. The GPT family's streaming import / export (one block's tensors at a time, ``zoo.convert.gpt``),
verify and ``launch/train.py --init`` serve them as every other GPT.

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

Sliding windows: Mixtral and Qwen3-MoE slide on every layer (``sliding_window``; Qwen3-MoE only with
``use_sliding_window``), Qwen2-MoE on the layers its ``layer_types`` marks, as the dense Mistral and Qwen2 do
(``llama.window_every_layer``, ``llama.window_by_layer_types``); OLMoE has none.

The router loss coefficients are training settings and stay at zoo's 0 on import (HF adds its own loss only with
``output_router_logits``, pooled over layers and k times zoo's per-layer one); Mixtral's ``router_jitter_noise``
must be 0. zoo's ``capacity_factor`` (token dropping, a training setting) has no HF field: transformers runs
dropless. Notation: h hidden, E experts, I expert width, I_s shared-expert width, d head dim.
"""

from __future__ import annotations

import re
from functools import partial

from zoo.convert.errors import ConvertError
from zoo.convert.hf import llama
from zoo.convert.hf.common import plain_block, refusal, zoo_config
from zoo.convert.registry import ARCHITECTURES, Architecture
from zoo.convert.tables import (
    Row,
    cat_gate_up,
    same,
    split_gate_up,
    stack,
    stack_gate_up,
    unstack,
    unstack_gate_up,
)
from zoo.models.gpt import FAMILY, GPTConfig

FUSED, PER_EXPERT = "fused", "per-expert"
FUSED_KEY = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")
PER_EXPERT_KEY = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.")
EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")  # per-expert keys; Mixtral's are w1, w3, w2


# ---------------------------------------------------------------------------------------------------------------
# Key tables
# ---------------------------------------------------------------------------------------------------------------


def moe_rows(cfg: GPTConfig, layout: str, per_expert_module: str = "mlp.", names=EXPERT_NAMES) -> list[Row]:
    """The rows of one sparse block (``{}`` the block index), in ``layout``. ``per_expert_module``, ``names``: where
    the per-expert layout keeps the experts and what it calls their projections (Mixtral's differ)."""
    h, E, I, Is = cfg.hidden_size, cfg.num_experts, cfg.expert_intermediate_size, cfg.shared_intermediate_size
    moe = "model.layers.{}." + (per_expert_module if layout == PER_EXPERT else "mlp.")
    rows = [Row("{}.mlp.router.weight", (moe + "gate.weight",), ((E, h),), same, same)]
    if layout == FUSED:
        rows += [Row("{}.mlp.experts.gate_up_proj", (moe + "experts.gate_up_proj",), ((E, 2 * I, h),), same, same),
                 Row("{}.mlp.experts.down_proj", (moe + "experts.down_proj",), ((E, h, I),), same, same)]
    else:
        gate, up, down = names
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
    return [Row("{}.attention.q_norm.weight", (llama.ATTN + "q_norm.weight",), ((q,),), same, same),
            Row("{}.attention.k_norm.weight", (llama.ATTN + "k_norm.weight",), ((k,),), same, same)]


def moe_blocks(cfg: GPTConfig, layout: str = PER_EXPERT, per_expert_module: str = "mlp.", names=EXPERT_NAMES) \
        -> list[list[Row]]:
    """The table in conversion groups, ``{}`` filled in: the embedding, then one group per block (attention, norms,
    and the block's MLP: the MoE rows where ``cfg.is_moe_layer(i)``, else Llama's dense rows), then the final norm
    and the head. Each group is converted at once, so memory holds one block (one layer's experts)."""
    dense = llama.table(cfg)
    per_block = [r for r in dense if "{}" in r.zoo]
    first = dense.index(per_block[0])
    common = [r for r in per_block if ".mlp." not in r.zoo] + qk_norm_rows(cfg)
    mlp = [r for r in per_block if ".mlp." in r.zoo]
    sparse = moe_rows(cfg, layout, per_expert_module, names)
    groups = [dense[:first]]
    for i in range(cfg.num_hidden_layers):
        groups.append([r.at(i) for r in common + (sparse if cfg.is_moe_layer(i) else mlp)])
    groups.append([r for r in dense[first:] if "{}" not in r.zoo])
    return groups


def groups(cfg: GPTConfig, layout: str = PER_EXPERT, **_) -> list[list[Row]]:
    return moe_blocks(cfg, layout)


def moe_table(cfg: GPTConfig, arch: str, layout: str = PER_EXPERT) -> list[Row]:
    """Every row of the MoE architecture ``arch`` in ``layout``, in one list."""
    return ARCHITECTURES[arch].rows(cfg, layout=layout)


def expert_layout(shapes: dict) -> str:
    """Which layout a checkpoint's tensor names are in; per expert when it holds no fused expert tensor."""
    return FUSED if any(FUSED_KEY.search(k) for k in shapes) else PER_EXPERT


def read_options(shapes: dict) -> dict:
    return {"layout": expert_layout(shapes)}


def check_experts(groups: list[list[Row]], cfg: GPTConfig, options: dict, shapes: dict, where: str, *,
                  field: str = "num_experts") -> None:
    """What the generic shape check would report as one tensor, said in experts: a fused tensor with fewer (or
    more) experts than config.json's count (its ``field``), or a layer lacking some experts' tensors."""
    layout, E = options.get("layout", PER_EXPERT), cfg.num_experts
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


def base_fields(arch: str, c, *, count_field: str = "num_experts", windows=None) -> dict:
    """The GPTConfig fields every MoE class fixes the same way, after the refusals they share (one line each).
    ``windows(c)``: the class's sliding-window fields (``llama.window_every_layer`` for Mixtral and Qwen3-MoE,
    ``qwen2_moe`` its own by ``layer_types``); None (OLMoE): a window shorter than the context is refused."""
    need = refusal(arch)
    need(c.hidden_act == "silu", f"hidden_act {c.hidden_act!r} is not supported (zoo's SwiGLU experts use silu)")
    need(not getattr(c, "attention_bias", False), "attention_bias=True is not supported (only Qwen2-MoE's q/k/v "
                                                  "biases are)")
    if windows is None:
        llama.refuse_window(need, c, getattr(c, "sliding_window", None))
    E = getattr(c, count_field)
    need(E >= 1, f"{count_field} {E}: a mixture of experts needs at least one")
    heads = c.num_attention_heads
    need(llama.partial_rotary_factor(c) == 1.0,
         f"partial_rotary_factor {llama.partial_rotary_factor(c)} is not supported ({arch} rotates whole heads)")
    theta, scaling = llama.rope(c)
    return dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers,
                num_attention_heads=heads, num_key_value_heads=c.num_key_value_heads or heads,
                head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
                intermediate_size=c.intermediate_size, max_position_embeddings=c.max_position_embeddings,
                position_embedding_type="rope", normalization="rmsnorm", norm_eps=c.rms_norm_eps,
                activation="swiglu", add_bias=False, tie_word_embeddings=bool(c.tie_word_embeddings),
                rope_theta=theta, rope_scaling=scaling, initializer_range=c.initializer_range,
                attention_dropout=float(getattr(c, "attention_dropout", 0.0) or 0.0),
                num_experts=E, num_experts_per_tok=c.num_experts_per_tok, **(windows(c) if windows else {}))


def qwen_fields(c) -> dict:
    """Qwen2-MoE's and Qwen3-MoE's layer choice and widths."""
    return dict(norm_topk_prob=bool(c.norm_topk_prob), moe_intermediate_size=c.moe_intermediate_size,
                decoder_sparse_step=c.decoder_sparse_step, mlp_only_layers=sorted(c.mlp_only_layers or []))


def gpt_config(fields: dict) -> GPTConfig:
    return zoo_config(GPTConfig, fields)


def hf_fields(cfg: GPTConfig, arch: str, special: dict) -> dict:
    """The transformers config fields every MoE class shares, for a zoo MoE GPT."""
    out = {**llama.common_hf_fields(cfg, arch, special), "num_experts_per_tok": cfg.num_experts_per_tok}
    if cfg.head_dim != cfg.hidden_size // cfg.num_attention_heads:  # Qwen3-MoE; the others read it if present
        out["head_dim"] = cfg.head_dim
    return out


def qwen_hf_fields(cfg: GPTConfig) -> dict:
    """Qwen2-MoE's and Qwen3-MoE's fields. zoo's first_k_dense_replace has no field in Qwen's configs; those layers
    join mlp_only_layers (the same model)."""
    dense = sorted(set(cfg.mlp_only_layers) | set(range(min(cfg.first_k_dense_replace, cfg.num_hidden_layers))))
    return dict(intermediate_size=cfg.intermediate_size, moe_intermediate_size=cfg.expert_intermediate_size,
                num_experts=cfg.num_experts, decoder_sparse_step=cfg.decoder_sparse_step, mlp_only_layers=dense,
                norm_topk_prob=cfg.norm_topk_prob, use_sliding_window=not llama.is_windowless(cfg),
                sliding_window=None if llama.is_windowless(cfg) else cfg.sliding_window)


def one_window(cfg: GPTConfig) -> bool:
    """Mixtral's and Qwen3-MoE's windows: none, or ``sliding_window`` on every layer (their configs have no
    per-layer types)."""
    return llama.is_windowless(cfg) or {cfg.attention_window(i) for i in range(cfg.num_hidden_layers)} == {
        cfg.sliding_window}


def all_sparse(cfg: GPTConfig) -> bool:
    return all(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))


def check_export(arch: str, rules, cfg: GPTConfig) -> None:
    """Refuses in one line a zoo MoE GPT that ``arch`` (chosen by its qk_norm and shared experts) cannot hold:
    ``rules(cfg)`` -> [(ok, what the class needs)], besides what every MoE class needs."""
    common = [(cfg.position_embedding_type == "rope" and cfg.normalization == "rmsnorm" and cfg.activation == "swiglu"
               and not cfg.add_bias, "RoPE, RMSNorm, SwiGLU and no biases"),
              (plain_block(cfg), "pre-norm sequential blocks without multipliers (no OLMo 2 / NeoX / Granite block)"),
              (llama.full_rope(cfg), "whole-head RoPE on every layer with one theta"),
              (cfg.scoring_func == "softmax" and cfg.n_group == 1 and not cfg.moe_expert_bias
               and cfg.routed_scaling_factor == 1.0, "softmax routing without groups, bias or scaling (DeepSeek's)")]
    broken = [what for ok, what in common + rules(cfg) if not ok]
    if broken:
        supported = [name for name, a in ARCHITECTURES.items() if a.extra.get("moe")]
        raise ConvertError(f"this zoo MoE GPT matches no HF architecture: as {arch} (chosen by qk_norm "
                           f"{cfg.qk_norm} and num_shared_experts {cfg.num_shared_experts}) it needs "
                           f"{'; '.join(broken)}. Supported: {', '.join(supported)} (Qwen2-MoE: gated shared expert; "
                           f"Qwen3-MoE: qk_norm head; OLMoE: qk_norm full; Mixtral: none of these)")


def architecture(name: str, config_class, to_zoo, to_hf, model_type: str, exports, rules, *,
                 count_field: str = "num_experts", groups=groups) -> dict:
    """``ARCHITECTURES`` of one MoE class: the shared table, layouts and checks with its own pieces."""
    return {name: Architecture(
        name, FAMILY, config_class, to_zoo, groups, to_hf, model_type=model_type, exports=exports,
        check_export=partial(check_export, name, rules), read_options=read_options,
        check_checkpoint=partial(check_experts, field=count_field), extra={"moe": True})}

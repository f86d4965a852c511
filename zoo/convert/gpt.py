"""HuggingFace <-> zoo for the GPT family: the streamed import and export, and verify by logits.

Which HF classes the family reads and writes, with their key tables and config mappings, is the registry's
(``zoo.convert.registry.ARCHITECTURES``, one file each in ``zoo/convert/hf/``: GPT-2, Llama, Mistral, Qwen2 and the
mixture-of-experts Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE); this module runs them. Both directions stream: one
block's tensors are read (each safetensors file mapped only while they are read), transformed and handed to
``io.ShardedWriter``, which writes each tensor to disk as it comes, so memory stays near one block (the largest
being the embedding). The tables are checked against transformers' logits (tests/convert/test_hf_gpt.py,
tests/models/test_gpt_vs_transformers.py).

Verify: every rank builds its part of the zoo model at (tp, pp, ep) and runs a fixed, seeded batch of token ids;
the last stage gathers the vocab-sharded logits over TP and cuts the padding, and global rank 0 compares them with
transformers' (``zoo.convert.verify`` drives it). Mixture-of-experts GPTs (``ep`` > 1 splits each MoE layer's
experts over expert-parallel groups of data-parallel ranks) are also compared by their routing: forward hooks record
the experts each token chose, at every zoo router (``MoERouter``'s ``Routing.indices``, gathered over the TP ranks
that split the tokens) and at every HF gate (the router indices transformers' top-k router returns);
``router_topk_agreement`` is the fraction of the k choices per token and MoE layer that both made (1.0: the same
experts everywhere). With a memory cap the zoo side streams (``verify.streamed_forward``) and so does the HF side.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import torch

from zoo.convert import io, verify
from zoo.convert.errors import ConvertError
from zoo.convert.hub import read_hf_meta, refuse_pickle_only, resolve_hf_folder  # noqa: F401  (public here)
from zoo.convert.reader import (
    HFCheckpoint,
    check_shapes,
    check_zoo_rows,
    read_zoo_config,
    streamed_groups,
    zoo_weights,
)
from zoo.convert.registry import ARCHITECTURES, Architecture, hf_architecture, of_family
from zoo.convert.writer import (
    GENERATION_CONFIG,
    export_rows,
    finish,
    generation_config_of,
    special_ids,
    write_generation_config,
)
from zoo.models.gpt import FAMILY, GPTConfig, GPTLoss, ParallelOptions, layer_specs, softcap_logits
from zoo.parallel.shards import gather_objects
from zoo.parallel.topology import initialize_model_parallel

# Buffers some checkpoints carry that are not weights: GPT-2's causal mask, Llama's RoPE frequencies.
IGNORED = re.compile(r"(\.attn\.(masked_)?bias|\.rotary_emb\.inv_freq)$")

MODEL_CARD = """---
library_name: transformers
pipeline_tag: text-generation
---

# {name}

A {arch} ({params:,} parameters, {dtype}) exported from the zoo model folder `{src}` by
`launch/convert.py zoo-to-hf`. The weights are zoo's, unchanged except for layout (fused QKV and SwiGLU
projections split, HF's naming); no tokenizer or training details are added here beyond the files passed through.

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("{name}")
tokenizer = AutoTokenizer.from_pretrained("{name}")  # if tokenizer files were present in the zoo folder
```

Check it against the zoo folder with `launch/convert.py verify --hf {name} --zoo {src}`.
"""


# ---------------------------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------------------------


def supported() -> list[str]:
    """The HF classes this family reads, in registration order."""
    return [a.name for a in of_family(FAMILY)]


def architecture_of(meta: dict, where: str) -> Architecture:
    """The registered GPT architecture a config.json names (``architectures[0]``, else its ``model_type``)."""
    from zoo.convert.hub import class_name
    from zoo.convert.registry import model_types

    name = class_name(meta, model_types()) or "unknown"
    arch = ARCHITECTURES.get(name)
    if arch is None or arch.family != FAMILY:
        raise ConvertError(f"{where}: architecture {name} is not supported; supported: {', '.join(supported())}")
    return arch


def read_hf_config(folder: Path):
    """``(architecture name, transformers config object)`` of a HF model folder (no remote code is ever run)."""
    meta = read_hf_meta(folder)
    arch = architecture_of(meta, str(folder / "config.json"))
    return arch.name, arch.config_class().from_dict(meta)


def gpt_config_from_hf(arch: str, c) -> GPTConfig:
    """The GPTConfig computing what the HF model computes; refuses (one line) what zoo's GPT cannot express."""
    return ARCHITECTURES[arch].to_zoo(c)


def export_architecture(cfg: GPTConfig) -> Architecture:
    """The HF architecture computing what this zoo GPT computes (windowless Mistral imports come back as Llama), or a
    one-line refusal naming what each class would need."""
    for arch in of_family(FAMILY):
        if arch.exports is not None and arch.exports(cfg):
            if arch.check_export is not None:
                arch.check_export(cfg)
            return arch
    needs = [a.export_needs for a in of_family(FAMILY) if a.export_needs]
    raise ConvertError(f"this zoo GPT (position {cfg.position_embedding_type}, {cfg.normalization}, {cfg.activation}, "
                       f"add_bias={cfg.add_bias}, qkv_bias={cfg.use_qkv_bias}, qk_norm={cfg.qk_norm}, "
                       f"sliding_window={cfg.sliding_window}, layer_types={cfg.layer_types}) matches no HF "
                       f"architecture: {'; '.join(needs)}")


def read_zoo_gpt(folder, refusal: str) -> GPTConfig:
    """The GPTConfig of the zoo model folder ``folder``; a folder of another family is refused in one line,
    ``"<folder> holds a <family> model; <refusal>"``."""
    family, meta = read_zoo_config(folder)
    if family != FAMILY:
        raise ConvertError(f"{folder} holds a {family!r} model; {refusal}")
    meta = {k: v for k, v in meta.items() if k != "lora"}  # adapter settings, where a writer kept them inside
    try:
        return GPTConfig.from_dict(meta)
    except (TypeError, ValueError) as e:
        raise ConvertError(str(e)) from None


# ---------------------------------------------------------------------------------------------------------------
# The two conversions
# ---------------------------------------------------------------------------------------------------------------


def hf_to_zoo(src, out, *, dtype: torch.dtype | None = None, allow_pickle: bool = False,
              max_shard_bytes: int = io.DEFAULT_SHARD_BYTES, cache_dir=None) -> Path:
    """Write the HF model ``src`` (folder or Hub id) as a zoo model folder ``out`` (family gpt), streaming.

    Everything is checked (architecture, config, every tensor's presence and shape, no unused tensor) before a
    byte is written. ``dtype`` None keeps the checkpoint's dtypes.
    """
    folder = resolve_hf_folder(src, allow_pickle=allow_pickle, cache_dir=cache_dir)
    name, hf_cfg = read_hf_config(folder)
    arch = ARCHITECTURES[name]
    cfg = arch.to_zoo(hf_cfg)
    ckpt = HFCheckpoint(folder, allow_pickle)
    options = arch.read_options(ckpt.shapes)  # e.g. an MoE checkpoint's expert layout (either: hf/moe.py)
    groups = arch.groups(cfg, **options)
    if arch.check_checkpoint is not None:
        arch.check_checkpoint(groups, cfg, options, ckpt.shapes, str(folder))
    rows = [r for g in groups for r in g]
    check_shapes(rows, ckpt.shapes, str(folder))
    used = {k for r in rows for k in r.hf}
    if cfg.tie_word_embeddings:
        used.add("lm_head.weight")  # some checkpoints store the tied head too: it is the embedding
    unused = sorted(k for k in set(ckpt.shapes) - used if not IGNORED.search(k))
    if unused:
        raise ConvertError(f"{folder}: {len(unused)} tensor(s) the {name} table does not use, e.g. {unused[:3]}; "
                           f"the model has a feature zoo does not convert")
    return io.write_model_folder(out, FAMILY, cfg.to_dict(), streamed_groups(ckpt, groups, dtype),
                                 tokenizer_dir=folder, max_shard_bytes=max_shard_bytes,
                                 extra_files={GENERATION_CONFIG: generation_config_of(folder, hf_cfg)})


def zoo_to_hf(src, out, *, dtype: torch.dtype | None = None, max_shard_bytes: int = io.DEFAULT_SHARD_BYTES,
              fused_experts: bool = False) -> Path:
    """Write the zoo model folder ``src`` as a HF model folder ``out``: safetensors (one file or sharded with an
    index), config.json, generation_config.json, tokenizer files, README.md. Streams one block at a time.

    Mixture-of-experts models are written one tensor per expert (``save_pretrained``'s default), or with
    ``fused_experts`` as transformers 5 holds them (``save_pretrained(save_original_format=False)``)."""
    from zoo.convert.hf.moe import FUSED, PER_EXPERT

    src = Path(src)
    cfg = read_zoo_gpt(src, "this converter exports the gpt family")
    if fused_experts and not cfg.num_experts:
        raise ConvertError(f"{src} holds a dense GPT (num_experts 0); fused experts are for mixture-of-experts "
                           f"models: leave out --fused-experts")
    arch = export_architecture(cfg)
    groups = arch.groups(cfg, layout=FUSED if fused_experts else PER_EXPERT)
    files, shapes = zoo_weights(src)
    check_zoo_rows(groups, shapes, src)
    final = Path(out)
    staging, out_dtype = export_rows(src, final, groups, files, dtype, max_shard_bytes=max_shard_bytes)
    hf_cfg = arch.to_hf(cfg, out_dtype, special_ids(src))
    write_generation_config(src, staging, hf_cfg)
    card = MODEL_CARD.format(name=final.name, arch=arch.name, params=cfg.num_parameters(),
                             dtype=str(out_dtype).replace("torch.", ""), src=src)
    return finish(src, staging, final, hf_cfg, card)


# ---------------------------------------------------------------------------------------------------------------
# verify: next-token logits on token ids
# ---------------------------------------------------------------------------------------------------------------

# Fields that make two GPTs different models (others, e.g. eps or RoPE settings, show up as a logit difference).
STRUCTURE = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "intermediate_size", "position_embedding_type", "normalization", "activation", "add_bias",
             "tie_word_embeddings", "head_dim", "qk_norm", "num_experts", "num_experts_per_tok",
             "expert_intermediate_size", "shared_intermediate_size", "shared_expert_gate", "use_mlp_bias",
             "norm_placement", "use_parallel_residual")


def _either(values: list[int]) -> str:
    values = [str(v) for v in values]
    return values[0] if len(values) == 1 else f"{', '.join(values[:-1])} or {values[-1]}"


def layout_problem(cfg: GPTConfig, tp: int, pp: int, ep: int = 1) -> str | None:
    """One line saying why (tp, pp, ep) cannot hold this model and which values can, or None."""
    if tp < 1 or pp < 1 or ep < 1:
        return f"tp, pp and ep must be positive, got tp {tp} pp {pp} ep {ep}"
    if ep > 1 and not cfg.num_experts:
        return f"ep {ep} needs a mixture-of-experts model; this one is dense (num_experts 0): use ep 1"
    if cfg.num_experts % ep:
        ok = [e for e in range(1, cfg.num_experts + 1) if cfg.num_experts % e == 0]
        return f"num_experts {cfg.num_experts} is not divisible by ep {ep}; use an ep that divides it: {_either(ok)}"
    split = {"num_attention_heads": cfg.num_attention_heads}
    if cfg.has_dense_mlp():  # experts are never split over TP; dense MLPs are
        split["intermediate_size"] = cfg.intermediate_size
    nkv = cfg.num_key_value_heads

    def kv_ok(t):  # tp divides the kv heads, or is a multiple of them (each kv head replicated over tp / nkv ranks)
        return (nkv % t == 0 or t % nkv == 0) and (t <= nkv or cfg.qk_norm != "full")

    bad = [(name, n) for name, n in split.items() if n % tp]
    if bad or not kv_ok(tp):
        ok = [t for t in range(1, cfg.num_attention_heads + 1) if all(n % t == 0 for n in split.values()) and kv_ok(t)]
        named = [f"{k} {v}" for k, v in split.items()]
        rule = (f"tp must divide {', '.join(named[:-1])} and {named[-1]}" if len(named) > 1 else
                f"tp must divide {named[0]}") + f", and divide or be a multiple of num_key_value_heads {nkv}"
        if cfg.qk_norm == "full":
            rule += " (at most it: qk_norm 'full')"
        what = f"{bad[0][0]} {bad[0][1]}" if bad else f"num_key_value_heads {nkv} (nor is a multiple of it)"
        if not bad and tp > nkv and tp % nkv == 0:
            what = f"num_key_value_heads {nkv} (qk_norm 'full' needs tp <= kv heads)"
        return f"tp {tp} does not divide {what}; {rule}: use {_either(ok)}"
    if pp > cfg.num_hidden_layers:
        return (f"pp {pp} exceeds num_hidden_layers {cfg.num_hidden_layers}; every pipeline stage needs a block: "
                f"use pp <= {cfg.num_hidden_layers}")
    return None


def check_zoo(zoo, tp: int, pp: int, ep: int = 1) -> GPTConfig:
    """The zoo folder's config, and whether (tp, pp, ep) can hold it; checked on every rank before any process
    group."""
    cfg = read_zoo_gpt(zoo, f"this verifier compares {FAMILY} models")
    problem = layout_problem(cfg, tp, pp, ep)
    if problem:
        raise ConvertError(problem)
    return cfg


def check_hf(hf, cfg: GPTConfig, *, allow_pickle: bool = False):
    """The HF folder (resolved), checked to be a supported model of the same structure as ``cfg``."""
    folder = resolve_hf_folder(hf, allow_pickle=allow_pickle)
    other = hf_architecture(folder)
    if other is not None and other.family != FAMILY:
        raise ConvertError(f"{hf} is a {other.name}, a checkpoint of another family ({other.family}) than the zoo "
                           f"folder's ({FAMILY})")
    arch, hf_cfg = read_hf_config(folder)
    HFCheckpoint(folder, allow_pickle)  # refuses a pickle checkpoint without allow_pickle
    theirs = gpt_config_from_hf(arch, hf_cfg)
    for name in STRUCTURE:
        if getattr(theirs, name) != getattr(cfg, name):
            raise ConvertError(f"{hf} and the zoo folder are different models: {name} {getattr(theirs, name)} vs "
                               f"{getattr(cfg, name)}")
    sparse = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    if sparse != [i for i in range(cfg.num_hidden_layers) if theirs.is_moe_layer(i)]:
        raise ConvertError(f"{hf} and the zoo folder are different models: the zoo folder's MoE layers are {sparse}")
    return folder


def token_ids(cfg: GPTConfig, batch: int = 2, seq: int = 16, seed: int = 0) -> torch.Tensor:
    """The fixed batch ``[batch, seq]``: seeded, within the vocabulary and the position table."""
    seq = min(seq, cfg.max_position_embeddings)
    return torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


def record_zoo_routing(module, num_tokens: int, chosen: dict | None = None) -> tuple[dict, list]:
    """Forward hooks on every ``MoERouter`` of ``module`` (this stage's blocks): ``{block: [T_local, k]
    chosen experts}`` of the next forward (into ``chosen`` when given), and the hook handles. ``num_tokens`` (b x s)
    tells whether a call saw all tokens (T_local == b s) or this TP rank's share of them."""
    from zoo.models.moe import MoERouter

    chosen, handles = {} if chosen is None else chosen, []
    for name, sub in module.named_modules():
        if isinstance(sub, MoERouter):
            block = int(name.split(".")[0]) - 1  # zoo's layer i + 1 is HF's block i (layer 0 is the embedding)

            def hook(_, inputs, routing, block=block):
                chosen[block] = (routing.indices.shape[0] == num_tokens, routing.indices.detach().cpu())

            handles.append(sub.register_forward_hook(hook))
    return chosen, handles


def merge_zoo_routing(parts: list) -> dict:
    """``{block: [b s, k]}`` from every rank's ``(tp_rank, recorded)`` (None from ranks of other replicas): each
    block's TP shares concatenated in TP rank order (every TP rank holds them all when a call was not split)."""
    merged: dict = {}
    for tp_rank, chosen in (p for p in parts if p is not None):
        for block, (whole, indices) in chosen.items():
            merged.setdefault(block, []).append((tp_rank, whole, indices))
    out = {}
    for block, shares in merged.items():
        shares.sort(key=lambda s: s[0])
        out[block] = shares[0][2] if shares[0][1] else torch.cat([s[2] for s in shares])
    return out


def zoo_logits(zoo, cfg: GPTConfig, tp: int, pp: int, ids: torch.Tensor, ep: int = 1, routing: dict | None = None,
               stream: bool = False, ep_spans_tp: bool = False) -> torch.Tensor | None:
    """``[b, s, vocab_size]`` fp32 logits of the zoo folder at (tp, pp, ep) on global rank 0; None elsewhere.
    With ``routing`` (a dict), rank 0 also fills it with every MoE block's chosen experts ``[b s, k]``. ``stream``
    (pp 1): one layer in memory at a time (:func:`streamed_forward`)."""
    from deepspeed.accelerator import get_accelerator

    from zoo.models.specs import SpecSequential, build_pipeline
    from zoo.parallel.mappings import gather_from_tensor_model_parallel_region
    from zoo.parallel.pipe_forward import pipeline_forward

    device = get_accelerator().current_device_name()
    grid = initialize_model_parallel(tp, pp, ep, ep_spans_tp=ep_spans_tp)
    ep_group = grid.ep_group if ep > 1 else None
    specs = layer_specs(cfg, ParallelOptions(tp_group=grid.tp_group, ep_group=ep_group, ep_spans_tp=grid.ep_spans_tp))
    chosen = {}

    def record(module):  # hooks on the MoE routers of what runs next
        return record_zoo_routing(module, ids.numel(), chosen)[1] if cfg.num_experts else []

    if stream:  # the vocabulary-sized embedding and LM head never whole in memory either
        present, renumbered = torch.unique(ids, return_inverse=True)
        small = layer_specs(replace(cfg, vocab_size=len(present)), ParallelOptions(tp_group=grid.tp_group))
        out = verify.streamed_embedding(zoo, small, present, renumbered.to(device), grid.tp_group, device)
        out = verify.streamed_forward(specs, zoo, out, grid.tp_group, ep_group, device, on_layer=record,
                                      layers=range(1, len(specs) - 1))
        out = verify.streamed_vocab_linear(specs, len(specs) - 1, zoo, out, grid.tp_group, device)
        out = softcap_logits(out, cfg)  # what the head does after its GEMM: logits_scaling, the final soft-cap
    else:
        module = build_pipeline(specs, grid, loss_fn=GPTLoss(cfg, grid.tp_group)) if pp > 1 else SpecSequential(specs)
        io.load_model(zoo, module, grid.tp_group, ep_group)  # this rank's slices, this EP rank's experts
        module.to(device).eval()
        handles = record(module)
        with torch.no_grad():
            out = pipeline_forward(module, ids.to(device), grid, device)  # [b, s, V_padded / tp] on the last stage
        for handle in handles:
            handle.remove()
    if out is not None:
        with torch.no_grad():
            out = gather_from_tensor_model_parallel_region(out, grid.tp_group)[..., : cfg.vocab_size].float()
    if cfg.num_experts:  # every replica saw the same batch: the first one's choices
        parts = gather_objects((grid.tp_rank, chosen) if grid.dp_rank == 0 and getattr(grid, "cp_rank", 0) == 0
                               else None)
        if routing is not None and grid.rank == 0:
            routing.update(merge_zoo_routing(parts))
    return verify.to_rank0(out, grid, device)


def hf_logits(folder, ids: torch.Tensor, *, allow_pickle: bool = False, routing: dict | None = None,
              max_memory: int | None = None, device_map: dict | None = None) -> torch.Tensor:
    """transformers' fp32 logits; with ``routing`` (a dict) also every MoE block's chosen experts ``[b s, k]``, the
    indices its gate (``model.layers[i].mlp.gate``) returns. ``max_memory``, ``device_map``: see
    ``verify.run_hf``."""
    from transformers import AutoModelForCausalLM

    return verify.run_hf(AutoModelForCausalLM, folder, lambda model: _causal_lm_logits(model, ids, routing),
                         allow_pickle=allow_pickle, max_memory=max_memory, device_map=device_map)


def _causal_lm_logits(model, ids: torch.Tensor, routing: dict | None) -> torch.Tensor:
    handles = []
    if routing is not None:
        for i, layer in enumerate(model.model.layers):
            if hasattr(layer.mlp, "experts"):  # a sparse block (Qwen's dense ones are plain MLPs)

                def hook(_, inputs, out, i=i):
                    routing[i] = out[2].detach().cpu()  # (router logits, top-k weights, top-k indices)

                handles.append(layer.mlp.gate.register_forward_hook(hook))
    with torch.no_grad():
        logits = model(ids).logits.float()
    for handle in handles:
        handle.remove()
    return logits


def topk_agreement(ours: dict, theirs: dict) -> float:
    """The fraction of (MoE block, token, choice) where zoo's chosen expert is among HF's for that token; 0 when
    the two disagree on which blocks are sparse or how many tokens they routed."""
    if not ours or sorted(ours) != sorted(theirs):
        return 0.0
    same = total = 0
    for block, a in ours.items():
        b = theirs[block]
        if a.shape != b.shape:
            return 0.0
        same += int((a[:, :, None] == b[:, None, :]).any(-1).sum())
        total += a.numel()
    return same / total


def verify_gpt(hf, zoo, tp: int = 1, pp: int = 1, *, ep: int = 1, batch: int = 2, seq: int = 16, seed: int = 0,
               allow_pickle: bool = False, max_memory: int | None = None,
               ep_spans_tp: bool = False) -> verify.Verification:
    """max |zoo logits - HF logits| on the fixed batch (:func:`token_ids`), with the router top-k agreement for MoE
    GPTs. Collective, as ``verify.verify``."""
    cfg = check_zoo(zoo, tp, pp, ep)
    # a world size tp x pp (x ep) does not divide is refused here, everywhere
    initialize_model_parallel(tp, pp, ep, ep_spans_tp=ep_spans_tp)
    folder = verify.on_rank0(lambda: check_hf(hf, cfg, allow_pickle=allow_pickle))
    ids = token_ids(cfg, batch, seq, seed)
    moe = cfg.num_experts > 0
    our_routing, their_routing = ({}, {}) if moe else (None, None)
    ours = zoo_logits(zoo, cfg, tp, pp, ids, ep, our_routing, stream=max_memory is not None, ep_spans_tp=ep_spans_tp)

    def theirs(device_map):
        logits = hf_logits(folder, ids, allow_pickle=allow_pickle, routing=their_routing, max_memory=max_memory,
                           device_map=device_map)
        return [logits], topk_agreement(our_routing, their_routing) if moe else None

    return verify.compare_on_rank0([ours] if ours is not None else None, theirs, max_memory)


class GPTConverter:
    """The GPT family in the convert registry: import, export, verify (streams; expert parallel)."""

    name = FAMILY
    streams = True  # verify --max-memory
    expert_parallel = True  # verify --ep, zoo-to-hf --fused-experts

    @staticmethod
    def import_hf(folder, out, *, dtype=None, allow_pickle=False, max_shard_bytes=io.DEFAULT_SHARD_BYTES):
        return hf_to_zoo(folder, out, dtype=dtype, allow_pickle=allow_pickle, max_shard_bytes=max_shard_bytes)

    @staticmethod
    def export(src, out, *, dtype=None, max_shard_bytes=io.DEFAULT_SHARD_BYTES, fused_experts=False):
        return zoo_to_hf(src, out, dtype=dtype, max_shard_bytes=max_shard_bytes, fused_experts=fused_experts)

    verify = staticmethod(verify_gpt)


FAMILIES = {FAMILY: GPTConverter()}  # zoo.convert.registry

"""A zoo model folder computes what its HuggingFace original computes, at any (tp, pp, ep) layout.

    python launch/convert.py verify --hf HF --zoo DIR
    torchrun --nproc_per_node 4 launch/convert.py verify --hf HF --zoo DIR --tp 2 --pp 2
    torchrun --nproc_per_node 4 launch/convert.py verify --hf MOE_HF --zoo DIR --tp 2 --ep 2
    python launch/convert.py verify --hf HF --zoo DIR --max-memory 2GB

Every rank builds its part of the zoo model at (tp, pp), reads its slices of the folder (``io.load_model``) and
runs a fixed, seeded batch; pipeline stages pass activations with ``zoo.parallel.pipe_forward``, the last stage
gathers the vocab-sharded logits over TP and cuts the padding, and global rank 0 compares them with transformers'
outputs on the same inputs (fp32 on both sides). As torchtitan checks its converters: by logits.

With a memory cap (``max_memory``, GPT and BERT at pp 1) neither side holds its whole model: zoo's layers are built,
filled from the folder and run one at a time (:func:`streamed_forward`; tensors larger than 16 MB are read a few
rows per open of the file, ``io.load_model``), and transformers loads through accelerate's big-model path
(``device_map="auto"``, at most ``max_memory`` of weights kept on the CPU, the rest offloaded to disk and brought in
module by module during the forward). Neither side holds a vocabulary-sized matrix either (for a ~100M model the
largest tensor by far: GPT-2's tied 154 MB embedding and head): zoo's embedding (GPT, BERT) is built for the
batch's distinct ids only (:func:`streamed_embedding`), its LM head or tied MLM decoder multiplies by 4 MB of rows
at a time (:func:`streamed_vocab_linear`), and the offloaded HF embedding and head are swapped for modules that
read those rows from the safetensors file (:func:`stream_offloaded_vocab`). The logits are the same as without the
cap.

Mixture-of-experts GPTs (``ep`` > 1 splits each MoE layer's experts over expert-parallel groups of data-parallel
ranks) are also compared by their routing: forward hooks record the experts each token chose, at every zoo router
(``MoERouter``'s ``Routing.indices``, gathered over the TP ranks that split the tokens) and at every HF gate (the
router indices transformers' top-k router returns); ``router_topk_agreement`` is the fraction of the k choices
per token and MoE layer that both made (1.0: the same experts everywhere).

The zoo folder's family picks the comparison. gpt: next-token logits on token ids. bert / bert-classifier: the
batch is ``(input_ids, token_type_ids, attention_mask)`` with two segments and padding at the end of the last row;
compared is what the head outputs: the last hidden state (head None, BertModel), the MLM logits (BertForMaskedLM),
MLM and NSP logits (BertForPreTraining) or the classification logits (BertForSequenceClassification).
unet-diffusion (diffusers' UNet2DModel): the predicted noise on seeded samples ``[b, in_channels, H, W]`` (H, W from
sample_size) and integer timesteps ``[b]``; pipeline stages pass the U-Net's packed ``(flat, shapes)`` boundary
tensors (``zoo.models.unet.UNetPipelineModule``), and only rank 0 imports diffusers.
"""

from __future__ import annotations

import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from zoo.convert import hf_bert, io
from zoo.convert.hf_gpt import (
    ConvertError,
    HFCheckpoint,
    gpt_config_from_hf,
    read_hf_config,
    read_zoo_gpt,
    resolve_hf_folder,
)
from zoo.models.bert import BertConfig
from zoo.models.gpt import GPTConfig, GPTLoss, ParallelOptions, layer_specs
from zoo.parallel.shards import gather_objects, global_rank
from zoo.parallel.topology import group_rank_and_size, initialize_model_parallel

# With a memory cap, vocabulary-sized weights (LM heads, tied decoders) are read this many bytes of rows at a time.
ROW_BLOCK_BYTES = 4 * 1024**2

# Fields that make two GPTs different models (others, e.g. eps or RoPE settings, show up as a logit difference).
STRUCTURE = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "intermediate_size", "position_embedding_type", "normalization", "activation", "add_bias",
             "tie_word_embeddings", "head_dim", "qk_norm", "num_experts", "num_experts_per_tok",
             "expert_intermediate_size", "shared_intermediate_size", "shared_expert_gate")


@dataclass
class Verification:
    """What :func:`verify_report` found: the largest |zoo - HF| output difference, for MoE GPTs the router top-k
    agreement (None for dense models), and with a memory cap the HF side's device map."""

    max_abs_diff: float
    router_topk_agreement: float | None = None
    hf_device_map: dict | None = None  # with a memory cap: where accelerate put the HF modules ("cpu", "disk")


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
    split = {"num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads}
    if cfg.has_dense_mlp():  # experts are never split over TP; dense MLPs are
        split["intermediate_size"] = cfg.intermediate_size
    bad = [(name, n) for name, n in split.items() if n % tp]
    if bad:
        ok = [t for t in range(1, cfg.num_key_value_heads + 1) if all(n % t == 0 for n in split.values())]
        name, n = bad[0]
        named = [f"{k} {v}" for k, v in split.items()]
        return (f"tp {tp} does not divide {name} {n}; tp must divide {', '.join(named[:-1])} and {named[-1]}: "
                f"use {_either(ok)}")
    if pp > cfg.num_hidden_layers:
        return (f"pp {pp} exceeds num_hidden_layers {cfg.num_hidden_layers}; every pipeline stage needs a block: "
                f"use pp <= {cfg.num_hidden_layers}")
    return None


def check_zoo(zoo, tp: int, pp: int, ep: int = 1) -> GPTConfig:
    """The zoo folder's config, and whether (tp, pp, ep) can hold it; checked on every rank before any process
    group."""
    cfg = read_zoo_gpt(zoo, "this verifier compares gpt models")
    problem = layout_problem(cfg, tp, pp, ep)
    if problem:
        raise ConvertError(problem)
    return cfg


def check_hf(hf, cfg: GPTConfig, *, allow_pickle: bool = False):
    """The HF folder (resolved), checked to be a supported model of the same structure as ``cfg``."""
    folder = resolve_hf_folder(hf, allow_pickle=allow_pickle)
    arch = hf_bert.hf_architecture(folder)
    if arch in hf_bert.SUPPORTED:
        raise ConvertError(f"{hf} is a {arch}, a checkpoint of another family (bert) than the zoo folder's (gpt)")
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


def streamed_forward(specs: list, zoo, inputs, tp_group=None, ep_group=None, device="cpu", on_layer=None,
                     layers: range | None = None):
    """The layers of ``specs`` (or those of ``layers``) in one process (pp 1), each built, filled from the zoo
    folder, run and freed before the next is built, so the forward holds one layer's weights at a time
    (``--max-memory``). ``on_layer(layer)`` may return hook handles, removed after the layer ran."""
    from zoo.models.specs import SpecSequential

    for idx in layers if layers is not None else range(len(specs)):
        layer = SpecSequential(specs, only=idx)  # named as in the whole model: load_model finds its tensors
        io.load_model(zoo, layer, tp_group, ep_group)
        layer.to(device).eval()
        handles = on_layer(layer) if on_layer is not None else []
        with torch.no_grad():
            inputs = layer(inputs)
        for handle in handles:
            handle.remove()
        del layer
    return inputs


def _vocab_weight(tensors: dict) -> tuple[str, torch.Tensor]:
    """The vocabulary-sized weight (the one padded past ``vocab_size``) among a layer's tensors."""
    return next((name, t) for name, t in tensors.items() if getattr(t, "unpadded_size", None) is not None)


def streamed_embedding(zoo, small_specs: list, present: torch.Tensor, inputs, tp_group=None, device="cpu"):
    """An embedding layer's output without its ``[vocab, hidden]`` table in memory. ``small_specs``: the model's
    specs for a vocabulary of just the batch's distinct ids ``present`` (ascending; ``torch.unique``); its layer 0
    (the embedding) is built, holds their rows of the folder's table (this TP rank its share of them) and the
    folder's other tensors (position and token-type tables, norm), and runs on ``inputs``, whose ids are renumbered
    into ``present``. The same output as the whole layer on the original ids."""
    from zoo.models.specs import SpecSequential

    layer = SpecSequential(small_specs, only=0)
    tensors = io.model_tensors(layer)
    key, table = _vocab_weight(tensors)
    rows = io.read_rows(zoo, key, present.tolist())
    start = group_rank_and_size(tp_group)[0] * table.shape[0]  # this rank's rows of the small table
    with torch.no_grad():
        table.zero_()
        mine = rows[start:start + table.shape[0]]
        table[:len(mine)] = mine
    io.load_tensors(zoo, {name: t for name, t in tensors.items() if name != key}, tp_group)
    layer.to(device).eval()
    with torch.no_grad():
        return layer(inputs)


def streamed_vocab_linear(specs: list, idx: int, zoo, hidden: torch.Tensor, tp_group=None,
                          device="cpu") -> torch.Tensor:
    """``hidden @ W.T`` for the vocabulary-sized weight W of layer ``idx`` (an LM head or tied decoder; this TP
    rank's ``[V/tp, h]`` share) a block of W's rows at a time, each read from the folder as it is needed
    (:func:`zoo.convert.io.local_row_blocks`): vocab-sharded logits ``[b, s, V/tp]`` without W in memory. As the
    layer itself computes them where its input is TP-replicated (no sequence parallelism, no bias)."""
    from zoo.models.specs import SpecSequential

    with torch.device("meta"):  # for the weight's name, shape and split only
        layer = SpecSequential(specs, only=idx)
    key, weight = _vocab_weight(io.model_tensors(layer))
    with torch.no_grad():
        return torch.cat([F.linear(hidden, block.to(device))
                          for block in io.local_row_blocks(zoo, key, weight, tp_group, ROW_BLOCK_BYTES)], dim=-1)


def zoo_logits(zoo, cfg: GPTConfig, tp: int, pp: int, ids: torch.Tensor, ep: int = 1, routing: dict | None = None,
               stream: bool = False, ep_spans_tp: bool = False) -> torch.Tensor | None:
    """``[b, s, vocab_size]`` fp32 logits of the zoo folder at (tp, pp, ep) on global rank 0; None elsewhere.
    With ``routing`` (a dict), rank 0 also fills it with every MoE block's chosen experts ``[b s, k]``. ``stream``
    (pp 1): one layer in memory at a time (:func:`streamed_forward`)."""
    from deepspeed.accelerator import get_accelerator

    from zoo.models.specs import SpecSequential, build_pipeline
    from zoo.parallel.mappings import gather_from_tensor_model_parallel_region
    from zoo.parallel.pipe_forward import move_tensor, pipeline_forward

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
        out = streamed_embedding(zoo, small, present, renumbered.to(device), grid.tp_group, device)
        out = streamed_forward(specs, zoo, out, grid.tp_group, ep_group, device, on_layer=record,
                               layers=range(1, len(specs) - 1))
        out = streamed_vocab_linear(specs, len(specs) - 1, zoo, out, grid.tp_group, device)
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
    last = grid.topology.get_rank(pipe=pp - 1, data=0, model=0)
    logits = move_tensor(out if grid.rank == last else None, last, 0, device)
    return None if logits is None else logits.cpu()


@contextmanager
def hf_loading(max_memory: int | None):
    """``from_pretrained`` arguments for the HF side: none (the whole model in memory), or with ``max_memory`` (bytes)
    accelerate's big-model loading: modules kept on the CPU up to that size, the rest offloaded to disk (safetensors
    are read in place; other weights go to a temporary folder) and brought in module by module as the forward
    reaches them."""
    if max_memory is None:
        yield {}
        return
    with tempfile.TemporaryDirectory(prefix="zoo-verify-offload-") as offload:
        yield {"device_map": "auto", "max_memory": {"cpu": max_memory}, "offload_folder": offload}


def hf_logits(folder, ids: torch.Tensor, *, allow_pickle: bool = False, routing: dict | None = None,
              max_memory: int | None = None, device_map: dict | None = None) -> torch.Tensor:
    """transformers' fp32 logits; with ``routing`` (a dict) also every MoE block's chosen experts ``[b s, k]``, the
    indices its gate (``model.layers[i].mlp.gate``) returns. ``max_memory``: see :func:`hf_loading`; ``device_map``
    (a dict) then receives where each module went."""
    from transformers import AutoModelForCausalLM

    with hf_loading(max_memory) as loading:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, use_safetensors=not allow_pickle,
                                                     trust_remote_code=False, **loading).eval()
        if device_map is not None:  # transformers keeps no map when everything fits on the CPU
            device_map.update(getattr(model, "hf_device_map", None) or {"": "cpu"})
        if max_memory is not None:
            stream_offloaded_vocab(model)
        return _causal_lm_logits(model, ids, routing)


class RowBlockLinear(torch.nn.Module):
    """``F.linear`` with a weight that stays on disk: the forward reads a block of its rows at a time into one
    buffer (``reader``, an :class:`zoo.convert.io.RowReader`), concatenates the blocks' outputs and drops the
    buffer."""

    def __init__(self, reader, out_features: int, in_features: int, bias: torch.Tensor | None = None):
        super().__init__()
        self.reader, self.out_features, self.bias = reader, out_features, bias
        self.step = max(1, ROW_BLOCK_BYTES // (4 * in_features))

    def forward(self, x):
        outs = []
        for a in range(0, self.out_features, self.step):
            rows = range(a, min(a + self.step, self.out_features))
            outs.append(F.linear(x, self.reader.read(rows, reuse=True).to(x.dtype),
                                 None if self.bias is None else self.bias[a:rows.stop].to(x.dtype)))
        self.reader.release()  # the model may live on in reference cycles; its buffer need not
        return torch.cat(outs, dim=-1)


class RowReadEmbedding(torch.nn.Module):
    """An embedding lookup whose table stays on disk: the forward reads the rows of the distinct ids it is given
    (``read_rows(ids)``) and looks the ids up in them."""

    def __init__(self, read_rows):
        super().__init__()
        self.read_rows = read_rows

    def forward(self, ids):
        present, renumbered = torch.unique(ids, return_inverse=True)
        return F.embedding(renumbered, self.read_rows(present.tolist()))


def stream_offloaded_vocab(model) -> int:
    """Run an HF model's vocabulary-sized modules, its input embedding (a plain ``nn.Embedding``) and its output
    embedding (the LM / MLM head, an ``nn.Linear``), from disk where accelerate offloaded them to a safetensors file:
    the embedding reads the rows of the ids it looks up, the head a block of rows at a time
    (:class:`zoo.convert.io.RowReader`). Accelerate's hooks would bring the whole ``[vocab, hidden]`` matrix in
    for each (GPT-2's 154 MB), more than the rest of the model needs at any time. Where the module was kept in memory
    or offloaded to accelerate's own folder it stays as it is. Returns how many modules now read from disk."""
    from accelerate.hooks import remove_hook_from_module

    replaced = 0
    for module, kind in ((model.get_input_embeddings(), torch.nn.Embedding),
                         (model.get_output_embeddings(), torch.nn.Linear)):
        if type(module) is not kind or module.weight.device.type != "meta" \
                or getattr(module, "max_norm", None) is not None:
            continue
        weights = getattr(getattr(module, "_hf_hook", None), "weights_map", None)
        loader, prefix = getattr(weights, "dataset", weights), getattr(weights, "prefix", "")
        entry = getattr(loader, "index", {}).get(prefix + "weight", {})
        if entry.get("safetensors_file") is None or prefix + "weight" in (getattr(loader, "state_dict", None) or {}):
            continue
        dtype = getattr(torch, entry.get("dtype", "float32"))
        reader = io.RowReader(entry["safetensors_file"], entry.get("weight_name", prefix + "weight"))
        if kind is torch.nn.Embedding:
            streamed = RowReadEmbedding(lambda rows, reader=reader, dtype=dtype: reader.read(rows).to(dtype))
        else:
            try:
                bias = None if module.bias is None else weights["bias"].to(dtype).clone()
            except KeyError:
                continue
            streamed = RowBlockLinear(reader, module.out_features, module.in_features, bias)
        remove_hook_from_module(module)
        parent, _, attr = next(n for n, m in model.named_modules() if m is module).rpartition(".")
        setattr(model.get_submodule(parent), attr, streamed)
        replaced += 1
    return replaced


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


def verify(hf, zoo, tp: int = 1, pp: int = 1, *, ep: int = 1, batch: int = 2, seq: int = 16, seed: int = 0,
           allow_pickle: bool = False, max_memory: int | None = None) -> float:
    """max |zoo logits - HF logits| on the fixed batch. Collective: every rank of a world of tp x pp (x dp)
    processes calls it (a plain process is a world of one); every rank returns the same value."""
    return verify_report(hf, zoo, tp, pp, ep=ep, batch=batch, seq=seq, seed=seed, allow_pickle=allow_pickle,
                         max_memory=max_memory).max_abs_diff


def verify_report(hf, zoo, tp: int = 1, pp: int = 1, *, ep: int = 1, batch: int = 2, seq: int = 16, seed: int = 0,
                  allow_pickle: bool = False, max_memory: int | None = None,
                  ep_spans_tp: bool = False) -> Verification:
    """:func:`verify`'s comparison, with the router top-k agreement for MoE GPTs; the same on every rank.

    ``ep_spans_tp``: the EP groups take in the TP ranks (``parallel.ep_spans_tp`` of training; ep = tp x a divisor
    of dp), each rank loading its own whole experts.

    ``max_memory`` (bytes; GPT and BERT): neither side holds the whole model. The zoo side runs one layer at a time
    (:func:`streamed_forward`, pp 1, any tp), the HF side loads through accelerate with that cap
    (:func:`hf_loading`)."""
    try:
        family = io.read_config(zoo)[0]
    except io.CheckpointError as e:
        raise ConvertError(str(e)) from None
    if ep != 1 and family != "gpt":
        raise ConvertError(f"ep {ep} is for mixture-of-experts GPTs; {zoo} holds a {family!r} model: use ep 1")
    if max_memory is not None:
        check_memory_cap(max_memory, family, pp)
    if family in hf_bert.FAMILIES:
        return verify_bert(hf, zoo, tp, pp, batch=batch, seq=seq, seed=seed, allow_pickle=allow_pickle,
                           max_memory=max_memory)
    if family == "unet-diffusion":
        return Verification(verify_unet(hf, zoo, tp, pp, batch=batch, seed=seed))
    cfg = check_zoo(zoo, tp, pp, ep)
    # a world size tp x pp (x ep) does not divide is refused here, everywhere
    initialize_model_parallel(tp, pp, ep, ep_spans_tp=ep_spans_tp)
    # Only rank 0 runs transformers; its verdict on the HF side reaches every rank, so all stop together.
    folder, problem = None, None
    if global_rank() == 0:
        try:
            folder = check_hf(hf, cfg, allow_pickle=allow_pickle)
        except ConvertError as e:
            problem = str(e)
    problem = gather_objects(problem)[0]
    if problem:
        raise ConvertError(problem)
    ids = token_ids(cfg, batch, seq, seed)
    moe = cfg.num_experts > 0
    our_routing, their_routing = ({}, {}) if moe else (None, None)
    ours = zoo_logits(zoo, cfg, tp, pp, ids, ep, our_routing, stream=max_memory is not None, ep_spans_tp=ep_spans_tp)
    result = None
    if global_rank() == 0:
        placed = {}
        theirs = hf_logits(folder, ids, allow_pickle=allow_pickle, routing=their_routing, max_memory=max_memory,
                           device_map=placed)
        # Shapes match after check_hf; a mismatch here must not leave the other ranks waiting.
        diff = (ours - theirs).abs().max().item() if theirs.shape == ours.shape else float("inf")
        result = Verification(diff, topk_agreement(our_routing, their_routing) if moe else None,
                              placed if max_memory is not None else None)
    return gather_objects(result)[0]


def check_memory_cap(max_memory: int, family: str, pp: int) -> None:
    """Where a memory cap (``--max-memory``) works: GPT and BERT folders, one pipeline stage."""
    if max_memory <= 0:
        raise ConvertError(f"--max-memory must be a positive size (e.g. 2GB), got {max_memory} bytes")
    if family not in ("gpt", *hf_bert.FAMILIES):
        raise ConvertError(f"--max-memory is for gpt and bert folders; {family!r} models are checked whole: drop it")
    if pp != 1:
        raise ConvertError(f"--max-memory runs the zoo model one layer at a time in one pipeline stage, not at pp {pp}: "
                           f"use --pp 1 (any --tp)")


# ---------------------------------------------------------------------------------------------------------------
# BERT: the encoder's last hidden state or its head's logits
# ---------------------------------------------------------------------------------------------------------------

# Fields that make two BERTs different models (others, e.g. eps, show up as a difference).
BERT_STRUCTURE = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                  "max_position_embeddings", "type_vocab_size", "num_labels")


def check_bert_zoo(zoo, tp: int, pp: int) -> tuple[BertConfig, str | None]:
    """The zoo folder's config and head, and whether (tp, pp) can hold it; on every rank, before any process group."""
    _, cfg, head = hf_bert.zoo_bert_config(zoo)
    if tp < 1 or pp < 1:
        raise ConvertError(f"tp and pp must be positive, got tp {tp} pp {pp}")
    try:
        cfg.check_layout(tp, pp)
    except ValueError as e:
        raise ConvertError(str(e)) from None
    return cfg, head


def check_bert_hf(hf, cfg: BertConfig, head: str | None, *, allow_pickle: bool = False):
    """``(folder, architecture)`` of the HF side, checked to be the class of ``head`` with ``cfg``'s structure."""
    folder = hf_bert.model_folder(resolve_hf_folder(hf, allow_pickle=allow_pickle))
    shapes = hf_bert.BertCheckpoint(folder, allow_pickle).shapes  # refuses a pickle checkpoint without allow_pickle
    arch, hf_cfg = hf_bert.read_hf_config(folder, shapes)
    if hf_bert.HEAD_OF[arch] != head:
        raise ConvertError(f"{hf} is a {arch}; the zoo folder's head {head!r} exports as "
                           f"{hf_bert.ARCH_OF[head]}")
    theirs = hf_bert.bert_config_from_hf(arch, hf_cfg)
    for name in BERT_STRUCTURE:
        if name == "num_labels" and head != "classification":
            continue
        if getattr(theirs, name) != getattr(cfg, name):
            raise ConvertError(f"{hf} and the zoo folder are different models: {name} {getattr(theirs, name)} vs "
                               f"{getattr(cfg, name)}")
    return folder, arch


def bert_inputs(cfg: BertConfig, batch: int = 2, seq: int = 16, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """The fixed batch ``(input_ids, token_type_ids, attention_mask)``, each ``[batch, seq]``: seeded ids, the
    second half segment 1 (when the model has two token types), and the last row padded over its last quarter
    (mask 0, pad id), so masking the padding matters."""
    seq = min(seq, cfg.max_position_embeddings)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))
    token_type_ids = torch.zeros_like(ids)
    if cfg.type_vocab_size > 1:
        token_type_ids[:, seq // 2:] = 1
    attention_mask = torch.ones_like(ids)
    pad = min(max(1, seq // 4), seq - 1)  # a row all padding would be meaningless
    attention_mask[-1, seq - pad:] = 0
    ids[-1, seq - pad:] = cfg.pad_token_id or 0
    return ids, token_type_ids, attention_mask


@torch.no_grad()
def pipeline_forward_tuple(module, inputs, grid, device="cpu"):
    """``zoo.parallel.pipe_forward.pipeline_forward`` for layers that pass tuples (BERT's ``(hidden, mask)``): a
    stage sends the number of tensors, then each. The last stage's output there, None on other stages."""
    from zoo.parallel.pipe_forward import recv_tensor, send_tensor

    if grid is None or grid.pp == 1:
        return module(inputs)
    stage, ranks = grid.pp_rank, grid.pp_ranks
    if stage > 0:
        count = int(recv_tensor(ranks[stage - 1], device)[0])
        parts = tuple(recv_tensor(ranks[stage - 1], device) for _ in range(count))
        inputs = parts if count > 1 else parts[0]
    out = module(inputs)
    if stage < grid.pp - 1:
        parts = out if isinstance(out, tuple) else (out,)
        send_tensor(torch.tensor([len(parts)], device=device), ranks[stage + 1])
        for part in parts:
            send_tensor(part, ranks[stage + 1])
        return None
    return out


def zoo_bert_outputs(zoo, cfg: BertConfig, head: str | None, tp: int, pp: int, inputs, stream: bool = False) \
        -> list | None:
    """What the zoo model of ``head`` outputs at (tp, pp), fp32, on global rank 0 (None elsewhere): the last hidden
    state ``[b, s, h]``; MLM logits ``[b, s, vocab_size]`` (gathered over TP, padding cut); then NSP logits
    ``[b, 2]``; or classification logits ``[b, num_labels]``. ``stream`` (pp 1): one layer in memory at a time."""
    from deepspeed.accelerator import get_accelerator

    from zoo.models.bert import layer_specs as bert_layer_specs
    from zoo.models.specs import SpecSequential, build_pipeline
    from zoo.parallel.mappings import gather_from_tensor_model_parallel_region
    from zoo.parallel.pipe_forward import move_tensor

    device = get_accelerator().current_device_name()
    grid = initialize_model_parallel(tp, pp)
    specs = bert_layer_specs(cfg, ParallelOptions(tp_group=grid.tp_group), head)
    inputs = tuple(t.to(device) for t in inputs)
    if stream:  # as the GPT's: the word embeddings and the tied decoder never whole in memory
        present, renumbered = torch.unique(inputs[0], return_inverse=True)
        small = bert_layer_specs(replace(cfg, vocab_size=len(present)), ParallelOptions(tp_group=grid.tp_group), head)
        out = streamed_embedding(zoo, small, present, (renumbered, *inputs[1:]), grid.tp_group, device)
        decoder = len(specs) - 2 if head in ("mlm", "mlm+nsp") else None  # then BertMLMBias, the last layer
        out = streamed_forward(specs, zoo, out, grid.tp_group, device=device, layers=range(1, decoder or len(specs)))
        if decoder is not None:
            x, *rest = out if isinstance(out, tuple) else (out,)
            out = streamed_vocab_linear(specs, decoder, zoo, x, grid.tp_group, device)
            out = streamed_forward(specs, zoo, (out, *rest) if rest else out, grid.tp_group, device=device,
                                   layers=range(decoder + 1, len(specs)))
    else:
        # No stage boundary inside the MLM head: stages split at BertLayers (zoo/models/bert.py).
        module = build_pipeline(specs, grid, loss_fn=None, partition_method="type:BertLayer") if pp > 1 \
            else SpecSequential(specs)
        io.load_model(zoo, module, grid.tp_group)
        module.to(device).eval()
        out = pipeline_forward_tuple(module, inputs, grid, device)
    outs = None
    with torch.no_grad():
        if out is not None:
            outs = list(out) if isinstance(out, tuple) else [out]
            if head in ("mlm", "mlm+nsp"):  # [b, s, V_padded / tp] -> [b, s, vocab_size]
                outs[0] = gather_from_tensor_model_parallel_region(outs[0], grid.tp_group)[..., : cfg.vocab_size]
            outs = [o.float() for o in outs]
    last = grid.topology.get_rank(pipe=pp - 1, data=0, model=0)
    count = 2 if head == "mlm+nsp" else 1
    moved = [move_tensor(outs[i] if grid.rank == last else None, last, 0, device) for i in range(count)]
    return None if moved[0] is None else [t.cpu() for t in moved]


def hf_bert_outputs(folder, arch: str, inputs, *, allow_pickle: bool = False, max_memory: int | None = None,
                    device_map: dict | None = None) -> list:
    """transformers' outputs matching :func:`zoo_bert_outputs`, fp32 (``max_memory``, ``device_map``: as
    :func:`hf_logits`)."""
    import transformers

    with hf_loading(max_memory) as loading:
        model = getattr(transformers, arch).from_pretrained(folder, dtype=torch.float32,
                                                            use_safetensors=not allow_pickle, trust_remote_code=False,
                                                            **loading).eval()
        if device_map is not None:
            device_map.update(getattr(model, "hf_device_map", None) or {"": "cpu"})
        if max_memory is not None:
            stream_offloaded_vocab(model)
        return _bert_outputs(model, arch, inputs)


def _bert_outputs(model, arch: str, inputs) -> list:
    ids, token_type_ids, attention_mask = inputs
    with torch.no_grad():
        out = model(input_ids=ids, token_type_ids=token_type_ids, attention_mask=attention_mask)
    if arch == "BertModel":
        return [out.last_hidden_state.float()]
    if arch == "BertForPreTraining":
        return [out.prediction_logits.float(), out.seq_relationship_logits.float()]
    return [out.logits.float()]


def verify_bert(hf, zoo, tp: int = 1, pp: int = 1, *, batch: int = 2, seq: int = 16, seed: int = 0,
                allow_pickle: bool = False, max_memory: int | None = None) -> Verification:
    """max |zoo - HF| over the outputs of the zoo folder's head (see :func:`zoo_bert_outputs`) on the fixed padded
    batch (and with ``max_memory`` the HF device map). Collective, as :func:`verify`."""
    cfg, head = check_bert_zoo(zoo, tp, pp)
    initialize_model_parallel(tp, pp)
    folder = arch = problem = None
    if global_rank() == 0:
        try:
            folder, arch = check_bert_hf(hf, cfg, head, allow_pickle=allow_pickle)
        except ConvertError as e:
            problem = str(e)
    problem = gather_objects(problem)[0]
    if problem:
        raise ConvertError(problem)
    inputs = bert_inputs(cfg, batch, seq, seed)
    ours = zoo_bert_outputs(zoo, cfg, head, tp, pp, inputs, stream=max_memory is not None)
    result = None
    if global_rank() == 0:
        placed = {}
        theirs = hf_bert_outputs(folder, arch, inputs, allow_pickle=allow_pickle, max_memory=max_memory,
                                 device_map=placed)
        same_shapes = [a.shape for a in ours] == [b.shape for b in theirs]
        diff = max((a - b).abs().max().item() for a, b in zip(ours, theirs)) if same_shapes else float("inf")
        result = Verification(diff, None, placed if max_memory is not None else None)
    return gather_objects(result)[0]


# ---------------------------------------------------------------------------------------------------------------
# diffusers UNet2DModel: the predicted noise
# ---------------------------------------------------------------------------------------------------------------

# Fields that make two UNet2DModels different models (others, e.g. eps or flip_sin_to_cos, show up as a difference).
UNET_STRUCTURE = ("in_channels", "out_channels", "block_out_channels", "layers_per_block", "down_block_types",
                  "up_block_types", "mid_block_type", "add_attention", "attention_head_dim", "norm_num_groups",
                  "time_embedding_dim")
UNET_TIMESTEPS = 1000  # DDPM's training steps: the timesteps of the fixed batch are drawn below this
UNET_DEFAULT_SIZE = 32  # the sample size when the config has none (diffusers' sample_size None)


def check_unet_zoo(zoo, tp: int, pp: int):
    """The zoo folder's DiffusionUNetConfig, and whether (tp, pp) can hold it; on every rank, before any group."""
    from zoo.models.unet import DIFFUSION_FAMILY, DiffusionUNetConfig

    try:
        family, meta = io.read_config(zoo)
        if family != DIFFUSION_FAMILY:
            raise ConvertError(f"{zoo} holds a {family!r} model; this verifier compares {DIFFUSION_FAMILY} models")
        cfg = DiffusionUNetConfig.from_dict(meta)
    except (io.CheckpointError, ValueError) as e:
        raise ConvertError(str(e)) from None
    if tp < 1 or pp < 1:
        raise ConvertError(f"tp and pp must be positive, got tp {tp} pp {pp}")
    try:
        cfg.check_layout(tp, pp)
    except ValueError as e:
        raise ConvertError(str(e)) from None
    return cfg


def check_unet_hf(hf, cfg):
    """The diffusers model folder (``hf`` itself or its ``unet/``), checked to be a UNet2DModel in safetensors with
    ``cfg``'s structure."""
    import json
    import warnings

    from zoo.convert import hf_diffusers

    folder = hf_diffusers.model_folder(resolve_hf_folder(hf))
    try:
        meta = json.loads((folder / hf_diffusers.CONFIG_NAME).read_text())
    except ValueError as e:
        raise ConvertError(f"{folder / hf_diffusers.CONFIG_NAME} is not valid JSON ({e})") from None
    if not isinstance(meta, dict) or "_class_name" not in meta:
        raise ConvertError(f"{folder / hf_diffusers.CONFIG_NAME} is not a diffusers model config (no _class_name); "
                           f"the zoo folder holds a {hf_diffusers.CLASS_NAME}")
    with warnings.catch_warnings():  # fields UNet2DModel ignores: import already said so
        warnings.simplefilter("ignore")
        theirs = hf_diffusers.diffusers_config_to_zoo(meta)
    hf_diffusers.weight_files(folder)  # refuses a pickle-only or weightless folder
    for name in UNET_STRUCTURE:
        if getattr(theirs, name) != getattr(cfg, name):
            raise ConvertError(f"{hf} and the zoo folder are different models: {name} {getattr(theirs, name)} vs "
                               f"{getattr(cfg, name)}")
    return folder


def unet_sizes(cfg) -> tuple[int, int]:
    """(H, W) of the fixed batch: the config's sample_size, or 32 rounded up to what the levels can halve."""
    if cfg.sample_size is not None:
        return cfg.sizes
    multiple = 2 ** (len(cfg.block_out_channels) - 1)
    size = -(-UNET_DEFAULT_SIZE // multiple) * multiple
    return size, size


def unet_inputs(cfg, batch: int = 2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed batch: noisy samples ``[batch, in_channels, H, W]`` (fp32, N(0, 1)) and integer timesteps
    ``[batch]`` in [0, 1000), seeded."""
    g = torch.Generator().manual_seed(seed)
    sample = torch.randn(batch, cfg.in_channels, *unet_sizes(cfg), generator=g)
    timesteps = torch.randint(0, UNET_TIMESTEPS, (batch,), generator=g)
    return sample, timesteps


def zoo_unet_output(zoo, cfg, tp: int, pp: int, inputs) -> torch.Tensor | None:
    """The predicted noise ``[b, out_channels, H, W]`` (fp32) of the zoo folder at (tp, pp), on global rank 0;
    None elsewhere. Stages are :func:`zoo.models.unet.build_unet_pipeline`'s (balanced by FLOPs): each sends the
    next its packed ``(flat, shapes)`` pair; ResNet convs and attention heads are split over TP, the output is
    replicated on the TP group."""
    import dataclasses

    from deepspeed.accelerator import get_accelerator

    from zoo.models.specs import SpecSequential
    from zoo.models.unet import build_unet_pipeline
    from zoo.models.unet import layer_specs as unet_layer_specs
    from zoo.parallel.pipe_forward import move_tensor

    device = get_accelerator().current_device_name()
    grid = initialize_model_parallel(tp, pp)
    # The stage split weighs layers by FLOPs at the image size; without one in the config, at the batch's
    # (sample_size changes no layer, so the keys and shapes are the same).
    built = cfg if cfg.sample_size is not None else dataclasses.replace(cfg, sample_size=tuple(inputs[0].shape[-2:]))
    specs = unet_layer_specs(built, ParallelOptions(tp_group=grid.tp_group))
    module = build_unet_pipeline(built, specs, grid, loss_fn=None) if pp > 1 else SpecSequential(specs)
    io.load_model(zoo, module, grid.tp_group)
    module.to(device).float().eval()
    with torch.no_grad():
        out = pipeline_forward_tuple(module, tuple(t.to(device) for t in inputs), grid, device)
        out = None if out is None else out.float()
    last = grid.topology.get_rank(pipe=pp - 1, data=0, model=0)
    moved = move_tensor(out if grid.rank == last else None, last, 0, device)
    return None if moved is None else moved.cpu()


def diffusers_unet_output(folder, inputs) -> torch.Tensor:
    """diffusers' ``UNet2DModel(sample, timesteps).sample`` in fp32."""
    from zoo.package import require

    UNet2DModel = require("diffusers").UNet2DModel  # the diffusion extra

    model = UNet2DModel.from_pretrained(folder, torch_dtype=torch.float32, use_safetensors=True).eval()
    with torch.no_grad():
        return model(*inputs).sample.float()


def verify_unet(hf, zoo, tp: int = 1, pp: int = 1, *, batch: int = 2, seed: int = 0) -> float:
    """max |zoo - diffusers| of the predicted noise on the fixed batch (:func:`unet_inputs`). Collective, as
    :func:`verify`; only global rank 0 imports diffusers."""
    cfg = check_unet_zoo(zoo, tp, pp)
    initialize_model_parallel(tp, pp)
    folder, problem = None, None
    if global_rank() == 0:
        try:
            folder = check_unet_hf(hf, cfg)
        except ConvertError as e:
            problem = str(e)
    problem = gather_objects(problem)[0]
    if problem:
        raise ConvertError(problem)
    inputs = unet_inputs(cfg, batch, seed)
    ours = zoo_unet_output(zoo, cfg, tp, pp, inputs)
    diff = None
    if global_rank() == 0:
        theirs = diffusers_unet_output(folder, inputs)
        diff = (ours - theirs).abs().max().item() if theirs.shape == ours.shape else float("inf")
    return gather_objects(diff)[0]

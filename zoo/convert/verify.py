"""A zoo model folder computes what its HuggingFace original computes, at any (tp, pp, ep) layout: the driver.

    python launch/convert.py verify --hf HF --zoo DIR
    torchrun --nproc_per_node 4 launch/convert.py verify --hf HF --zoo DIR --tp 2 --pp 2
    torchrun --nproc_per_node 4 launch/convert.py verify --hf MOE_HF --zoo DIR --tp 2 --ep 2
    python launch/convert.py verify --hf HF --zoo DIR --max-memory 2GB

The zoo folder's family picks the comparison (``zoo.convert.registry.FAMILIES``; each family's verify sits beside
its converter, e.g. ``zoo.convert.gpt``). Every one runs the same way: every rank builds its part of the zoo model
at (tp, pp), reads its slices of the folder (``io.load_model``) and runs a fixed, seeded batch; pipeline stages pass
activations (``zoo.parallel.pipe_forward``, :func:`pipeline_forward_tuple`), the last stage's output reaches global
rank 0 (:func:`to_rank0`), and rank 0 alone reads the HF side (:func:`on_rank0`) and compares its outputs on the
same inputs, fp32 on both sides (:func:`compare_on_rank0`). As torchtitan checks its converters: by outputs.

With a memory cap (``max_memory``, the families that stream) neither side holds its whole model: zoo's layers are
built, filled from the folder and run one at a time (:func:`streamed_forward`; tensors larger than 16 MB are read a
few rows per open of the file, ``io.load_model``), and transformers loads through accelerate's big-model path
(:func:`hf_loading`: ``device_map="auto"``, at most ``max_memory`` of weights kept on the CPU, the rest offloaded to
disk and brought in module by module during the forward). Neither side holds a vocabulary-sized matrix either (for
a ~100M model the largest tensor by far: GPT-2's tied 154 MB embedding and head): zoo's embedding is built for the
batch's distinct ids only (:func:`streamed_embedding`), its LM head or tied MLM decoder multiplies by 4 MB of rows
at a time (:func:`streamed_vocab_linear`), and the offloaded HF embedding and head are swapped for modules that
read those rows from the safetensors file (:func:`stream_offloaded_vocab`). The outputs are the same as without
the cap.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from zoo.convert import io
from zoo.convert.errors import ConvertError
from zoo.convert.reader import read_zoo_config
from zoo.parallel.shards import gather_objects, global_rank
from zoo.parallel.topology import group_rank_and_size

# With a memory cap, vocabulary-sized weights (LM heads, tied decoders) are read this many bytes of rows at a time.
ROW_BLOCK_BYTES = 4 * 1024**2


@dataclass
class Verification:
    """What :func:`verify_report` found: the largest |zoo - HF| output difference, for MoE GPTs the router top-k
    agreement (None for dense models), and with a memory cap the HF side's device map."""

    max_abs_diff: float
    router_topk_agreement: float | None = None
    hf_device_map: dict | None = None  # with a memory cap: where accelerate put the HF modules ("cpu", "disk")


def verify(hf, zoo, tp: int = 1, pp: int = 1, *, ep: int = 1, batch: int = 2, seq: int = 16, seed: int = 0,
           allow_pickle: bool = False, max_memory: int | None = None) -> float:
    """max |zoo outputs - HF outputs| on the fixed batch. Collective: every rank of a world of tp x pp (x dp)
    processes calls it (a plain process is a world of one); every rank returns the same value."""
    return verify_report(hf, zoo, tp, pp, ep=ep, batch=batch, seq=seq, seed=seed, allow_pickle=allow_pickle,
                         max_memory=max_memory).max_abs_diff


def verify_report(hf, zoo, tp: int = 1, pp: int = 1, *, ep: int = 1, batch: int = 2, seq: int = 16, seed: int = 0,
                  allow_pickle: bool = False, max_memory: int | None = None,
                  ep_spans_tp: bool = False) -> Verification:
    """:func:`verify`'s comparison by the zoo folder's family, with the router top-k agreement for MoE GPTs; the
    same on every rank.

    ``ep_spans_tp``: the EP groups take in the TP ranks (``parallel.ep_spans_tp`` of training; ep = tp x a divisor
    of dp), each rank loading its own whole experts.

    ``max_memory`` (bytes; the families that stream): neither side holds the whole model. The zoo side runs one
    layer at a time (:func:`streamed_forward`, pp 1, any tp), the HF side loads through accelerate with that cap
    (:func:`hf_loading`)."""
    from zoo.convert.registry import FAMILIES, convertible

    family = read_zoo_config(zoo)[0]
    converter = FAMILIES.get(family)
    if converter is None:
        raise ConvertError(f"{zoo} holds a {family!r} model; verify compares the families "
                           f"{', '.join(convertible())}")
    if ep != 1 and not converter.expert_parallel:
        raise ConvertError(f"ep {ep} is for mixture-of-experts GPTs; {zoo} holds a {family!r} model: use ep 1")
    if max_memory is not None:
        check_memory_cap(max_memory, family, pp)
    return converter.verify(hf, zoo, tp, pp, ep=ep, batch=batch, seq=seq, seed=seed, allow_pickle=allow_pickle,
                            max_memory=max_memory, ep_spans_tp=ep_spans_tp)


def check_memory_cap(max_memory: int, family: str, pp: int) -> None:
    """Where a memory cap (``--max-memory``) works: the families whose converter streams, one pipeline stage."""
    from zoo.convert.registry import FAMILIES

    if max_memory <= 0:
        raise ConvertError(f"--max-memory must be a positive size (e.g. 2GB), got {max_memory} bytes")
    if not FAMILIES[family].streams:
        streaming = list(dict.fromkeys(c.name for _, c in FAMILIES.items() if c is not None and c.streams))
        raise ConvertError(f"--max-memory is for {' and '.join(streaming)} folders; {family!r} models are checked "
                           f"whole: drop it")
    if pp != 1:
        raise ConvertError(f"--max-memory runs the zoo model one layer at a time in one pipeline stage, not at "
                           f"pp {pp}: use --pp 1 (any --tp)")


def check_layout(cfg, tp: int, pp: int) -> None:
    """Whether (tp, pp) can hold the model of ``cfg`` (its ``check_layout``), said in one line; on every rank,
    before any process group."""
    if tp < 1 or pp < 1:
        raise ConvertError(f"tp and pp must be positive, got tp {tp} pp {pp}")
    try:
        cfg.check_layout(tp, pp)
    except ValueError as e:
        raise ConvertError(str(e)) from None


# ---------------------------------------------------------------------------------------------------------------
# Rank 0 reads the HF side and compares
# ---------------------------------------------------------------------------------------------------------------


def on_rank0(check: Callable):
    """``check()`` on global rank 0 only (only rank 0 reads the HF side), its value there (None elsewhere). Its
    refusal reaches every rank, so all stop together rather than wait for rank 0 in a collective."""
    value, problem = None, None
    if global_rank() == 0:
        try:
            value = check()
        except ConvertError as e:
            problem = str(e)
    problem = gather_objects(problem)[0]
    if problem:
        raise ConvertError(problem)
    return value


def max_abs_diff(ours: list, theirs: list) -> float:
    """max |a - b| over paired tensors; inf when their shapes differ (rank 0 must not fail while the other ranks
    wait for its verdict)."""
    if [a.shape for a in ours] != [b.shape for b in theirs]:
        return float("inf")
    return max((a - b).abs().max().item() for a, b in zip(ours, theirs))


def compare_on_rank0(ours: list | None, theirs: Callable, max_memory: int | None = None) -> Verification:
    """On global rank 0, ``theirs(device_map)`` -> (HF outputs, router agreement or None) compared with ``ours``
    (the zoo outputs, on rank 0); the :class:`Verification` on every rank. ``device_map`` (a dict) receives where
    accelerate put the HF modules, reported with a memory cap."""
    result = None
    if global_rank() == 0:
        placed: dict = {}
        outputs, agreement = theirs(placed)
        result = Verification(max_abs_diff(ours, outputs), agreement, placed if max_memory is not None else None)
    return gather_objects(result)[0]


def to_rank0(out, grid, device) -> torch.Tensor | None:
    """The last pipeline stage's output (TP rank 0 of the first replica) on global rank 0, on the CPU; None
    elsewhere."""
    from zoo.parallel.pipe_forward import move_tensor

    last = grid.topology.get_rank(pipe=grid.pp - 1, data=0, model=0)
    moved = move_tensor(out if grid.rank == last else None, last, 0, device)
    return None if moved is None else moved.cpu()


# ---------------------------------------------------------------------------------------------------------------
# Pipelines, and the memory-capped forward
# ---------------------------------------------------------------------------------------------------------------


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


def run_hf(model_class, folder, run: Callable, *, allow_pickle: bool = False, max_memory: int | None = None,
           device_map: dict | None = None):
    """``run(model)`` on ``model_class.from_pretrained(folder)`` in fp32 (safetensors unless ``allow_pickle``, no
    remote code). ``max_memory``: see :func:`hf_loading`; ``device_map`` (a dict) then receives where each module
    went."""
    with hf_loading(max_memory) as loading:
        model = model_class.from_pretrained(folder, dtype=torch.float32, use_safetensors=not allow_pickle,
                                            trust_remote_code=False, **loading).eval()
        if device_map is not None:  # transformers keeps no map when everything fits on the CPU
            device_map.update(getattr(model, "hf_device_map", None) or {"": "cpu"})
        if max_memory is not None:
            stream_offloaded_vocab(model)
        with torch.no_grad():
            return run(model)


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

"""HuggingFace <-> zoo for the BERT families (bert: BertModel, BertForMaskedLM, BertForPreTraining; bert-classifier:
BertForSequenceClassification): the streamed import and export, and verify by outputs.

The key table, the config mapping and the refusals of the four classes are ``zoo.convert.hf.bert``'s; this module
runs them, one block at a time in both directions (``zoo.convert.reader``, ``zoo.convert.writer``).

Where the head is recorded: the zoo folder's ``config.json`` is ``{"family": ..., "config": {<BertConfig's fields>,
"head": <head>}}``; :func:`zoo_bert_config` splits it back into ``(BertConfig, head)`` (a folder without the key,
e.g. written by ``io.save_model``, gets its head from the family and its tensors). A classifier's HF label names
(``id2label``, ``label2id``, ``problem_type``) ride in the extra file ``labels.json``; ``num_labels`` is a
BertConfig field.

BertModel's pooler (``tanh(W h_[CLS] + b)``) is no layer of head None, whose output is the last hidden state; its
two tensors are stored under the key the other heads use (``{L+1}.pooler.dense.*``), which ``io.load_model``
leaves alone, so that zoo -> HF writes them back (a head-None folder without them exports a BertModel whose pooler
transformers initializes at random; the last hidden state does not depend on it).

Sentence-embedding folders (a BertModel plus sentence-transformers' ``modules.json``, ``1_Pooling/``, ...) import
as that BertModel; their pooling and normalization modules are not converted (a log line says so). Tensors that
the HF class itself does not load are dropped with a log line: a pretraining checkpoint's pooler and NSP head
under BertForMaskedLM (bert-base-uncased ships so). Not weights, skipped: HF's tied copies
``cls.predictions.decoder.*`` and the ``position_ids`` buffer. Old names ``LayerNorm.gamma``/``beta`` read as
``weight``/``bias``.

Refused here, one line each: other architectures; missing, misshapen or unknown tensors; pickle checkpoints without
``allow_pickle``; a zoo folder of another family.

Verify: the batch is ``(input_ids, token_type_ids, attention_mask)`` with two segments and padding at the end of the
last row; compared is what the head outputs: the last hidden state (head None, BertModel), the MLM logits
(BertForMaskedLM), MLM and NSP logits (BertForPreTraining) or the classification logits
(BertForSequenceClassification). With a memory cap the zoo side streams as the GPT's (``zoo.convert.verify``).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import replace
from pathlib import Path

import torch

from zoo.convert import io, verify
from zoo.convert.errors import ConvertError
from zoo.convert.hf.bert import (  # noqa: F401  (public here: the family's names)
    ARCH_OF,
    HEAD_OF,
    IGNORED,
    MODEL_TYPE,
    OTHER_HEADS,
    PREFIX,
    bert_config,
    bert_config_from_hf,
    bert_table,
    class_from_keys,
    family_of,
    hf_rows,
)
from zoo.convert.hub import read_hf_meta, resolve_hf_folder
from zoo.convert.hub import transformers_folder as model_folder
from zoo.convert.reader import (
    HFCheckpoint,
    check_shapes,
    check_zoo_rows,
    read_zoo_config,
    streamed_groups,
    zoo_weights,
)
from zoo.convert.registry import ARCHITECTURES, of_family
from zoo.convert.writer import export_rows, finish
from zoo.models.bert import CLASSIFIER_FAMILY, FAMILY, HEADS, BertConfig
from zoo.models.gpt import ParallelOptions
from zoo.parallel.topology import initialize_model_parallel

log = logging.getLogger(__name__)

FAMILIES_READ = (FAMILY, CLASSIFIER_FAMILY)
LABELS_FILE = "labels.json"
# sentence-transformers' files beside the BertModel they wrap.
SENTENCE_TRANSFORMERS = ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json")


def supported() -> list[str]:
    """The HF classes these families read, in registration order."""
    return [a.name for family in FAMILIES_READ for a in of_family(family)]


# ---------------------------------------------------------------------------------------------------------------
# zoo folders
# ---------------------------------------------------------------------------------------------------------------


def zoo_config_dict(cfg: BertConfig, head: str | None) -> dict:
    """What a zoo bert folder's config.json holds under "config": BertConfig's fields and the head."""
    return {**cfg.to_dict(), "head": head}


def _infer_head(family: str, names) -> str | None:
    """The head of a folder written without a "head" key, from its family and its tensors."""
    if family == CLASSIFIER_FAMILY:
        return "classification"
    names = set(names)
    if any(n.endswith(".seq_relationship.weight") for n in names):
        return "mlm+nsp"
    if any(re.fullmatch(r"\d+\.bias", n) for n in names):  # the MLM decoder bias, a layer of its own
        return "mlm"
    return None


def zoo_bert_config(folder) -> tuple[str, BertConfig, str | None]:
    """``(family, BertConfig, head)`` of a zoo bert folder; a folder of another family is refused in one line.

    The head is the config's "head" key; without one (a folder written by ``io.save_model``), "classification"
    for family bert-classifier, else whatever the stored tensors hold (NSP head, MLM bias or neither).
    """
    family, meta = read_zoo_config(folder)
    if family not in FAMILIES_READ:
        raise ConvertError(f"{folder} holds a checkpoint of another family ({family!r}); expected one of "
                           f"{', '.join(FAMILIES_READ)}")
    meta = dict(meta)
    if "head" in meta:
        head = meta.pop("head")
    else:
        try:
            head = _infer_head(family, io.weight_map(folder))
        except io.CheckpointError as e:
            raise ConvertError(str(e)) from None
    if head not in HEADS:
        raise ConvertError(f"{folder}: unknown BERT head {head!r}; heads: {list(HEADS)}")
    if family != family_of(head):
        raise ConvertError(f"{folder}: head {head!r} does not belong to family {family!r} (expected "
                           f"{family_of(head)!r})")
    return family, bert_config(meta), head


# ---------------------------------------------------------------------------------------------------------------
# Reading a HF folder
# ---------------------------------------------------------------------------------------------------------------


def architecture_of(meta: dict, where: str, keys=()) -> str:
    """The HF class of a BERT folder: ``architectures[0]``, or (model_type "bert" alone) what its tensors hold."""
    archs = meta.get("architectures") or []
    if archs:
        arch = archs[0]
    elif meta.get("model_type") == MODEL_TYPE:
        arch = class_from_keys(keys)
    else:
        arch = meta.get("model_type") or "unknown"
    if arch not in supported():
        from zoo.convert.registry import model_types

        other = ARCHITECTURES.get(model_types().get(arch, arch))
        if other is not None:
            raise ConvertError(f"{where}: architecture {arch} is a checkpoint of another family ({other.family}); "
                               f"this converter reads {', '.join(supported())}")
        raise ConvertError(f"{where}: architecture {arch} is not supported; supported: {', '.join(supported())}")
    return arch


def read_hf_config(folder: Path, keys=()):
    """``(architecture, transformers BertConfig)`` of a HF BERT folder (no remote code is ever run)."""
    meta = read_hf_meta(folder)
    arch = architecture_of(meta, str(folder / "config.json"), keys)
    return arch, ARCHITECTURES[arch].config_class().from_dict(meta)


def _canonical(key: str) -> str:
    """Old TF-converted checkpoints name LayerNorm's parameters gamma and beta (HF renames them when loading)."""
    return re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", key))


class BertCheckpoint:
    """An ``HFCheckpoint`` seen under canonical names (see :func:`_canonical`)."""

    def __init__(self, folder: Path, allow_pickle: bool):
        self.raw = HFCheckpoint(folder, allow_pickle)
        self.names = {_canonical(k): k for k in self.raw.shapes}
        self.shapes = {c: self.raw.shapes[k] for c, k in self.names.items()}

    def read(self, keys) -> dict[str, torch.Tensor]:
        values = self.raw.read([self.names[k] for k in keys])
        return {k: values[self.names[k]] for k in keys}


def _sentence_transformers_extras(folder: Path, root: Path) -> list[str]:
    """The sentence-transformers entries of ``root`` (files and module folders), or [] for a plain HF folder."""
    if not any((root / name).is_file() for name in SENTENCE_TRANSFORMERS):
        return []
    known = {"config.json", io.SINGLE_FILE, io.INDEX_FILE, "pytorch_model.bin", "pytorch_model.bin.index.json",
             "README.md", ".gitattributes", *io.TOKENIZER_FILES}
    return sorted(p.name + ("/" if p.is_dir() else "") for p in root.iterdir()
                  if p.name not in known and not p.name.startswith(".") and p != folder
                  and not p.name.endswith(".safetensors"))


# ---------------------------------------------------------------------------------------------------------------
# The two conversions
# ---------------------------------------------------------------------------------------------------------------


def hf_to_zoo_bert(src, out, *, dtype: torch.dtype | None = None, allow_pickle: bool = False,
                   max_shard_bytes: int = io.DEFAULT_SHARD_BYTES, cache_dir=None) -> Path:
    """Write the HF BERT ``src`` (folder or Hub id) as a zoo model folder ``out``, streaming one block at a time.

    Family bert (head None, "mlm", "mlm+nsp") or bert-classifier (head "classification", labels in
    ``labels.json``); the head goes into the config (see the module docstring). Tokenizer files pass through.
    Everything is checked (architecture, config, every tensor's presence and shape, no unknown tensor) before a
    byte is written. ``dtype`` None keeps the checkpoint's dtypes.
    """
    root = resolve_hf_folder(src, allow_pickle=allow_pickle, cache_dir=cache_dir)
    folder = model_folder(root)
    if not (folder / "config.json").is_file():
        raise ConvertError(f"{folder} has no config.json; pass a HuggingFace model folder")
    ckpt = BertCheckpoint(folder, allow_pickle)
    arch, hf_cfg = read_hf_config(folder, ckpt.shapes)
    head = HEAD_OF[arch]
    cfg = bert_config_from_hf(arch, hf_cfg)
    prefix = PREFIX if f"{PREFIX}embeddings.word_embeddings.weight" in ckpt.shapes else ""
    pooler = head is None and f"{prefix}pooler.dense.weight" in ckpt.shapes
    groups = ARCHITECTURES[arch].groups(cfg, prefix=prefix, pooler=pooler)
    rows = [r for g in groups for r in g]
    check_shapes(rows, ckpt.shapes, str(folder))
    used = {k for r in rows for k in r.hf}
    rest = sorted(set(ckpt.shapes) - used)
    unknown = [k for k in rest if not IGNORED.search(k) and not OTHER_HEADS.match(k)]
    if unknown:
        raise ConvertError(f"{folder}: {len(unknown)} tensor(s) the {arch} table does not use, e.g. {unknown[:3]}; "
                           f"the model has a feature zoo does not convert")
    dropped = [k for k in rest if OTHER_HEADS.match(k) and not IGNORED.search(k)]
    if dropped:
        log.info("%s: %d tensor(s) of another BERT head dropped, as %s drops them when loading: %s", folder,
                 len(dropped), arch, ", ".join(dropped))
    extras = _sentence_transformers_extras(folder, root)
    if extras:
        log.info("%s: sentence-transformers folder; importing its %s only, not %s (pooling and normalization stay "
                 "with sentence-transformers)", root, arch, ", ".join(extras))

    extra_files = {}
    if head == "classification":
        labels = {"id2label": {str(i): name for i, name in sorted(hf_cfg.id2label.items())},
                  "label2id": dict(hf_cfg.label2id), "problem_type": getattr(hf_cfg, "problem_type", None)}
        extra_files[LABELS_FILE] = json.dumps(labels, indent=2)
    return io.write_model_folder(out, family_of(head), zoo_config_dict(cfg, head), streamed_groups(ckpt, groups, dtype),
                                 tokenizer_dir=folder,
                                 max_shard_bytes=max_shard_bytes, extra_files=extra_files)


def _labels(src: Path, cfg: BertConfig) -> dict:
    """HF config fields for a classifier's labels: labels.json if present and consistent, else num_labels."""
    path = src / LABELS_FILE
    if not path.is_file():
        return {"num_labels": cfg.num_labels}
    try:
        meta = json.loads(path.read_text())
    except ValueError as e:
        raise ConvertError(f"{path} is not valid JSON ({e})") from None
    id2label = {int(i): name for i, name in (meta.get("id2label") or {}).items()}
    if sorted(id2label) != list(range(cfg.num_labels)):
        raise ConvertError(f"{path}: id2label has ids {sorted(id2label)}, the config's num_labels is {cfg.num_labels}")
    out = {"id2label": id2label, "label2id": meta.get("label2id") or {v: k for k, v in id2label.items()}}
    if meta.get("problem_type"):
        out["problem_type"] = meta["problem_type"]
    return out


MODEL_CARD = """---
library_name: transformers
pipeline_tag: {task}
---

# {name}

A {arch} ({params:,} parameters, {dtype}) exported from the zoo model folder `{src}` by
`launch/convert.py zoo-to-hf`. The weights are zoo's, unchanged except for layout (the fused QKV split into
query, key and value; HF's naming).

```python
from transformers import {auto}, AutoTokenizer

model = {auto}.from_pretrained("{name}")
tokenizer = AutoTokenizer.from_pretrained("{name}")  # if tokenizer files were present in the zoo folder
```

Check it against the zoo folder with `launch/convert.py verify --hf {name} --zoo {src}`.
"""
TASKS = {None: ("feature-extraction", "AutoModel"), "mlm": ("fill-mask", "AutoModelForMaskedLM"),
         "mlm+nsp": ("fill-mask", "AutoModelForPreTraining"),
         "classification": ("text-classification", "AutoModelForSequenceClassification")}


def zoo_to_hf_bert(src, out, *, dtype: torch.dtype | None = None,
                   max_shard_bytes: int = io.DEFAULT_SHARD_BYTES) -> Path:
    """Write the zoo bert / bert-classifier folder ``src`` as a HF folder ``out`` of the class its head implies:
    safetensors (one file or sharded with an index), config.json, tokenizer files, README.md. Streams one block
    at a time."""
    src = Path(src)
    _, cfg, head = zoo_bert_config(src)
    arch = ARCHITECTURES[ARCH_OF[head]]
    files, shapes = zoo_weights(src)
    pooler = head is None and f"{cfg.num_hidden_layers + 1}.pooler.dense.weight" in shapes
    groups = arch.groups(cfg, prefix=PREFIX if head is not None else "", pooler=pooler)
    check_zoo_rows(groups, shapes, src)
    labels = _labels(src, cfg) if head == "classification" else {}
    final = Path(out)
    staging, out_dtype = export_rows(src, final, groups, files, dtype, max_shard_bytes=max_shard_bytes)
    task, auto = TASKS[head]
    params = cfg.num_parameters("pooler" if pooler else head)
    card = MODEL_CARD.format(name=final.name, arch=arch.name, params=params, task=task, auto=auto,
                             dtype=str(out_dtype).replace("torch.", ""), src=src)
    return finish(src, staging, final, arch.to_hf(cfg, out_dtype, labels), card)


# ---------------------------------------------------------------------------------------------------------------
# verify: the encoder's last hidden state or its head's logits
# ---------------------------------------------------------------------------------------------------------------

# Fields that make two BERTs different models (others, e.g. eps, show up as a difference).
BERT_STRUCTURE = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                  "max_position_embeddings", "type_vocab_size", "num_labels")


def check_bert_zoo(zoo, tp: int, pp: int) -> tuple[BertConfig, str | None]:
    """The zoo folder's config and head, and whether (tp, pp) can hold it; on every rank, before any process group."""
    _, cfg, head = zoo_bert_config(zoo)
    verify.check_layout(cfg, tp, pp)
    return cfg, head


def check_bert_hf(hf, cfg: BertConfig, head: str | None, *, allow_pickle: bool = False):
    """``(folder, architecture)`` of the HF side, checked to be the class of ``head`` with ``cfg``'s structure."""
    folder = model_folder(resolve_hf_folder(hf, allow_pickle=allow_pickle))
    shapes = BertCheckpoint(folder, allow_pickle).shapes  # refuses a pickle checkpoint without allow_pickle
    arch, hf_cfg = read_hf_config(folder, shapes)
    if HEAD_OF[arch] != head:
        raise ConvertError(f"{hf} is a {arch}; the zoo folder's head {head!r} exports as "
                           f"{ARCH_OF[head]}")
    theirs = bert_config_from_hf(arch, hf_cfg)
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


def zoo_bert_outputs(zoo, cfg: BertConfig, head: str | None, tp: int, pp: int, inputs, stream: bool = False) \
        -> list | None:
    """What the zoo model of ``head`` outputs at (tp, pp), fp32, on global rank 0 (None elsewhere): the last hidden
    state ``[b, s, h]``; MLM logits ``[b, s, vocab_size]`` (gathered over TP, padding cut); then NSP logits
    ``[b, 2]``; or classification logits ``[b, num_labels]``. ``stream`` (pp 1): one layer in memory at a time."""
    from deepspeed.accelerator import get_accelerator

    from zoo.models.bert import layer_specs as bert_layer_specs
    from zoo.models.specs import SpecSequential, build_pipeline
    from zoo.parallel.mappings import gather_from_tensor_model_parallel_region

    device = get_accelerator().current_device_name()
    grid = initialize_model_parallel(tp, pp)
    specs = bert_layer_specs(cfg, ParallelOptions(tp_group=grid.tp_group), head)
    inputs = tuple(t.to(device) for t in inputs)
    if stream:  # as the GPT's: the word embeddings and the tied decoder never whole in memory
        present, renumbered = torch.unique(inputs[0], return_inverse=True)
        small = bert_layer_specs(replace(cfg, vocab_size=len(present)), ParallelOptions(tp_group=grid.tp_group), head)
        out = verify.streamed_embedding(zoo, small, present, (renumbered, *inputs[1:]), grid.tp_group, device)
        decoder = len(specs) - 2 if head in ("mlm", "mlm+nsp") else None  # then BertMLMBias, the last layer
        out = verify.streamed_forward(specs, zoo, out, grid.tp_group, device=device,
                                      layers=range(1, decoder or len(specs)))
        if decoder is not None:
            x, *rest = out if isinstance(out, tuple) else (out,)
            out = verify.streamed_vocab_linear(specs, decoder, zoo, x, grid.tp_group, device)
            out = verify.streamed_forward(specs, zoo, (out, *rest) if rest else out, grid.tp_group, device=device,
                                          layers=range(decoder + 1, len(specs)))
    else:
        # No stage boundary inside the MLM head: stages split at BertLayers (zoo/models/bert.py).
        module = build_pipeline(specs, grid, loss_fn=None, partition_method="type:BertLayer") if pp > 1 \
            else SpecSequential(specs)
        io.load_model(zoo, module, grid.tp_group)
        module.to(device).eval()
        out = verify.pipeline_forward_tuple(module, inputs, grid, device)
    outs = None
    with torch.no_grad():
        if out is not None:
            outs = list(out) if isinstance(out, tuple) else [out]
            if head in ("mlm", "mlm+nsp"):  # [b, s, V_padded / tp] -> [b, s, vocab_size]
                outs[0] = gather_from_tensor_model_parallel_region(outs[0], grid.tp_group)[..., : cfg.vocab_size]
            outs = [o.float() for o in outs]
    count = 2 if head == "mlm+nsp" else 1
    moved = [verify.to_rank0(outs[i] if outs is not None else None, grid, device) for i in range(count)]
    return None if moved[0] is None else moved


def hf_bert_outputs(folder, arch: str, inputs, *, allow_pickle: bool = False, max_memory: int | None = None,
                    device_map: dict | None = None) -> list:
    """transformers' outputs matching :func:`zoo_bert_outputs`, fp32 (``max_memory``, ``device_map``: see
    ``verify.run_hf``)."""
    import transformers

    return verify.run_hf(getattr(transformers, arch), folder, lambda model: _bert_outputs(model, arch, inputs),
                         allow_pickle=allow_pickle, max_memory=max_memory, device_map=device_map)


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
                allow_pickle: bool = False, max_memory: int | None = None, **_) -> verify.Verification:
    """max |zoo - HF| over the outputs of the zoo folder's head (see :func:`zoo_bert_outputs`) on the fixed padded
    batch (and with ``max_memory`` the HF device map). Collective, as ``verify.verify``."""
    cfg, head = check_bert_zoo(zoo, tp, pp)
    initialize_model_parallel(tp, pp)
    folder, arch = verify.on_rank0(lambda: check_bert_hf(hf, cfg, head, allow_pickle=allow_pickle)) or (None, None)
    inputs = bert_inputs(cfg, batch, seq, seed)
    ours = zoo_bert_outputs(zoo, cfg, head, tp, pp, inputs, stream=max_memory is not None)

    def theirs(device_map):
        return hf_bert_outputs(folder, arch, inputs, allow_pickle=allow_pickle, max_memory=max_memory,
                               device_map=device_map), None

    return verify.compare_on_rank0(ours, theirs, max_memory)


class BertConverter:
    """The BERT families in the convert registry: import, export, verify (streams)."""

    name = FAMILY
    streams = True  # verify --max-memory
    expert_parallel = False

    @staticmethod
    def import_hf(folder, out, *, dtype=None, allow_pickle=False, max_shard_bytes=io.DEFAULT_SHARD_BYTES):
        return hf_to_zoo_bert(folder, out, dtype=dtype, allow_pickle=allow_pickle, max_shard_bytes=max_shard_bytes)

    @staticmethod
    def export(src, out, *, dtype=None, max_shard_bytes=io.DEFAULT_SHARD_BYTES, **_):
        return zoo_to_hf_bert(src, out, dtype=dtype, max_shard_bytes=max_shard_bytes)

    verify = staticmethod(verify_bert)


FAMILIES = {family: BertConverter() for family in FAMILIES_READ}  # zoo.convert.registry

"""HuggingFace <-> zoo for BERT: BertModel, BertForMaskedLM, BertForPreTraining, BertForSequenceClassification.

One key table of ``Row(zoo key, HF keys, HF shapes, to_zoo, to_hf)`` (``zoo.convert.hf_gpt.Row``, torchtitan's
style): ``{}`` is the block index, ``i + 1`` on zoo's side (layer 0 is the embedding) and ``i`` on HF's side. The
one transform: HF's separate query, key and value projections are fused into zoo's ``attention.qkv`` head by head
(``[q_0; k_0; v_0; q_1; ...]``, ``hf_gpt.qkv_groups`` with one key-value group per head). Everything is data
movement, so HF -> zoo -> HF is bit-exact; the table is checked against transformers' logits
(tests/convert/test_hf_bert.py, tests/models/test_bert.py).

Architecture <-> zoo family and head (``zoo.models.bert.layer_specs(config, par, head)``):

    BertModel                       family "bert",            head None   (its pooler kept aside: see below)
    BertForMaskedLM                 family "bert",            head "mlm"
    BertForPreTraining              family "bert",            head "mlm+nsp"
    BertForSequenceClassification   family "bert-classifier", head "classification"

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

Refused, one line each: other architectures; hidden_act other than the exact (erf) gelu; relative position
embeddings; decoders or cross-attention; an MLM decoder not tied to the word embedding; missing, misshapen or unknown
tensors; pickle checkpoints without ``allow_pickle``; a zoo folder of another family.
Notation: h hidden, f intermediate, V vocabulary (unpadded), P positions, T token types, L blocks.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import torch

from zoo.convert import io
from zoo.convert.hf_gpt import (
    ConvertError,
    HFCheckpoint,
    Row,
    _check_shapes,
    blocks,
    check_zoo_rows,
    export_rows,
    qkv_groups,
    qkv_ungroup,
    read_hf_meta,
    resolve_hf_folder,
    same,
    zoo_weights,
)
from zoo.models.bert import HEADS, BertConfig

log = logging.getLogger(__name__)

HEAD_OF = {"BertModel": None, "BertForMaskedLM": "mlm", "BertForPreTraining": "mlm+nsp",
           "BertForSequenceClassification": "classification"}
SUPPORTED = tuple(HEAD_OF)
ARCH_OF = {head: arch for arch, head in HEAD_OF.items()}
FAMILIES = ("bert", "bert-classifier")
LABELS_FILE = "labels.json"
PREFIX = "bert."  # the encoder's prefix in every class with a head; BertModel's keys have none
# Not weights: old checkpoints' position-id buffer; HF's tied copies of the word embedding and the MLM bias.
IGNORED = re.compile(r"(embeddings\.position_ids|cls\.predictions\.decoder\.(weight|bias))$")
# Tensors of another BERT class, which this class does not load either (HF drops them with a warning).
OTHER_HEADS = re.compile(r"^((bert\.)?pooler\.|cls\.|classifier\.)")
# sentence-transformers' files beside the BertModel they wrap.
SENTENCE_TRANSFORMERS = ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json")


def family_of(head: str | None) -> str:
    return "bert-classifier" if head == "classification" else "bert"


# ---------------------------------------------------------------------------------------------------------------
# The key table
# ---------------------------------------------------------------------------------------------------------------


def bert_table(cfg: BertConfig, head: str | None, prefix: str = PREFIX, pooler: bool = False) -> list[Row]:
    """Every tensor of the zoo model of ``head`` (plus BertModel's pooler when ``pooler``). ``prefix`` is the
    encoder's on HF's side: "bert." in the classes with a head, "" in BertModel."""
    if head not in HEADS:
        raise ConvertError(f"unknown BERT head {head!r}; heads: {list(HEADS)}")
    h, f, V, P, T, L = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.max_position_embeddings, \
        cfg.type_vocab_size, cfg.num_hidden_layers
    heads = SimpleNamespace(head_dim=cfg.head_dim, num_attention_heads=cfg.num_attention_heads,
                            num_key_value_heads=cfg.num_attention_heads)  # BERT is MHA: one group per head

    def qkv(q, k, v):
        return qkv_groups(q, k, v, heads)  # [q_0; k_0; v_0; q_1; ...], so a TP split hands out whole heads

    def qkv_back(w):
        return qkv_ungroup(w, heads)

    p, e, layer = prefix, "tied_modules.embed", prefix + "encoder.layer.{}."
    sa = layer + "attention.self."

    def pair(zoo: str, hf: str, weight_shape: tuple, bias_shape: tuple) -> list[Row]:
        return [Row(f"{zoo}.weight", (f"{hf}.weight",), (weight_shape,), same, same),
                Row(f"{zoo}.bias", (f"{hf}.bias",), (bias_shape,), same, same)]

    table = [
        Row(f"{e}.word_embeddings.weight", (f"{p}embeddings.word_embeddings.weight",), ((V, h),), same, same),
        Row(f"{e}.position_embeddings.weight", (f"{p}embeddings.position_embeddings.weight",), ((P, h),), same, same),
        Row(f"{e}.token_type_embeddings.weight", (f"{p}embeddings.token_type_embeddings.weight",), ((T, h),), same,
            same),
        *pair(f"{e}.layer_norm", f"{p}embeddings.LayerNorm", (h,), (h,)),
        Row("{}.attention.qkv.weight", (sa + "query.weight", sa + "key.weight", sa + "value.weight"),
            ((h, h),) * 3, qkv, qkv_back),
        Row("{}.attention.qkv.bias", (sa + "query.bias", sa + "key.bias", sa + "value.bias"), ((h,),) * 3, qkv,
            qkv_back),
        *pair("{}.attention.dense", layer + "attention.output.dense", (h, h), (h,)),
        *pair("{}.post_attention_norm", layer + "attention.output.LayerNorm", (h,), (h,)),
        *pair("{}.mlp.fc1", layer + "intermediate.dense", (f, h), (f,)),
        *pair("{}.mlp.fc2", layer + "output.dense", (h, f), (h,)),
        *pair("{}.post_mlp_norm", layer + "output.LayerNorm", (h,), (h,)),
    ]
    top = f"{L + 1}"  # the head after the blocks
    if head in ("mlm", "mlm+nsp"):
        table += [*pair(f"{top}.dense", "cls.predictions.transform.dense", (h, h), (h,)),
                  *pair(f"{top}.layer_norm", "cls.predictions.transform.LayerNorm", (h,), (h,))]
    if head in ("mlm+nsp", "classification") or (head is None and pooler):
        table += pair(f"{top}.pooler.dense", f"{p}pooler.dense", (h, h), (h,))
    if head == "mlm+nsp":
        table += pair(f"{top}.seq_relationship", "cls.seq_relationship", (2, h), (2,))
    if head == "classification":
        table += pair(f"{top}.classifier", "classifier", (cfg.num_labels, h), (cfg.num_labels,))
    if head in ("mlm", "mlm+nsp"):  # layer L + 2 is the tied decoder (the word embedding); L + 3 its bias
        table.append(Row(f"{L + 3}.bias", ("cls.predictions.bias",), ((V,),), same, same))
    return table


def hf_rows(cfg: BertConfig, head: str | None, prefix: str = PREFIX, pooler: bool = False) -> list[Row]:
    """:func:`bert_table` with ``{}`` filled in for every block, in conversion order."""
    return [r for group in blocks(bert_table(cfg, head, prefix, pooler), cfg.num_hidden_layers) for r in group]


# ---------------------------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------------------------


def bert_config(fields: dict) -> BertConfig:
    """BertConfig from a dict, its validation errors as ConvertError (one line for the command line)."""
    try:
        return BertConfig.from_dict(fields)
    except (TypeError, ValueError) as e:
        raise ConvertError(str(e)) from None


def bert_config_from_hf(arch: str, c) -> BertConfig:
    """The BertConfig computing what the HF model computes; refuses (one line) what zoo's BERT cannot express."""

    def need(ok, msg):
        if not ok:
            raise ConvertError(f"{arch}: {msg}")

    need(c.hidden_act == "gelu", f"hidden_act {c.hidden_act!r} is not supported; zoo's BERT uses the exact (erf) gelu")
    kind = getattr(c, "position_embedding_type", None) or "absolute"
    need(kind == "absolute", f"position_embedding_type {kind!r} is not supported; zoo's BERT learns absolute positions")
    need(not getattr(c, "is_decoder", False), "is_decoder=True is not supported (zoo's BERT is an encoder)")
    need(not getattr(c, "add_cross_attention", False), "add_cross_attention=True is not supported")
    need(HEAD_OF[arch] not in ("mlm", "mlm+nsp") or getattr(c, "tie_word_embeddings", True),
         "tie_word_embeddings=False is not supported; zoo's MLM decoder is the word embedding")
    return bert_config(dict(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, intermediate_size=c.intermediate_size,
        max_position_embeddings=c.max_position_embeddings, type_vocab_size=c.type_vocab_size,
        layer_norm_eps=float(c.layer_norm_eps), hidden_dropout_prob=float(c.hidden_dropout_prob),
        attention_probs_dropout_prob=float(c.attention_probs_dropout_prob),
        classifier_dropout=getattr(c, "classifier_dropout", None), initializer_range=float(c.initializer_range),
        pad_token_id=c.pad_token_id, num_labels=c.num_labels))


def zoo_config_dict(cfg: BertConfig, head: str | None) -> dict:
    """What a zoo bert folder's config.json holds under "config": BertConfig's fields and the head."""
    return {**cfg.to_dict(), "head": head}


def _infer_head(family: str, names) -> str | None:
    """The head of a folder written without a "head" key, from its family and its tensors."""
    if family == "bert-classifier":
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
    try:
        family, meta = io.read_config(folder)
    except io.CheckpointError as e:
        raise ConvertError(str(e)) from None
    if family not in FAMILIES:
        raise ConvertError(f"{folder} holds a checkpoint of another family ({family!r}); expected one of "
                           f"{', '.join(FAMILIES)}")
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


def model_folder(folder: Path) -> Path:
    """The folder holding config.json: ``folder`` itself, or the Transformer module of an old sentence-transformers
    folder (``modules.json`` naming e.g. ``0_Transformer/``)."""
    if (folder / "config.json").is_file() or not (folder / "modules.json").is_file():
        return folder
    try:
        modules = json.loads((folder / "modules.json").read_text())
    except ValueError as e:
        raise ConvertError(f"{folder / 'modules.json'} is not valid JSON ({e})") from None
    for m in modules:
        if str(m.get("type", "")).endswith(".Transformer") and (folder / m.get("path", "") / "config.json").is_file():
            return folder / m["path"]
    return folder


def hf_architecture(folder) -> str | None:
    """The class a HF folder's config.json names (``architectures[0]``, else its ``model_type``), to pick an
    adapter by; None where there is no readable HF config.json (the adapter then says what is wrong)."""
    try:
        meta = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or "zoo_format" in meta:
        return None
    archs = meta.get("architectures") or []
    return archs[0] if archs else meta.get("model_type")


def architecture_of(meta: dict, where: str, keys=()) -> str:
    """The HF class of a BERT folder: ``architectures[0]``, or (model_type "bert" alone) what its tensors hold."""
    archs = meta.get("architectures") or []
    if archs:
        arch = archs[0]
    elif meta.get("model_type") == "bert":
        keys = set(keys)
        arch = "BertForPreTraining" if "cls.seq_relationship.weight" in keys else \
            "BertForMaskedLM" if "cls.predictions.bias" in keys else \
            "BertForSequenceClassification" if "classifier.weight" in keys else "BertModel"
    else:
        arch = meta.get("model_type") or "unknown"
    if arch not in SUPPORTED:
        from zoo.convert.hf_gpt import MODEL_TYPES
        from zoo.convert.hf_gpt import SUPPORTED as GPT

        if arch in GPT or arch in MODEL_TYPES:
            raise ConvertError(f"{where}: architecture {arch} is a checkpoint of another family (gpt); this "
                               f"converter reads {', '.join(SUPPORTED)}")
        raise ConvertError(f"{where}: architecture {arch} is not supported; supported: {', '.join(SUPPORTED)}")
    return arch


def read_hf_config(folder: Path, keys=()):
    """``(architecture, transformers BertConfig)`` of a HF BERT folder (no remote code is ever run)."""
    meta = read_hf_meta(folder)
    arch = architecture_of(meta, str(folder / "config.json"), keys)
    from transformers import BertConfig as HFBertConfig

    return arch, HFBertConfig.from_dict(meta)


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

    Family "bert" (head None, "mlm", "mlm+nsp") or "bert-classifier" (head "classification", labels in
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
    rows = hf_rows(cfg, head, prefix, pooler)
    _check_shapes(rows, ckpt.shapes, str(folder))
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

    def tensors():
        for group in blocks(bert_table(cfg, head, prefix, pooler), cfg.num_hidden_layers):
            values = ckpt.read([k for r in group for k in r.hf])
            for row in group:
                t = row.to_zoo(*(values.pop(k) for k in row.hf))
                yield row.zoo, t if dtype is None else t.to(dtype)

    extra_files = {}
    if head == "classification":
        labels = {"id2label": {str(i): name for i, name in sorted(hf_cfg.id2label.items())},
                  "label2id": dict(hf_cfg.label2id), "problem_type": getattr(hf_cfg, "problem_type", None)}
        extra_files[LABELS_FILE] = json.dumps(labels, indent=2)
    return io.write_model_folder(out, family_of(head), zoo_config_dict(cfg, head), tensors(), tokenizer_dir=folder,
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


def hf_config_from_bert(cfg: BertConfig, arch: str, dtype: torch.dtype, labels: dict):
    """The transformers BertConfig (``architectures`` set) for a zoo BERT."""
    from transformers import BertConfig as HFBertConfig

    c = HFBertConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
                     num_attention_heads=cfg.num_attention_heads, intermediate_size=cfg.intermediate_size,
                     max_position_embeddings=cfg.max_position_embeddings, type_vocab_size=cfg.type_vocab_size,
                     layer_norm_eps=cfg.layer_norm_eps, hidden_dropout_prob=cfg.hidden_dropout_prob,
                     attention_probs_dropout_prob=cfg.attention_probs_dropout_prob,
                     classifier_dropout=cfg.classifier_dropout, initializer_range=cfg.initializer_range,
                     pad_token_id=cfg.pad_token_id, hidden_act="gelu", tie_word_embeddings=True,
                     architectures=[arch], **labels)
    c.dtype = dtype
    return c


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
    arch = ARCH_OF[head]
    files, shapes = zoo_weights(src)
    pooler = head is None and f"{cfg.num_hidden_layers + 1}.pooler.dense.weight" in shapes
    groups = list(blocks(bert_table(cfg, head, PREFIX if head is not None else "", pooler), cfg.num_hidden_layers))
    check_zoo_rows(groups, shapes, src)
    labels = _labels(src, cfg) if head == "classification" else {}
    final = Path(out)
    staging, out_dtype = export_rows(src, final, groups, files, dtype, max_shard_bytes=max_shard_bytes)
    hf_config_from_bert(cfg, arch, out_dtype, labels).save_pretrained(staging)
    io.copy_tokenizer(src, staging)
    task, auto = TASKS[head]
    params = cfg.num_parameters("pooler" if pooler else head)
    (staging / "README.md").write_text(MODEL_CARD.format(name=final.name, arch=arch, params=params, task=task,
                                                         auto=auto, dtype=str(out_dtype).replace("torch.", ""),
                                                         src=src))
    io.publish(staging, final)
    return final

"""BertModel, BertForMaskedLM, BertForPreTraining, BertForSequenceClassification <-> zoo's BERT.

One key table for the four classes, the head deciding which rows follow the encoder (``{}`` is the block index):
the one transform fuses HF's separate query, key and value projections into zoo's ``attention.qkv`` head by head
(``[q_0; k_0; v_0; q_1; ...]``, ``tables.qkv_groups`` with one key-value group per head). Everything is data
movement, so HF -> zoo -> HF is bit-exact; checked against transformers' outputs (tests/convert/test_hf_bert.py,
tests/models/test_bert.py).

Class <-> zoo family and head (``zoo.models.bert.layer_specs(config, par, head)``):

    BertModel                       family bert,            head None   (its pooler kept aside: zoo.convert.bert)
    BertForMaskedLM                 family bert,            head "mlm"
    BertForPreTraining              family bert,            head "mlm+nsp"
    BertForSequenceClassification   family bert-classifier, head "classification"

Refused, one line each: hidden_act other than the exact (erf) gelu; relative position embeddings; decoders or
cross-attention; an MLM decoder not tied to the word embedding.
Notation: h hidden, f intermediate, V vocabulary (unpadded), P positions, T token types, L blocks.
"""

from __future__ import annotations

import re
from functools import partial
from types import SimpleNamespace

import torch

from zoo.convert.errors import ConvertError
from zoo.convert.hf.common import refusal, zoo_config
from zoo.convert.registry import Architecture
from zoo.convert.tables import Row, blocks, qkv_groups, qkv_ungroup, same
from zoo.models.bert import CLASSIFIER_FAMILY, FAMILY, HEADS, BertConfig

HEAD_OF = {"BertModel": None, "BertForMaskedLM": "mlm", "BertForPreTraining": "mlm+nsp",
           "BertForSequenceClassification": "classification"}
ARCH_OF = {head: arch for arch, head in HEAD_OF.items()}
MODEL_TYPE = "bert"  # every BERT class's model_type (a config.json without architectures reads as BertModel)
PREFIX = "bert."  # the encoder's prefix in every class with a head; BertModel's keys have none
# Not weights: old checkpoints' position-id buffer; HF's tied copies of the word embedding and the MLM bias.
IGNORED = re.compile(r"(embeddings\.position_ids|cls\.predictions\.decoder\.(weight|bias))$")
# Tensors of another BERT class, which this class does not load either (HF drops them with a warning).
OTHER_HEADS = re.compile(r"^((bert\.)?pooler\.|cls\.|classifier\.)")


def family_of(head: str | None) -> str:
    """The zoo family of a BERT with ``head``: the classifier's own, else the encoder's."""
    return CLASSIFIER_FAMILY if head == "classification" else FAMILY


def class_from_keys(keys) -> str:
    """The class a config.json with model_type "bert" and no ``architectures`` holds, from its tensors."""
    keys = set(keys)
    return "BertForPreTraining" if "cls.seq_relationship.weight" in keys else \
        "BertForMaskedLM" if "cls.predictions.bias" in keys else \
        "BertForSequenceClassification" if "classifier.weight" in keys else "BertModel"


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


def groups(cfg: BertConfig, head: str | None = None, prefix: str = PREFIX, pooler: bool = False, **_) \
        -> list[list[Row]]:
    return list(blocks(bert_table(cfg, head, prefix, pooler), cfg.num_hidden_layers))


# ---------------------------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------------------------


def bert_config(fields: dict) -> BertConfig:
    """BertConfig from a dict, its validation errors as ConvertError (one line for the command line)."""
    return zoo_config(BertConfig, fields)


def bert_config_from_hf(arch: str, c) -> BertConfig:
    """The BertConfig computing what the HF model computes; refuses (one line) what zoo's BERT cannot express."""

    need = refusal(arch)

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


def _to_hf(arch: str, cfg: BertConfig, dtype: torch.dtype, labels: dict):
    return hf_config_from_bert(cfg, arch, dtype, labels)


def _config_class():
    from transformers import BertConfig as HFBertConfig

    return HFBertConfig


ARCHITECTURES = {arch: Architecture(
    arch, family_of(head), _config_class, partial(bert_config_from_hf, arch), partial(groups, head=head),
    partial(_to_hf, arch), model_type=MODEL_TYPE if head is None else None, extra={"head": head})
    for arch, head in HEAD_OF.items()}

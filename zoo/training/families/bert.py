"""The BERT families in the training run (zoo/models/bert.py): pretraining and sequence classification.

``bert``: masked-LM + next-sentence-prediction pretraining, always with the ``"mlm+nsp"`` head (BERT's
``BertForPreTraining``); the data are sentence pairs from zoo/data/bert_dataset.py:

    data.source: embedded   the pydoc corpus with a WordPiece vocabulary trained on it (data.tokenizer_vocab_size,
                            default model.vocab_size) or data.tokenizer when given (e.g. --init's), split into
                            sentences, cached in data.cache_dir
    data.source: indexed    data.paths: sentence-level Megatron files (preprocess_data.py --split-sentences) and
                            data.tokenizer (the HF tokenizer they were made with: special ids, vocabulary)
    data.source: synthetic  random token pairs with padding (tests)

Metrics per step and per evaluation: ``mlm_accuracy`` (argmax over the full vocabulary at the masked positions) and
``nsp_accuracy``, from the loss's running sums (``stats()``), reduced over every rank by the loop.

``bert-classifier``: the ``"classification"`` head on ``data.source: classification`` (``data.paths: [FILE]``, a
csv or jsonl with ``text``, optional ``text_pair``, ``label``; ``data.valid_paths: [FILE]`` or ``valid_fraction``
of the rows held out). ``model.num_labels`` must equal the training file's number of labels (ids in sorted label
order). Metrics: ``accuracy`` and macro ``f1``. ``zoo/finetune/bert.py`` is the entry point: it sets
num_labels, and initializes from a pretrained zoo BERT folder with :func:`write_classifier_init` (the encoder and
pooler from the folder, a new classifier head).

Pipelines (pp > 1) need ``parallel.partition_method: type:BertLayer`` so that no stage boundary falls inside the
MLM head (zoo/models/bert.py); sequence parallelism is not implemented for BERT. Both are refused before start.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from zoo.models.bert import CLASSIFIER_FAMILY, FAMILY
from zoo.training.families import Data, Family, prepare_once

PRETRAINING_SOURCES = ("embedded", "indexed", "synthetic")
CLASSIFICATION_SOURCE = "classification"
PIPELINE_PARTITION = "type:BertLayer"
LABELS_FILE = "labels.json"  # zoo.convert.bert's name for a classifier's label names beside the weights


# ---------------------------------------------------------------------------------------------------------------
# Losses with metric sums
# ---------------------------------------------------------------------------------------------------------------


def vocab_parallel_argmax(logits_shard: torch.Tensor, vocab_size: int, tp_group) -> torch.Tensor:
    """Argmax over the full (unpadded) vocabulary of vocab-sharded logits ``[m, V/tp]`` -> ``[m]`` global ids.

    Each rank takes its shard's maximum (padding columns excluded), then the ranks' ``(value, id)`` pairs are
    gathered and the best kept; ties go to the lowest id, as ``argmax`` on the full row. Collective over TP.
    """
    from zoo.parallel.mappings import gather_from_tensor_model_parallel_region
    from zoo.parallel.topology import group_rank_and_size

    rank, _ = group_rank_and_size(tp_group)
    start = rank * logits_shard.shape[-1]
    ids = torch.arange(start, start + logits_shard.shape[-1], device=logits_shard.device)
    values, local = logits_shard.float().masked_fill(ids >= vocab_size, float("-inf")).max(dim=-1)
    values = gather_from_tensor_model_parallel_region(values.unsqueeze(-1), tp_group)  # [m, tp]
    best = gather_from_tensor_model_parallel_region((local + start).unsqueeze(-1), tp_group)  # [m, tp]
    return best.gather(-1, values.argmax(dim=-1, keepdim=True)).squeeze(-1)


class BertPretrainingLoss:
    """``BertMLMLoss`` (masked-LM + NSP) that also sums correct/total masked tokens and NSP labels for ``stats()``."""

    KEYS = ("mlm_correct", "mlm_total", "nsp_correct", "nsp_total")

    def __init__(self, config, tp_group=None):
        from zoo.models.bert import BertMLMLoss

        self.loss = BertMLMLoss(config, tp_group)
        self.vocab_size = config.vocab_size
        self.sums = dict.fromkeys(self.KEYS, 0.0)

    def __call__(self, outputs, labels):
        loss = self.loss(outputs, labels)
        (logits, nsp_logits), (mlm_labels, nsp_labels) = outputs, labels
        with torch.no_grad():
            chosen = mlm_labels != self.loss.ignore_index
            n = int(chosen.sum())
            if n:  # the same on every TP rank (same labels), so the collective inside is entered by all or none
                predicted = vocab_parallel_argmax(logits[chosen], self.vocab_size, self.loss.tp_group)
                self.sums["mlm_correct"] += (predicted == mlm_labels[chosen]).sum()
                self.sums["mlm_total"] += n
            self.sums["nsp_correct"] += (nsp_logits.argmax(dim=-1) == nsp_labels).sum()
            self.sums["nsp_total"] += nsp_labels.numel()
        return loss

    def stats(self) -> dict:
        """The sums since the last call, as floats (device tensors until here: one sync per call, not per batch)."""
        out, self.sums = self.sums, dict.fromkeys(self.KEYS, 0.0)
        return {k: float(v) for k, v in out.items()}


class BertClassifierLoss:
    """Mean cross entropy over the samples whose label is not -100 (validation padding), plus per-class sums of
    true positives, false positives and false negatives (``tp_k``, ``fp_k``, ``fn_k``) and correct/total."""

    def __init__(self, config, ignore_index: int = -100):
        self.num_labels, self.ignore_index = config.num_labels, ignore_index
        per_class = (f"{kind}_{k}" for k in range(self.num_labels) for kind in ("tp", "fp", "fn"))
        self.keys = ("correct", "total", *per_class)
        self.sums = dict.fromkeys(self.keys, 0.0)

    def __call__(self, logits, labels):
        import torch.nn.functional as F

        keep = labels != self.ignore_index
        losses = F.cross_entropy(logits.float(), labels.masked_fill(~keep, 0), reduction="none")
        loss = (losses * keep).sum() / keep.sum().clamp(min=1)
        with torch.no_grad():
            y, pred = labels[keep], logits[keep].argmax(dim=-1)
            self.sums["correct"] += (pred == y).sum()
            self.sums["total"] += y.numel()
            for k in range(self.num_labels):
                self.sums[f"tp_{k}"] += ((pred == k) & (y == k)).sum()
                self.sums[f"fp_{k}"] += ((pred == k) & (y != k)).sum()
                self.sums[f"fn_{k}"] += ((pred != k) & (y == k)).sum()
        return loss

    def stats(self) -> dict:
        """The sums since the last call, as floats (device tensors until here: one sync per call, not per batch)."""
        out, self.sums = self.sums, dict.fromkeys(self.keys, 0.0)
        return {k: float(v) for k, v in out.items()}


def classification_metrics(sums: dict) -> dict:
    """``accuracy`` and macro ``f1`` from summed counts. F1 per class is 2tp / (2tp + fp + fn); the macro mean
    runs over the classes that occur among the labels or the predictions (as scikit-learn's default)."""
    out = {}
    if sums.get("total"):
        out["accuracy"] = sums["correct"] / sums["total"]
    f1s = []
    k = 0
    while f"tp_{k}" in sums:
        denom = 2 * sums[f"tp_{k}"] + sums[f"fp_{k}"] + sums[f"fn_{k}"]
        if denom > 0:
            f1s.append(2 * sums[f"tp_{k}"] / denom)
        k += 1
    if f1s:
        out["f1"] = sum(f1s) / len(f1s)
    return out


# ---------------------------------------------------------------------------------------------------------------
# FLOPs and the universal checkpoint
# ---------------------------------------------------------------------------------------------------------------


def encoder_flops_per_token(config, seq_length: int) -> float:
    """Forward FLOPs of the encoder per token (a multiply-add is 2 FLOPs), Megatron's count for a bidirectional
    encoder: per layer 6h^2 (QKV) + 2h^2 (attention output) + 4sh (scores QK^T over all s keys and the weighted sum
    of V) + 4hf (MLP). With f = 4h training (x3) gives Megatron's 72 s l h^2 (1 + s/6h) per sequence."""
    h, f, s = config.hidden_size, config.intermediate_size, seq_length
    return config.num_hidden_layers * (6 * h * h + 2 * h * h + 4 * s * h + 4 * h * f)


def training_flops_per_sample(config, seq_length: int, head: str, recompute: bool = False) -> float:
    """Training FLOPs of one sequence: 3 forwards (backward = 2) plus one more of every block when recomputing.

    Heads: ``"mlm+nsp"`` adds the MLM transform 2h^2 and the tied decoder 2hV at every position (this model computes
    the logits everywhere, not only at the masked positions) and the pooler + NSP layer once per sequence;
    ``"classification"`` adds the pooler and classifier once.
    """
    h, s = config.hidden_size, seq_length
    encoder = s * encoder_flops_per_token(config, s)
    if head == "mlm+nsp":
        head_flops = s * (2 * h * h + 2 * h * config.vocab_size) + 2 * h * h + 2 * h * 2
    else:
        head_flops = 2 * h * h + 2 * h * config.num_labels
    return 3 * (encoder + head_flops) + (encoder if recompute else 0)


def universal_checkpoint_info(config, head: str) -> dict:
    """How each BERT parameter is split over TP, as DeepSpeed's universal checkpoint needs it (names
    ``<layer_idx>.<param>``, matched with ``re.match``; every pattern must match something).

    Column-parallel (qkv, fc1 and their biases, the MLM decoder bias) are joined on dim 0, DeepSpeed's default;
    row-parallel weights (attention output, fc2) on dim 1; the word embedding is the vocabulary parameter (its TP
    padding is stripped and re-added). Everything else is replicated: position and token-type embeddings, every
    LayerNorm, the row-parallel biases and the whole head layer ``L+1`` (MLM transform, pooler, NSP or classifier).

    Limitation: the MLM decoder bias is 1-D and padded like the vocabulary, but DeepSpeed strips vocabulary padding
    only from 2-D tensors; a resume across layouts therefore needs the same padded vocabulary at both TP sizes
    (``BertConfig.padded_vocab_size(tp)``; true for the tiny preset, not for 30522 at tp 1 vs 2).
    """
    L = config.num_hidden_layers
    embed = r"(tied_modules\.embed|0)"
    info = {
        "tp_replicated_parameter_patterns": [
            rf"{embed}\.position_embeddings\.", rf"{embed}\.token_type_embeddings\.", rf"{embed}\.layer_norm\.",
            r"\d+\.post_attention_norm\.", r"\d+\.post_mlp_norm\.", r"\d+\.attention\.dense\.bias",
            r"\d+\.mlp\.fc2\.bias", rf"{L + 1}\.",
        ],
        "parameter_with_row_parallelism_patterns": [r"\d+\.attention\.dense\.weight", r"\d+\.mlp\.fc2\.weight"],
        "vocabulary_parameter_patterns": [rf"{embed}\.word_embeddings\.weight"],
        "original_vocab_size": config.vocab_size,
    }
    if head == "mlm+nsp":  # the word embedding is also the decoder on the last stage
        info["pipeline_replicated_parameter_patterns"] = [r"tied_modules\.embed\."]
    return info


# ---------------------------------------------------------------------------------------------------------------
# Shared checks
# ---------------------------------------------------------------------------------------------------------------


def _check_layout(cfg, model) -> None:
    par, tr = cfg.parallel, cfg.training
    if tr.seq_length > model.max_position_embeddings:
        raise ValueError(f"training.seq_length {tr.seq_length} exceeds the model's max_position_embeddings "
                         f"{model.max_position_embeddings}")
    if tr.seq_length < 5:
        raise ValueError(f"training.seq_length {tr.seq_length} leaves no room for [CLS] A [SEP] B [SEP]; use >= 5")
    if par.sequence_parallel:
        raise ValueError("BERT does not implement sequence parallelism; set parallel.sequence_parallel: false")
    if par.pp > 1 and par.partition_method != PIPELINE_PARTITION:
        raise ValueError(f"BERT with pp={par.pp} needs parallel.partition_method: {PIPELINE_PARTITION} (keeps the "
                         f"embedding on the first stage and the whole head on the last), got "
                         f"{par.partition_method!r}")


def _open_tokenizer(path, model, what="data.tokenizer"):
    from zoo.data.bert_dataset import special_tokens_of
    from zoo.data.tokenizer import load_tokenizer

    try:
        tok = load_tokenizer(path)
        special = special_tokens_of(tok)
    except (OSError, ValueError) as e:
        raise ValueError(f"{what}: {e}") from None
    if len(tok) > model.vocab_size:
        raise ValueError(f"tokenizer {path} has {len(tok)} tokens but the model's vocab_size is {model.vocab_size}; "
                         f"set model.vocab_size >= {len(tok)}")
    if model.pad_token_id is not None and model.pad_token_id != special.pad:
        raise ValueError(f"tokenizer {path} pads with id {special.pad}, the model's pad_token_id is "
                         f"{model.pad_token_id}; set model.pad_token_id={special.pad}")
    return tok, special


class _BertBase(Family):
    checkpointable_layers = ("BertLayer",)
    init_overridable = ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout")
    head = "mlm+nsp"

    @property
    def config_class(self):
        from zoo.models.bert import BertConfig

        return BertConfig

    def config_from_dict(self, d: dict):
        """A zoo folder's config; ``zoo.convert.bert`` also records the folder's head there, which is dropped."""
        return self.config_class.from_dict({k: v for k, v in d.items() if k != "head"})

    def layer_specs(self, config, par):
        from zoo.models.bert import layer_specs

        return layer_specs(config, par, head=self.head)

    def universal_checkpoint_info(self, config):
        return universal_checkpoint_info(config, self.head)

    def training_flops_per_sample(self, cfg, config):
        return training_flops_per_sample(config, cfg.training.seq_length, self.head,
                                         cfg.parallel.activation_checkpointing)


# ---------------------------------------------------------------------------------------------------------------
# bert: MLM + NSP pretraining
# ---------------------------------------------------------------------------------------------------------------


class BertFamily(_BertBase):
    name = FAMILY
    head = "mlm+nsp"

    def loss(self, config, par=None):
        return BertPretrainingLoss(config)

    def loss_label(self, cfg) -> str:
        return "masked-LM (nats/masked token) + next-sentence (nats/pair) cross entropy"

    def derive_metrics(self, stats):
        out = {}
        if stats.get("mlm_total"):
            out["mlm_accuracy"] = stats["mlm_correct"] / stats["mlm_total"]
        if stats.get("nsp_total"):
            out["nsp_accuracy"] = stats["nsp_correct"] / stats["nsp_total"]
        return out

    def validate(self, cfg, model) -> None:
        data = cfg.data
        _check_layout(cfg, model)
        if data.source not in PRETRAINING_SOURCES:
            raise ValueError(f"data.source {data.source!r} is not available for BERT pretraining; supported: "
                             f"{list(PRETRAINING_SOURCES)} (classification data: model.family bert-classifier)")
        if not 0.0 <= data.valid_fraction < 1.0:
            raise ValueError(f"data.valid_fraction must be in [0, 1), got {data.valid_fraction}")
        if data.source == "indexed":
            if not data.paths:
                raise ValueError("data.source indexed needs data.paths (prefixes of sentence-level .bin/.idx files, "
                                 "e.g. Megatron's preprocess_data.py --split-sentences), e.g. --set "
                                 "data.paths=[data/my-corpus_text_sentence]")
            if data.tokenizer is None:
                raise ValueError("data.source indexed needs data.tokenizer (the HF tokenizer folder the files were "
                                 "made with: BERT's special ids and vocabulary)")
            from zoo.data.bert_dataset import open_sentence_corpus
            from zoo.data.gpt_dataset import parse_blend

            for prefix in parse_blend([str(p) for p in data.paths])[1] + \
                    (parse_blend([str(p) for p in data.valid_paths])[1] if data.valid_paths else []):
                open_sentence_corpus(prefix)
        if data.tokenizer is not None:
            _open_tokenizer(data.tokenizer, model)
        if data.source == "embedded" and data.tokenizer is None:
            n = data.tokenizer_vocab_size or model.vocab_size
            if n > model.vocab_size:
                raise ValueError(f"data.tokenizer_vocab_size {n} exceeds the model's vocab_size {model.vocab_size}; "
                                 f"lower it or raise model.vocab_size")
            if n < 256:
                raise ValueError(f"the embedded corpus's WordPiece vocabulary needs at least 256 tokens, got {n}; "
                                 f"set model.vocab_size (or data.tokenizer_vocab_size) >= 256")
        if data.source == "synthetic" and model.vocab_size <= 5:
            raise ValueError(f"synthetic BERT data needs vocab_size > 5 (ids 0-4 are special), got {model.vocab_size}")

    def build_data(self, cfg, model, grid) -> Data:
        """Training and validation pairs; the embedded corpus is prepared once, by global rank 0."""
        from zoo.data.bert_dataset import SyntheticBertPairs, build_bert_datasets, prepare_embedded_bert_corpus

        data, tr = cfg.data, cfg.training
        if data.source == "synthetic":
            return Data(SyntheticBertPairs(model.vocab_size, tr.seq_length, seed=tr.seed),
                        SyntheticBertPairs(model.vocab_size, tr.seq_length, seed=tr.seed + 1), data.tokenizer)
        tokenizer, paths = data.tokenizer, data.paths
        if data.source == "embedded":
            prepared = prepare_once(prepare_embedded_bert_corpus, cfg, model, grid, tokenizer)
            tokenizer, paths = prepared["tokenizer"], [prepared["prefix"]]
        tok, special = _open_tokenizer(tokenizer, model)
        train, valid = build_bert_datasets([str(p) for p in paths], tr.seq_length, tr.seed, vocab_size=len(tok),
                                           special=special, valid_fraction=data.valid_fraction,
                                           valid_paths=[str(p) for p in data.valid_paths] if data.valid_paths
                                           else None)
        return Data(train, valid, tokenizer)

    def after_training(self, model_dir, log) -> None:
        """Top-3 fill-mask predictions of the exported model for one masked word of a held-out sentence."""
        result = fill_mask_example(model_dir)
        if result is not None:
            text, truth, top = result
            shown = ", ".join(f"{w!r} {p:.2f}" for w, p in top)
            log(f"fill-mask: {text!r} -> {shown} (masked word: {truth!r})")


def _run_config(model_dir: Path) -> dict:
    """The run's config.yaml beside its exported model (``<out>/model``), if there."""
    import yaml

    path = Path(model_dir).parent / "config.yaml"
    try:
        return yaml.safe_load(path.read_text()) or {}
    except (OSError, ValueError):
        return {}


def _held_out_sentence(model_dir: Path) -> str:
    """A sentence of a held-out document of the embedded corpus (when the run used it), else a fixed one."""
    run = _run_config(model_dir)
    data, seed = run.get("data") or {}, (run.get("training") or {}).get("seed", 0)
    if data.get("source") == "embedded":
        from zoo.data.bert_dataset import split_sentences
        from zoo.data.corpus import embedded_documents
        from zoo.data.gpt_dataset import split_document_ids

        docs = embedded_documents()
        _, valid = split_document_ids(len(docs), data.get("valid_fraction", 0.05) or 0.05, seed)
        for d in valid.tolist():
            for sentence in split_sentences(docs[d]):
                if 8 <= len(sentence.split()) <= 24 and sentence[0].isalpha():
                    return sentence
    return "The interpreter reads a line of input and then executes the statement it contains."


def load_exported(model_dir, head: str):
    """The exported model built in this process alone (plain, no TP), weights from the folder, in eval mode."""
    from zoo.convert.io import load_model, read_config
    from zoo.models.bert import BertConfig, layer_specs
    from zoo.models.gpt import ParallelOptions
    from zoo.models.specs import SpecSequential

    _, config = read_config(model_dir)
    cfg = BertConfig.from_dict({k: v for k, v in config.items() if k != "head"})
    model = SpecSequential(layer_specs(cfg, ParallelOptions(), head=head))
    load_model(model_dir, model)
    return cfg, model.eval()


def fill_mask_example(model_dir, k: int = 3):
    """``(masked text, masked word, [(word, probability)] * k)`` from the exported pretraining folder, or None
    without a tokenizer (synthetic data)."""
    from zoo.data.bert_dataset import special_tokens_of
    from zoo.data.tokenizer import load_tokenizer

    model_dir = Path(model_dir)
    if not any((model_dir / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json")):
        return None
    tok = load_tokenizer(model_dir)
    special = special_tokens_of(tok)
    cfg, model = load_exported(model_dir, "mlm+nsp")
    sentence = _held_out_sentence(model_dir)
    ids = tok(sentence, truncation=True, max_length=cfg.max_position_embeddings)["input_ids"]
    tokens = tok.convert_ids_to_tokens(ids)
    words = [i for i, t in enumerate(tokens) if t.isalpha() and len(t) > 2 and ids[i] not in special.ids
             and not (i + 1 < len(tokens) and tokens[i + 1].startswith("##"))]
    if not words:
        return None
    at = words[len(words) // 2]
    truth = tokens[at]
    ids[at] = special.mask
    x = torch.tensor([ids])
    with torch.no_grad():
        mlm_logits, _ = model((x, torch.zeros_like(x), torch.ones_like(x)))
    probs = mlm_logits[0, at, :len(tok)].float().softmax(-1)
    probs[list(special.ids)] = 0.0
    top = probs.topk(k)
    return (tok.decode(ids[1:-1]), truth,
            [(tok.convert_ids_to_tokens(int(i)), float(p)) for p, i in zip(top.values, top.indices)])


# ---------------------------------------------------------------------------------------------------------------
# bert-classifier: sequence classification
# ---------------------------------------------------------------------------------------------------------------


def classification_tables(cfg):
    """``(train table, valid table or None, label names)`` of a classification run's files; ValueError (one line)
    for a missing label column, a validation label the training file lacks, and the like."""
    from zoo.data.bert_dataset import check_labels, label_names, read_classification_file

    data = cfg.data
    if not data.paths or len(data.paths) != 1:
        raise ValueError(f"data.source {CLASSIFICATION_SOURCE} needs data.paths: [TRAIN_FILE] (one csv or jsonl file "
                         f"with text, label and optionally text_pair), got {data.paths!r}")
    if data.valid_paths is not None and len(data.valid_paths) != 1:
        raise ValueError(f"data.valid_paths takes one classification file, got {data.valid_paths!r}")
    train = read_classification_file(data.paths[0])
    names = label_names(train)
    valid = None
    if data.valid_paths:
        valid = read_classification_file(data.valid_paths[0])
        check_labels(valid, names)
    return train, valid, names


def _split_rows(n: int, fraction: float, seed: int):
    from zoo.data.gpt_dataset import split_document_ids

    if fraction == 0 or n < 2:
        return list(range(n)), []
    train, valid = split_document_ids(n, fraction, seed)
    return train.tolist(), valid.tolist()


def _subset(table, rows):
    from zoo.data.bert_dataset import ClassificationTable

    pick = lambda xs: None if xs is None else [xs[i] for i in rows]  # noqa: E731
    return ClassificationTable(table.path, pick(table.texts), pick(table.pairs), pick(table.labels))


class BertClassifierFamily(_BertBase):
    name = CLASSIFIER_FAMILY
    head = "classification"
    unit = "samples"

    def units_per_sample(self, cfg) -> int:
        return 1

    def loss(self, config, par=None):
        return BertClassifierLoss(config)

    def loss_label(self, cfg) -> str:
        return "cross entropy (nats/example)"

    def derive_metrics(self, stats):
        return classification_metrics(stats)

    def validate(self, cfg, model) -> None:
        data = cfg.data
        _check_layout(cfg, model)
        if data.source != CLASSIFICATION_SOURCE:
            raise ValueError(f"model.family bert-classifier reads data.source: {CLASSIFICATION_SOURCE} (data.paths: "
                             f"[FILE.csv or FILE.jsonl]), got {data.source!r}")
        if not 0.0 <= data.valid_fraction < 1.0:
            raise ValueError(f"data.valid_fraction must be in [0, 1), got {data.valid_fraction}")
        if data.tokenizer is None:
            raise ValueError("bert-classifier needs a tokenizer: initialize from a zoo BERT folder that holds one "
                             "(training.init_from / --init) or set data.tokenizer=DIR")
        _open_tokenizer(data.tokenizer, model)
        train, _, names = classification_tables(cfg)
        if len(names) < 2:
            raise ValueError(f"classification file {train.path} has a single label {names}; a classifier needs "
                             f"two at least")
        if model.num_labels != len(names):
            raise ValueError(f"model.num_labels is {model.num_labels} but {train.path} has {len(names)} labels "
                             f"{names[:10]}; set model.num_labels={len(names)} (zoo/finetune/bert.py sets "
                             f"it for you)")

    def build_data(self, cfg, model, grid) -> Data:
        """Encoded examples (every rank reads the small files itself); rank 0 warns about truncated examples."""
        data = self.classification_data(cfg, model)
        if data["truncated"] and grid.rank == 0:
            print(f"warning: {data['truncated']} of {data['examples']} example(s) are longer than training.seq_length "
                  f"{cfg.training.seq_length} tokens and were truncated (longest segment first); raise "
                  f"training.seq_length (at most max_position_embeddings {model.max_position_embeddings}) to keep "
                  f"them whole", file=sys.stderr, flush=True)
        return Data(data["train"], data["valid"], cfg.data.tokenizer)

    def classification_data(self, cfg, model) -> dict:
        """``{train, valid, labels, truncated, examples, valid_examples}``: the datasets and what was done."""
        from zoo.data.bert_dataset import ClassificationDataset, encode_classification

        tr = cfg.training
        tok, special = _open_tokenizer(cfg.data.tokenizer, model)
        train, valid, names = classification_tables(cfg)
        if valid is None:
            keep, held = _split_rows(len(train), cfg.data.valid_fraction, tr.seed)
            train, valid = _subset(train, keep), (_subset(train, held) if held else None)
        encoded, truncated = encode_classification(train, tok, tr.seq_length, names, special)
        out = {"train": ClassificationDataset(encoded, tr.seed), "valid": None, "labels": names,
               "examples": len(train), "valid_examples": 0}
        if valid is not None:
            v_encoded, v_truncated = encode_classification(valid, tok, tr.seq_length, names, special)
            out["valid"] = ClassificationDataset(v_encoded, tr.seed + 1, shuffle=False)
            out["valid_examples"] = len(valid)
            truncated += v_truncated
        out["truncated"] = truncated
        out["examples"] += out["valid_examples"]
        return out

    def after_training(self, model_dir, log) -> None:
        """The exported classifier's prediction for the first validation (else training) examples."""
        run = _run_config(model_dir)
        data = run.get("data") or {}
        files = data.get("valid_paths") or data.get("paths")
        if not files:
            return
        for text, label, p in classify_examples(model_dir, files[0], 3):
            log(f"classify: {text[:60]!r} -> {label!r} ({p:.2f})")


def read_labels(model_dir) -> list | None:
    path = Path(model_dir) / LABELS_FILE
    if not path.is_file():
        return None
    id2label = json.loads(path.read_text()).get("id2label") or {}
    return [id2label[str(i)] for i in range(len(id2label))]


def classify_examples(model_dir, path, n: int = 3) -> list[tuple[str, str, float]]:
    """``(text, predicted label, probability)`` of the exported classifier for the first ``n`` rows of ``path``."""
    from zoo.data.bert_dataset import encode_classification, read_classification_file, special_tokens_of
    from zoo.data.tokenizer import load_tokenizer

    table = read_classification_file(path)
    cfg, model = load_exported(model_dir, "classification")
    tok = load_tokenizer(model_dir)
    names = read_labels(model_dir) or [str(i) for i in range(cfg.num_labels)]
    rows = _subset(table, range(min(n, len(table))))
    enc, _ = encode_classification(rows, tok, cfg.max_position_embeddings, None, special_tokens_of(tok))
    with torch.no_grad():
        probs = model((enc["input_ids"], enc["token_type_ids"], enc["attention_mask"])).float().softmax(-1)
    best = probs.max(-1)
    return [(t, names[int(i)], float(p)) for t, p, i in zip(rows.texts, best.values, best.indices)]


# ---------------------------------------------------------------------------------------------------------------
# Initializing a classifier from a pretrained BERT: load what exists, initialize the rest
# ---------------------------------------------------------------------------------------------------------------


def write_classifier_init(src, out, config, *, seed: int, tokenizer_dir=None) -> dict:
    """A complete ``bert-classifier`` zoo folder ``out`` for ``config``, from the BERT folder ``src`` (family bert
    or bert-classifier, any head): ``io.load_model`` needs every parameter present, so the missing ones are made
    here, once, the way a fresh run would make them.

    - The embedding and the blocks (layers 0..L) must all be in ``src`` with the right shapes: they are copied.
    - The head layer L+1 (``pooler.dense``, ``classifier``) is built alone with the seed a fresh run gives that layer
      (``seed + L + 1``, as ``SpecSequential``/``PipelineModule`` seed layers); each of its tensors is taken from
      ``src`` when present with the same shape (the pooler of a pretraining checkpoint; a classifier of the same
      label count), else kept as initialized.
    - Everything else in ``src`` (MLM transform and bias, NSP layer) is dropped.

    Returns ``{"loaded": [...], "initialized": [...], "dropped": [...]}`` (tensor names). The head layer has no TP
    shards, so this needs no process group and works for any later layout.
    """
    from zoo.convert import io
    from zoo.models.bert import BertClassificationHead
    from zoo.models.gpt import ParallelOptions
    from zoo.models.specs import seed_layer

    L = config.num_hidden_layers
    head_prefix = f"{L + 1}."
    source = dict(io.iter_tensors(src))

    def is_encoder(name: str) -> bool:
        first = name.split(".", 1)[0]
        return name.startswith("tied_modules.embed.") or (first.isdigit() and 1 <= int(first) <= L)

    encoder = {k: v for k, v in source.items() if is_encoder(k)}
    if not any(k.startswith("tied_modules.embed.") for k in encoder) or \
            not all(any(k.startswith(f"{i}.") for k in encoder) for i in range(1, L + 1)):
        raise io.CheckpointError(f"{src} does not hold a BERT encoder of {L} layers (embedding tied_modules.embed.* "
                                 f"and layers 1..{L}); was it written for another model?")
    seed_layer(seed + L + 1)
    head = BertClassificationHead(config, ParallelOptions())
    loaded, initialized = sorted(encoder), []
    tensors = dict(encoder)
    for name, value in head.state_dict().items():
        key = head_prefix + name
        stored = source.get(key)
        if stored is not None and tuple(stored.shape) == tuple(value.shape):
            tensors[key] = stored
            loaded.append(key)
        else:
            tensors[key] = value.detach().clone()
            initialized.append(key)
    dropped = sorted(set(source) - set(tensors))
    io.write_model_folder(out, CLASSIFIER_FAMILY, config.to_dict(), sorted(tensors.items()),
                          tokenizer_dir=tokenizer_dir)
    return {"loaded": sorted(loaded), "initialized": sorted(initialized), "dropped": dropped}


FAMILIES = {FAMILY: BertFamily(), CLASSIFIER_FAMILY: BertClassifierFamily()}  # zoo.training.families.REGISTRY

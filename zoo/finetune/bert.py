"""Fine-tune a BERT for sequence classification, in any layout; the result as a zoo folder and a HF folder.

    python -m zoo.finetune.bert --init runs/bert-tiny/model --data train.csv --valid-data valid.csv
    torchrun --nproc_per_node 2 -m zoo.finetune.bert --init DIR --data train.jsonl --tp 2 --out runs/cls

The run is launch/train.py's (``zoo.training.trainer.Trainer``: tp/pp/dp/ZeRO, evaluation, checkpoints, exact resume)
with the ``bert-classifier`` family (zoo/training/families/bert.py). What this entry point adds:

- ``--data`` / ``--valid-data``: csv or jsonl with ``text``, optional ``text_pair`` and ``label``; without
  ``--valid-data`` a ``data.valid_fraction`` of the rows is held out. The labels are the training file's distinct
  values in sorted order; ``model.num_labels`` is set from them.
- ``--init DIR``: a zoo BERT folder (family ``bert``, e.g. launch/train.py's ``<out>/model``, or
  ``bert-classifier``), or a HuggingFace BERT folder (imported with ``zoo.convert.bert.hf_to_zoo_bert``). Its
  config is the model's and its tokenizer the run's. The encoder and pooler load; a classifier head of another
  shape is new (``families.bert.write_classifier_init`` writes ``<out>/init-model`` once, on global rank 0, which the
  run then loads in its own layout). Without ``--init``: the config's preset, randomly initialized, with
  ``--set data.tokenizer=DIR``.
- Evaluation covers the whole validation set every time (``eval_iters`` is derived from its size): ``val_accuracy``
  and ``val_f1`` (macro) in metrics.jsonl.
- At the end: ``<out>/model`` (zoo; ``labels.json`` holds ``id2label``/``label2id``) and ``<out>/hf``
  (``BertForSequenceClassification`` with the label names, via ``zoo.convert.bert.zoo_to_hf_bert``).

Bad input is one ``error: ...`` line and exit status 2 before any process group exists and before anything is
written: a missing file or column, a validation label the training file lacks, a single label, an init folder of
another family. Examples longer than ``training.seq_length`` (at most ``max_position_embeddings``) are truncated,
longest segment first, and counted in one warning.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

from zoo.finetune.common import add_finetune_flags, run_config
from zoo.models.bert import CLASSIFIER_FAMILY as FAMILY
from zoo.models.bert import FAMILY as ENCODER_FAMILY
from zoo.package import config_file
from zoo.training.config import ConfigError, RunConfig, validate
from zoo.training.run import RunParser, command, layout_line, process_group, say, start_run, train_and_save
from zoo.training.train import resume_plan
from zoo.training.trainer import Trainer

DEFAULT_CONFIG = config_file("bert/classify.yaml")
INIT_FAMILIES = (ENCODER_FAMILY, FAMILY)
# Fields a run may change in the model it initializes from (they do not change the weights' shapes or meaning).
INIT_OVERRIDABLE = ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout")


def parse_args(argv=None):
    p = RunParser("python -m zoo.finetune.bert", "Fine-tune a BERT for sequence classification.",
                  "Writes OUT/model (zoo) and OUT/hf (transformers' BertForSequenceClassification).")
    p.add_argument("--init", metavar="DIR",
                   help="the BERT to start from: a zoo folder (family bert or bert-classifier) or a HuggingFace BERT "
                        "folder; its tokenizer is used unless --set data.tokenizer=DIR. Default: the config's preset, "
                        "randomly initialized")
    p.add_argument("--data", required=True, metavar="FILE",
                   help="training examples, .csv or .jsonl with columns text, label and optionally text_pair")
    p.add_argument("--valid-data", metavar="FILE",
                   help="validation examples, same format (default: hold out data.valid_fraction of --data)")
    add_finetune_flags(p, DEFAULT_CONFIG, evaluation="evaluation (loss, accuracy, F1)",
                       sample="skip the predictions printed at the end")
    return p.parse_args(argv)


def config_from_args(args) -> RunConfig:
    return run_config(args, "classification", [args.data],
                      valid_paths=None if args.valid_data is None else [args.valid_data])


def init_source(src: str) -> tuple[str, dict, str | None]:
    """``(kind, BertConfig fields, tokenizer folder or None)`` of ``--init``: kind "zoo" or "hf"."""
    from zoo.convert import io

    folder = Path(src)
    if not folder.is_dir():
        raise ConfigError(f"--init {src}: the folder does not exist")
    has_tokenizer = any((folder / n).is_file() for n in io.TOKENIZER_FILES[:2])
    if io.is_model_folder(folder):
        try:
            family, config = io.read_config(folder)
        except io.CheckpointError as e:
            raise ConfigError(f"--init: {e}") from None
        if family not in INIT_FAMILIES:
            raise ConfigError(f"--init {src} holds a {family!r} model; fine-tuning a classifier needs a BERT "
                              f"(family {' or '.join(INIT_FAMILIES)})")
        return "zoo", {k: v for k, v in config.items() if k != "head"}, str(folder) if has_tokenizer else None
    try:
        from zoo.convert.bert import bert_config_from_hf, model_folder, read_hf_config
    except ImportError:
        raise ConfigError(f"--init {src} is not a zoo model folder (no zoo config.json), and this version cannot "
                          f"import HuggingFace BERT folders") from None
    try:
        arch, hf_cfg = read_hf_config(model_folder(folder))
        config = bert_config_from_hf(arch, hf_cfg).to_dict()
    except (ValueError, OSError) as e:
        raise ConfigError(f"--init {src}: {e}") from None
    return "hf", config, str(folder) if has_tokenizer else None


def validate_run(cfg: RunConfig, world_size: int) -> tuple:
    """The model config (``num_labels`` from the data), the label names and the init kind; checks everything that
    can be checked before a process group exists."""
    from zoo.training.families import get_family
    from zoo.training.families.bert import classification_tables

    if cfg.model.family != FAMILY:
        raise ConfigError(f"fine-tuning a classifier needs model.family {FAMILY}, got {cfg.model.family!r}")
    try:
        _, _, names = classification_tables(cfg)
    except (ValueError, OSError) as e:
        raise ConfigError(str(e)) from None
    src, kind = cfg.training.init_from, None
    if src is not None:
        kind, init_config, tokenizer = init_source(src)
        bad = sorted(set(cfg.model.overrides) - set(INIT_OVERRIDABLE))
        if bad:
            raise ConfigError(f"model fields {bad} cannot be set when initializing from {src}: the model comes from "
                              f"there (only {list(INIT_OVERRIDABLE)} may change)")
        cfg.model.preset = None
        cfg.model.overrides = {**init_config, **cfg.model.overrides, "num_labels": len(names)}
        if cfg.data.tokenizer is None:
            cfg.data.tokenizer = tokenizer
    else:
        cfg.model.overrides = {**cfg.model.overrides, "num_labels": len(names)}
    # The init folder is prepared after the process group exists (write_classifier_init); config.validate sees a
    # fresh model of the same config meanwhile.
    cfg.training.init_from = None
    try:
        model_cfg = validate(cfg, world_size)
    finally:
        cfg.training.init_from = src
    get_family(FAMILY)  # importable
    return model_cfg, names, kind


def prepare_init_folder(cfg: RunConfig, model_cfg, kind: str, grid, say) -> Path:
    """``<out>/init-model``: the classifier initialized from ``--init``, written once by global rank 0."""
    from zoo.parallel.shards import barrier
    from zoo.training.families.bert import write_classifier_init

    out = Path(cfg.out)
    folder = out / "init-model"
    if grid.rank == 0:
        src = Path(cfg.training.init_from)
        if kind == "hf":
            from zoo.convert.bert import hf_to_zoo_bert

            src = hf_to_zoo_bert(src, out / "init-imported")
        report = write_classifier_init(src, folder, model_cfg, seed=cfg.training.seed,
                                       tokenizer_dir=cfg.data.tokenizer)
        say(f"init from {cfg.training.init_from}: {len(report['loaded'])} tensors loaded, new: "
            f"{', '.join(report['initialized']) or 'none'}; not used: {len(report['dropped'])} "
            f"({', '.join(sorted({n.split('.', 1)[0] + '.' + n.split('.')[1] for n in report['dropped']})) or '-'})")
    barrier()
    return folder


def write_labels(model_dir: Path, names: list) -> None:
    """``labels.json`` beside the weights (zoo.convert.bert's convention), names as strings."""
    id2label = {str(i): str(name) for i, name in enumerate(names)}
    data = {"id2label": id2label, "label2id": {v: int(k) for k, v in id2label.items()},
            "problem_type": "single_label_classification"}
    tmp = model_dir / ".labels.json.tmp"
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, model_dir / "labels.json")


def export_hf(model_dir: Path, out: Path) -> Path | None:
    """``<out>/hf`` from ``<out>/model``; None (with a note) where zoo.convert.bert is not available."""
    try:
        from zoo.convert.bert import zoo_to_hf_bert
    except ImportError:
        return None
    return zoo_to_hf_bert(model_dir, out / "hf")


def plan(args, world_size: int) -> tuple:
    """``(run config, model config, resume, universal, label names, init kind)``, all checked before any process
    group exists."""
    cfg = config_from_args(args)
    model_cfg, names, kind = validate_run(cfg, world_size)
    return (cfg, model_cfg, *resume_plan(cfg, model_cfg, args), names, kind)


def run(args, cfg: RunConfig, model_cfg, resume, universal: bool, names: list, kind: str | None) -> int:
    from zoo.training.families import Data, get_family

    family = get_family(FAMILY)
    out, tr = Path(cfg.out), cfg.training
    with process_group(cfg) as grid:
        rank0 = grid.rank == 0
        data = family.classification_data(cfg, model_cfg)
        # Every evaluation covers the validation set once: ceil(N / global batch) batches (the tail is padding
        # samples with label -100, which the loss and the metrics skip).
        if data["valid"] is not None:
            tr.eval_iters = max(1, math.ceil(data["valid_examples"] / cfg.global_batch_size))
        warning = None if not data["truncated"] else (
            f"warning: {data['truncated']} of {data['examples']} example(s) are longer than training.seq_length "
            f"{tr.seq_length} tokens and were truncated (longest segment first); raise training.seq_length (at most "
            f"max_position_embeddings {model_cfg.max_position_embeddings}) to keep them whole")
        start_run(cfg, grid, f"zoo fine-tune ({FAMILY}) of {tr.init_from or 'a random ' + str(cfg.model.preset)}: "
                             f"{model_cfg.num_parameters('classification') / 1e6:.2f}M parameters | {len(names)} "
                             f"labels {[str(n) for n in names[:10]]} | {layout_line(cfg, grid)} | global batch "
                             f"{cfg.global_batch_size} x {tr.seq_length} tokens | {tr.precision} | "
                             f"{data['examples'] - data['valid_examples']} training, {data['valid_examples']} "
                             f"validation examples", warning)
        if tr.init_from is not None and resume is None:
            tr.init_from = str(prepare_init_folder(cfg, model_cfg, kind, grid, say))
        with Trainer(cfg, model_cfg, grid, Data(data["train"], data["valid"], cfg.data.tokenizer), log=say,
                     resume=resume, universal=universal, progress=True) as trainer:
            train_and_save(trainer)
    if not (rank0 and tr.save):
        return 0
    write_labels(out / "model", names)
    hf = export_hf(out / "model", out)
    where = f"HF model {hf} (AutoModelForSequenceClassification loads it)" if hf is not None else \
        "no HF export (zoo.convert.bert is not available)"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "val_accuracy" in r]
    if evals:
        first, last = evals[0], evals[-1]
        say(f"validation accuracy {first['val_accuracy']:.3f} (step {first['step']}) -> {last['val_accuracy']:.3f} "
            f"(step {last['step']}), macro F1 {last.get('val_f1', float('nan')):.3f}")
    say(f"done: zoo model {out / 'model'} | {where} | metrics {out / 'metrics.jsonl'}")
    if not args.no_sample:
        family.after_training(out / "model", say)
    return 0


def main(argv=None) -> int:
    return command(parse_args(argv), plan, run)


COMMANDS = {ENCODER_FAMILY: main, FAMILY: main}  # zoo.finetune.COMMANDS: either starts a classifier

if __name__ == "__main__":
    sys.exit(main())

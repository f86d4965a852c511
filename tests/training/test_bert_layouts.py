"""BERT pretraining (MLM + NSP) trains the same model in every (tp, pp, dp) layout as in one process.

Each run trains 3 steps (fp32, no dropout) on synthetic sentence pairs whose batches hold padding; losses must agree
with the single-process run within 1e-5 relative at every step, and the MLM/NSP accuracies (from the loss's sums
reduced over all ranks) must agree too. Then: a tp=2 checkpoint resumes at tp=1 x pp=2 through DeepSpeed's universal
checkpoint (BERT's own TP patterns), and launch/train.py runs the default config end to end on the embedded corpus.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.mains import run_main

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs/bert/tiny.yaml"
STEPS = 3
COMMON = [f"training.steps={STEPS}", "training.micro_batch_size=2", "training.global_batch_size=8",
          "training.seq_length=32", "training.lr=3e-3", "training.warmup_steps=1", "data.source=synthetic",
          "training.save=false", "training.eval_interval=0", "training.log_interval=1", "parallel.zero_stage=0",
          # Dropout masks are drawn per TP rank for sharded heads, so only a dropout-free run is layout-exact.
          "model.hidden_dropout_prob=0.0", "model.attention_probs_dropout_prob=0.0"]


def train_case(overrides, out, resume_step=None, universal=False):
    """Trainer.fit() in this worker; returns (losses, per-step metric records written by global rank 0, else None)."""
    import torch.distributed as dist

    from zoo.parallel.topology import initialize_model_parallel
    from zoo.training.checkpoint import find_checkpoint
    from zoo.training.config import load, validate
    from zoo.training.trainer import Trainer

    cfg = load(CONFIG, COMMON + list(overrides) + [f"out={out}"])
    model_cfg = validate(cfg, dist.get_world_size())
    grid = initialize_model_parallel(cfg.parallel.tp, cfg.parallel.pp)
    resume = find_checkpoint(out, resume_step) if resume_step is not None else None
    with Trainer(cfg, model_cfg, grid, log=lambda s: None, resume=resume, universal=universal) as trainer:
        losses = trainer.fit().losses
    records = None
    if grid.rank == 0:
        records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return losses, records


LAYOUTS = {  # name: (world size, overrides)
    "tp2": (2, ["parallel.tp=2"]),
    "pp2": (2, ["parallel.pp=2"]),
    "dp2": (2, []),
    "tp2-pp2": (4, ["parallel.tp=2", "parallel.pp=2"]),
    "dp2-zero2-recompute": (2, ["parallel.zero_stage=2", "parallel.activation_checkpointing=true"]),
    "pp2-recompute-zero1": (2, ["parallel.pp=2", "parallel.activation_checkpointing=true", "parallel.zero_stage=1"]),
}

_reference = {}


def reference(dist_run):
    if "ref" not in _reference:
        _reference["ref"] = dist_run(1, train_case, [], "/tmp/zoo-bert-ref")[0]
    return _reference["ref"]


def test_synthetic_batches_hold_padding():
    from zoo.data.batches import micro_batch
    from zoo.data.bert_dataset import SyntheticBertPairs

    ds = SyntheticBertPairs(512, 32, seed=1234)
    (ids, types, mask), (mlm, nsp) = micro_batch(ds, 0, 0, micro_batch_size=2, accumulation=4, dp_rank=0, dp=1)
    assert ids.shape == types.shape == mask.shape == mlm.shape == (2, 32) and nsp.shape == (2,)
    assert (mask == 0).any() and ids.dtype == mask.dtype == torch.long


def test_reference_learns_and_reports_accuracies(dist_run):
    losses, records = reference(dist_run)
    assert len(losses) == STEPS and losses[-1] < losses[0], losses
    for r in records:
        assert 0.0 <= r["mlm_accuracy"] <= 1.0 and 0.0 <= r["nsp_accuracy"] <= 1.0
        assert r["tflops_per_device"] > 0 and r["tokens_per_s"] > 0


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(dist_run, tmp_path, layout):
    expected, expected_records = reference(dist_run)
    world, overrides = LAYOUTS[layout]
    results = dist_run(world, train_case, overrides, str(tmp_path))
    for losses, _ in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0)
    records = results[0][1]
    for key in ("mlm_accuracy", "nsp_accuracy"):  # sums over all ranks: the same counts as one process
        got = torch.tensor([r[key] for r in records], dtype=torch.float64)
        torch.testing.assert_close(got, torch.tensor([r[key] for r in expected_records], dtype=torch.float64),
                                   rtol=0, atol=1e-9, msg=key)


@pytest.mark.parametrize("saved,resumed_as", [("parallel.tp=2", "parallel.pp=2"), ("parallel.pp=2", "parallel.tp=2")])
def test_checkpoint_resumes_in_another_tp(dist_run, tmp_path, saved, resumed_as):
    """Saved at tp=2 (ZeRO-1) and resumed at tp=1 x pp=2 through the universal checkpoint, and back: the next loss
    is the one of the run that never stopped (the patterns in families/bert.py split every BERT parameter right).
    A vocabulary of 1100 pads to 1280 at tp 2 and 1152 at tp 1, the MLM decoder bias with it: DeepSpeed re-pads
    only 2-D tensors, zoo the 1-D bias (checkpoint.fit_padded_vectors)."""
    out = str(tmp_path)
    base = ["parallel.zero_stage=1", "training.steps=4", "model.vocab_size=1100"]
    uninterrupted, _ = dist_run(2, train_case, base + [saved, "training.save=true", "training.save_interval=3"], out)[0]
    resumed, _ = dist_run(2, train_case, base + [resumed_as], out, 3, True)[0]
    assert len(resumed) == 1
    torch.testing.assert_close(resumed[0], uninterrupted[3], rtol=1e-5, atol=0)
    assert (tmp_path / "checkpoints" / "step_00000003_universal" / "zoo.json").is_file()


def test_launch_train_embedded_end_to_end(tmp_path, dist_run):
    """launch/train.py's main (in the 1-rank pool, tests/mains.py) with configs/bert/tiny.yaml on the embedded corpus
    (WordPiece + sentence cache built in a fresh cache folder): metrics, evaluation, export, and the fill-mask line
    at the end."""
    out = tmp_path / "run"
    [(code, stdout, stderr)] = dist_run(1, run_main, "zoo.training.train:main", [
        "--config", CONFIG, "--steps", "4", "--eval-interval", "2", "--out", out, "--set",
        "training.micro_batch_size=4", "training.global_batch_size=8", "training.seq_length=64",
        "training.eval_iters=1", f"data.cache_dir={tmp_path / 'cache'}"])
    assert code == 0 and "done: metrics in" in stdout, stdout[-3000:] + stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and [r["step"] for r in evals] == [0, 2, 4]
    assert all("mlm_accuracy" in r and "nsp_accuracy" in r for r in steps)
    assert all("val_mlm_accuracy" in r and "val_nsp_accuracy" in r for r in evals)
    fill = [line for line in stdout.splitlines() if line.startswith("fill-mask: ")]
    assert len(fill) == 1 and "[MASK]" in fill[0] and "masked word" in fill[0], stdout[-2000:]
    from zoo.convert.io import read_config
    from zoo.data.tokenizer import load_tokenizer

    assert read_config(out / "model")[0] == "bert"
    assert load_tokenizer(out / "model").mask_token == "[MASK]"


@pytest.mark.parametrize("head", ["mlm+nsp", "classification"])
def test_universal_patterns_split_every_parameter_as_the_model_does(head):
    """Every BERT parameter: replicated pattern <=> not TP-sharded; row-parallel pattern <=> sharded on dim 1;
    vocabulary pattern <=> the word embedding; and every pattern matches some parameter (DeepSpeed insists)."""
    import re

    from zoo.models.bert import BertConfig, layer_specs
    from zoo.models.gpt import ParallelOptions
    from zoo.models.specs import SpecSequential
    from zoo.training.families.bert import universal_checkpoint_info

    config = BertConfig.from_preset("tiny")
    info = universal_checkpoint_info(config, head)
    params = dict(SpecSequential(layer_specs(config, ParallelOptions(), head=head)).named_parameters())

    def matches(kind):
        return {n for n in params if any(re.match(p, n) for p in info[kind])}

    replicated, row = matches("tp_replicated_parameter_patterns"), matches("parameter_with_row_parallelism_patterns")
    sharded = {n for n, p in params.items() if getattr(p, "tensor_model_parallel", False)}
    assert replicated == set(params) - sharded
    assert row == {n for n in sharded if params[n].partition_dim == 1}
    assert matches("vocabulary_parameter_patterns") == {"tied_modules.embed.word_embeddings.weight"}
    for kind, patterns in info.items():
        if kind.endswith("_patterns"):
            for p in patterns:
                assert any(re.match(p, n) for n in params), (kind, p)


def test_pretraining_loss_counts_argmax_over_the_real_vocabulary():
    from zoo.models.bert import BertConfig
    from zoo.training.families.bert import BertFamily

    config = BertConfig.from_preset("tiny", vocab_size=300)  # padded to 384: columns 300.. are not tokens
    family = BertFamily()
    loss_fn = family.loss(config)
    torch.manual_seed(0)
    logits = torch.randn(2, 6, config.padded_vocab_size())
    logits[..., 300:] = 100.0  # padding columns must never win
    labels = torch.full((2, 6), -100)
    labels[0, 1], labels[1, 4], labels[1, 5] = logits[0, 1, :300].argmax(), 7, logits[1, 5, :300].argmax()
    nsp_logits, nsp_labels = torch.tensor([[2.0, 1.0], [0.0, 1.0]]), torch.tensor([0, 0])
    loss = loss_fn((logits, nsp_logits), (labels, nsp_labels))
    assert torch.isfinite(loss)
    stats = loss_fn.stats()
    assert stats == {"mlm_correct": 2.0 + float(logits[1, 4, :300].argmax() == 7), "mlm_total": 3.0,
                     "nsp_correct": 1.0, "nsp_total": 2.0}
    assert family.derive_metrics(stats) == pytest.approx({"mlm_accuracy": stats["mlm_correct"] / 3,
                                                          "nsp_accuracy": 0.5})
    assert loss_fn.stats()["mlm_total"] == 0  # reset on read


def test_flops_are_megatrons_for_an_encoder():
    """With f = 4h and no head, training FLOPs per sequence are Megatron's 72 s l h^2 (1 + s / 6h) (the causal
    formula's blocks without recomputation; attention is counted over all s keys in both)."""
    from zoo.models.bert import BertConfig
    from zoo.training.families.bert import encoder_flops_per_token, training_flops_per_sample

    c = BertConfig.from_preset("bert-base")
    s, h, L = 512, c.hidden_size, c.num_hidden_layers
    assert 3 * s * encoder_flops_per_token(c, s) == pytest.approx(72 * s * L * h * h * (1 + s / (6 * h)))
    head = s * (2 * h * h + 2 * h * c.vocab_size) + 2 * h * h + 4 * h
    assert training_flops_per_sample(c, s, "mlm+nsp") == pytest.approx(3 * (s * encoder_flops_per_token(c, s) + head))
    assert training_flops_per_sample(c, s, "mlm+nsp", recompute=True) == pytest.approx(
        training_flops_per_sample(c, s, "mlm+nsp") + s * encoder_flops_per_token(c, s))


def test_bad_bert_runs_are_refused_before_start(tmp_path):
    from zoo.training.config import ConfigError, load, validate

    def error(overrides, world=1):
        with pytest.raises(ConfigError) as e:
            validate(load(CONFIG, COMMON + overrides + [f"out={tmp_path}"]), world)
        return str(e.value)

    assert "partition_method: type:BertLayer" in error(["parallel.pp=2", "parallel.partition_method=parameters"], 2)
    assert "sequence parallelism" in error(["parallel.tp=2", "parallel.sequence_parallel=true"], 2)
    assert "max_position_embeddings" in error(["training.seq_length=256"])
    assert "not available for BERT pretraining" in error(["data.source=classification"])
    assert "at least 256" in error(["data.source=embedded", "model.vocab_size=200"])
    assert "data.paths" in error(["data.source=indexed"])


def test_indexed_source_reads_sentence_files(tmp_path):
    """data.source indexed: sentence-level files (write_sentence_corpus, or Megatron's --split-sentences) plus the
    tokenizer they were made with; one-sequence-per-document files are refused before start."""
    from zoo.data.bert_dataset import train_wordpiece_tokenizer, write_sentence_corpus
    from zoo.data.indexed import IndexedDatasetBuilder
    from zoo.data.tokenizer import load_tokenizer
    from zoo.training.config import ConfigError, load, validate
    from zoo.training.families import get_family

    docs = [f"Document {d} starts here. It has a second sentence. And a third one about topic {d}!" for d in range(8)]
    train_wordpiece_tokenizer(docs, 120, tmp_path / "tok")
    tok = load_tokenizer(tmp_path / "tok")
    assert write_sentence_corpus(docs, tok, tmp_path / "corpus") == 8
    cfg = load(CONFIG, COMMON + ["data.source=indexed", f"data.paths=[{tmp_path / 'corpus'}]",
                                 f"data.tokenizer={tmp_path / 'tok'}", "data.valid_fraction=0.25", f"out={tmp_path}"])
    model_cfg = validate(cfg, 1)
    data = get_family("bert").build_data(cfg, model_cfg, grid=None)
    assert data.tokenizer_dir == str(tmp_path / "tok") and data.valid is not None
    (ids, _, mask), (labels, nsp) = data.train[0]
    text = tok.decode(torch.where(labels != -100, labels, ids)[mask.bool()].tolist())
    assert text.startswith("[CLS] document") and text.endswith("[SEP]") and text.count("[SEP]") == 2
    with IndexedDatasetBuilder(tmp_path / "flat") as b:
        b.add_document(tok("one document")["input_ids"])
    cfg.data.paths = [str(tmp_path / "flat")]
    with pytest.raises(ConfigError, match="one sequence per sentence"):
        validate(cfg, 1)

"""Classification fine-tuning of BERT: a tiny BERT (a random "bert" pretraining folder with a WordPiece vocabulary
trained on the task) learns "good"/"bad" sentiment at tp=2 (the command's main in the 2-rank pool, as torchrun runs
it), from a partially loaded init (encoder and pooler from the folder, a new classifier); the exported zoo and HF
folders carry the label names; the metrics and the partial loading are checked on their own; bad inputs are refused
in one line before anything is written."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from tests.mains import run_main

ROOT = Path(__file__).resolve().parents[2]
GOOD = ["good", "great", "fine", "lovely"]
BAD = ["bad", "awful", "poor", "boring"]
FILLER = ["the", "movie", "was", "plot", "actors", "really", "quite", "and", "story", "film", "music", "a", "it",
          "ending", "scenes", "very", "overall", "cast"]
LONG = 4  # training rows longer than the run's seq_length (truncated, counted in a warning)
FINETUNE = ["--steps", "60", "--eval-interval", "30", "--set", "training.seq_length=24", "training.micro_batch_size=8",
            "training.global_batch_size=16", "training.lr=3e-3", "training.warmup_steps=3", "training.log_interval=20"]


def sentiment_rows(n: int, seed: int, long: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        label = "pos" if i % 2 == 0 else "neg"
        words = rng.choices(FILLER, k=rng.randint(3, 8) if i >= long else 40)
        words.insert(rng.randint(0, 3), rng.choice(GOOD if label == "pos" else BAD))  # early: kept by truncation
        rows.append({"text": " ".join(words), "label": label})
    return rows


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """(root, bert folder, train.jsonl, valid.csv): a random tiny "bert" (MLM+NSP) folder with its tokenizer."""
    from zoo.convert.io import write_model_folder
    from zoo.data.bert_dataset import train_wordpiece_tokenizer
    from zoo.models.bert import BertConfig, layer_specs
    from zoo.models.gpt import ParallelOptions
    from zoo.models.specs import SpecSequential

    root = tmp_path_factory.mktemp("bert-cls")
    train, valid = sentiment_rows(192, 0, long=LONG), sentiment_rows(48, 1)
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    (root / "valid.csv").write_text("text,label\n" + "".join(f"{r['text']},{r['label']}\n" for r in valid))
    tok_dir = root / "tokenizer"
    train_wordpiece_tokenizer([r["text"] for r in train + valid] * 5, 128, tok_dir)
    config = BertConfig.from_preset("tiny", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = SpecSequential(layer_specs(config, ParallelOptions(), head="mlm+nsp"), base_seed=7)
    write_model_folder(root / "bert", "bert", config.to_dict(), model.state_dict().items(), tokenizer_dir=tok_dir)
    return root, root / "bert", root / "train.jsonl", root / "valid.csv"


def test_classification_metrics_and_loss():
    from zoo.models.bert import BertConfig
    from zoo.training.families.bert import BertClassifierLoss, classification_metrics

    loss_fn = BertClassifierLoss(BertConfig.from_preset("tiny", num_labels=3))
    logits = torch.tensor([[3.0, 0, 0], [0, 3.0, 0], [0, 3.0, 0], [0, 0, 3.0], [3.0, 0, 0], [9.0, 0, 0]])
    labels = torch.tensor([0, 1, 0, 2, 1, -100])  # the last is validation padding: no loss, no count
    loss = loss_fn(logits, labels)
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(logits[:5], labels[:5]))
    metrics = classification_metrics(loss_fn.stats())
    # Predictions 0 1 1 2 0 vs labels 0 1 0 2 1: per class F1 = 2tp / (2tp + fp + fn) = 2/4, 2/4, 2/2.
    assert metrics == pytest.approx({"accuracy": 3 / 5, "f1": (0.5 + 0.5 + 1.0) / 3})
    assert loss_fn.stats()["total"] == 0  # reset on read
    padding_only = loss_fn(logits[5:], labels[5:])
    assert padding_only == 0 and classification_metrics(loss_fn.stats()) == {}


def test_classifier_init_loads_encoder_and_pooler_and_makes_the_head(task, tmp_path):
    from zoo.convert.io import iter_tensors, load_model, read_config
    from zoo.models.bert import BertConfig, layer_specs
    from zoo.models.gpt import ParallelOptions
    from zoo.models.specs import SpecSequential
    from zoo.training.families.bert import write_classifier_init

    _, bert, _, _ = task
    config = BertConfig.from_dict({**read_config(bert)[1], "num_labels": 3})
    L = config.num_hidden_layers
    report = write_classifier_init(bert, tmp_path / "init", config, seed=11, tokenizer_dir=bert)
    assert report["initialized"] == [f"{L + 1}.classifier.bias", f"{L + 1}.classifier.weight"]
    assert f"{L + 1}.pooler.dense.weight" in report["loaded"]
    assert f"{L + 1}.seq_relationship.weight" in report["dropped"] and f"{L + 3}.bias" in report["dropped"]
    source, merged = dict(iter_tensors(bert)), dict(iter_tensors(tmp_path / "init"))
    for name in report["loaded"]:
        assert torch.equal(merged[name], source[name]), name
    # The new head is what a fresh run with that seed builds for layer L+1, and the folder loads completely.
    fresh = SpecSequential(layer_specs(config, ParallelOptions(), head="classification"), base_seed=11)
    assert torch.equal(merged[f"{L + 1}.classifier.weight"], fresh.state_dict()[f"{L + 1}.classifier.weight"])
    load_model(tmp_path / "init", fresh)
    assert torch.equal(fresh.state_dict()["1.attention.qkv.weight"], source["1.attention.qkv.weight"])
    assert read_config(tmp_path / "init")[0] == "bert-classifier"
    assert (tmp_path / "init" / "tokenizer.json").is_file()


def test_finetune_tp2_learns_and_exports(task, tmp_path, dist_run):
    """zoo.finetune.bert's main at tp=2, in the 2-rank pool as torchrun runs it (tests/mains.py)."""
    root, bert, train, valid = task
    out = tmp_path / "run"
    ranks = dist_run(2, run_main, "zoo.finetune.bert:main", ["--init", bert, "--data", train, "--valid-data", valid,
                                                              "--tp", "2", "--out", out, *FINETUNE])
    stdout, stderr = "".join(r[1] for r in ranks), "".join(r[2] for r in ranks)
    assert [r[0] for r in ranks] == [0, 0] and "done: zoo model" in stdout, (stdout + stderr)[-4000:]
    assert f"warning: {LONG} of 240 example(s) are longer than training.seq_length 24" in stderr, stderr[-3000:]
    assert "new: 3.classifier.bias, 3.classifier.weight" in stdout  # encoder and pooler came from --init
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "val_accuracy" in r]
    assert [r["step"] for r in evals] == [0, 30, 60]
    assert evals[-1]["val_accuracy"] >= 0.9 and evals[-1]["val_f1"] >= 0.9, evals  # chance: 0.5
    assert all("accuracy" in r and "f1" in r for r in records if "loss" in r)
    labels = json.loads((out / "model" / "labels.json").read_text())
    assert labels["id2label"] == {"0": "neg", "1": "pos"}
    assert "classify: " in stdout

    from zoo.training.families.bert import classify_examples

    zoo_predictions = classify_examples(out / "model", valid, 48)
    expected = [r.split(",")[1] for r in valid.read_text().splitlines()[1:]]
    assert sum(p[1] == y for p, y in zip(zoo_predictions, expected)) >= 0.9 * len(expected)
    if not (out / "hf").is_dir():
        pytest.skip("no HF export: zoo.convert.bert.zoo_to_hf_bert is not available in this checkout")
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    hf = AutoModelForSequenceClassification.from_pretrained(out / "hf").eval()
    tok = AutoTokenizer.from_pretrained(out / "hf")
    assert hf.config.id2label == {0: "neg", 1: "pos"}
    texts = [p[0] for p in zoo_predictions]
    with torch.no_grad():
        predicted = hf(**tok(texts, padding=True, return_tensors="pt")).logits.argmax(-1).tolist()
    assert [hf.config.id2label[i] for i in predicted] == [p[1] for p in zoo_predictions]


def classifier_case(overrides, train, valid, tokenizer, out):
    """Trainer.fit() of the bert-classifier family (random tiny init, no dropout) in this worker; per-step losses."""
    import torch.distributed as dist

    from zoo.parallel.topology import initialize_model_parallel
    from zoo.training.config import load, validate
    from zoo.training.trainer import Trainer

    cfg = load(ROOT / "configs/bert/classify.yaml",
               ["training.steps=4", "training.micro_batch_size=2", "training.global_batch_size=8",
                "training.seq_length=24", "training.lr=3e-3", "training.warmup_steps=1", "training.save=false",
                "training.eval_interval=0", "parallel.zero_stage=0", "model.num_labels=2",
                "model.hidden_dropout_prob=0.0", "model.attention_probs_dropout_prob=0.0", f"out={out}", *overrides])
    cfg.data.paths, cfg.data.valid_paths, cfg.data.tokenizer = [str(train)], [str(valid)], str(tokenizer)
    model_cfg = validate(cfg, dist.get_world_size())
    grid = initialize_model_parallel(cfg.parallel.tp, cfg.parallel.pp)
    with Trainer(cfg, model_cfg, grid, log=lambda s: None) as trainer:
        return trainer.fit().losses


def test_classifier_layouts_match_single_process(dist_run, task, tmp_path):
    root, _, train, valid = task
    args = (train, valid, root / "tokenizer")
    expected = dist_run(1, classifier_case, [], *args, str(tmp_path / "ref"))[0]
    assert len(set(expected)) == len(expected)  # the updates change the model (4 small batches: no trend yet)
    for name, overrides in {"tp2": ["parallel.tp=2"], "pp2": ["parallel.pp=2"]}.items():
        for losses in dist_run(2, classifier_case, overrides, *args, str(tmp_path / name)):
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0, msg=name)


def _main_error(capsys, argv) -> str:
    from zoo.finetune.bert import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_bad_inputs_one_line_and_nothing_written(task, tmp_path, capsys):
    root, bert, train, valid = task
    out = tmp_path / "out"
    base = ["--init", str(bert), "--out", str(out)]
    no_label = tmp_path / "nolabel.csv"
    no_label.write_text("text,sentiment\ngood,pos\n")
    assert "no 'label' column" in _main_error(capsys, base + ["--data", str(no_label)])
    unseen = tmp_path / "unseen.csv"
    unseen.write_text("text,label\ngood movie,pos\nso so,meh\n")
    assert "['meh']" in _main_error(capsys, base + ["--data", str(train), "--valid-data", str(unseen)])
    single = tmp_path / "single.csv"
    single.write_text("text,label\na,x\nb,x\n")
    assert "single label" in _main_error(capsys, base + ["--data", str(single)])
    assert "does not exist" in _main_error(capsys, base + ["--data", str(tmp_path / "nope.jsonl")])
    gpt = tmp_path / "gpt"
    gpt.mkdir()
    (gpt / "config.json").write_text(json.dumps({"zoo_format": 1, "family": "gpt", "config": {}}))
    assert "holds a 'gpt' model" in _main_error(capsys, ["--init", str(gpt), "--data", str(train), "--out", str(out)])
    assert "max_position_embeddings" in _main_error(capsys, base + ["--data", str(train), "--set",
                                                                    "training.seq_length=4096"])
    assert "cannot be set" in _main_error(capsys, base + ["--data", str(train), "--set", "model.hidden_size=32"])
    assert "needs a tokenizer" in _main_error(capsys, ["--data", str(train), "--out", str(out)])  # random init
    assert not out.exists()


def test_init_from_a_huggingface_bert(task, tmp_path, dist_run):
    """--init a HF BertForMaskedLM folder: imported with zoo.convert.bert, its encoder loads, pooler and
    classifier are new (BertForMaskedLM has no pooler)."""
    pytest.importorskip("zoo.convert.bert")
    import shutil

    from transformers import BertConfig as HFBertConfig
    from transformers import BertForMaskedLM

    from zoo.convert.io import iter_tensors

    root, _, train, valid = task
    hf = tmp_path / "hf-bert"
    torch.manual_seed(0)
    BertForMaskedLM(HFBertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                 intermediate_size=64, max_position_embeddings=64)).save_pretrained(hf)
    for f in (root / "tokenizer").iterdir():
        shutil.copy(f, hf / f.name)
    out = tmp_path / "run"
    [(code, stdout, stderr)] = dist_run(1, run_main, "zoo.finetune.bert:main", [
        "--init", hf, "--data", train, "--valid-data", valid, "--out", out, "--steps", "2", "--eval-interval", "0",
        "--no-sample", "--set", "training.seq_length=24"])
    assert code == 0 and "done: zoo model" in stdout, (stdout + stderr)[-3000:]
    assert "new: 3.classifier.bias, 3.classifier.weight, 3.pooler.dense.bias, 3.pooler.dense.weight" in stdout
    init = dict(iter_tensors(out / "init-model"))
    ref = BertForMaskedLM.from_pretrained(hf).state_dict()
    assert torch.equal(init["tied_modules.embed.word_embeddings.weight"], ref["bert.embeddings.word_embeddings.weight"])
    assert torch.equal(init["2.mlp.fc1.weight"], ref["bert.encoder.layer.1.intermediate.dense.weight"])

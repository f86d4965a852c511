"""Fine-tuning end to end: a tiny random HF GPT-2 (with a BPE tokenizer trained on the task) is fine-tuned at tp=2
(launch/finetune.py's main in the 2-rank pool, as torchrun runs it) on "reverse <word>:" -> " <drow>", and the
exported HF folder is checked with transformers alone (also for a tiny Mistral whose sliding window is shorter than
the training sequence); bad inputs are refused in one line before anything is written;
and launch/train.py trains from a HF folder at tp=2, its first loss being the HF model's own loss on the same batch.
"""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path

import pytest
import torch

from tests.mains import run_main

ROOT = Path(__file__).resolve().parents[2]
EOS = 0  # the trained tokenizer's <|endoftext|>
FINETUNE = ["--steps", "40", "--eval-interval", "20", "--set", "training.seq_length=32",
            "training.micro_batch_size=8", "training.global_batch_size=16", "training.lr=2e-3",
            "training.warmup_steps=2", "training.eval_iters=1", "training.log_interval=10"]


def reverse_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdef") for _ in range(rng.randint(2, 5))) for _ in range(n)]
    return [{"prompt": f"reverse {w}:", "response": f" {w[::-1]}"} for w in words]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """(HF folder, data file, rows): a random GPT-2 without dropout, and 64 instruction pairs."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from zoo.data.tokenizer import train_bpe_tokenizer

    root = tmp_path_factory.mktemp("finetune")
    rows = reverse_rows(64)
    data = root / "reverse.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    hf = root / "hf-gpt2"
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=300, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=EOS,
                        eos_token_id=EOS, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    GPT2LMHeadModel(config).save_pretrained(hf)
    train_bpe_tokenizer([r["prompt"] + r["response"] for r in rows], 300, hf)
    return hf, data, rows


def response_loss(model, tok, rows) -> float:
    """Mean cross entropy of the response tokens and EOS given the prompt, computed with transformers."""
    total, count = 0.0, 0
    with torch.no_grad():
        for r in rows:
            prompt = tok(r["prompt"], add_special_tokens=False)["input_ids"]
            target = tok(r["response"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            ids = torch.tensor([prompt + target])
            logits = model(ids).logits[0, len(prompt) - 1:-1]  # the positions that predict the target
            total += float(torch.nn.functional.cross_entropy(logits, torch.tensor(target), reduction="sum"))
            count += len(target)
    return total / count


def test_finetune_tp2_exports_a_better_hf_model(task, tmp_path, dist_run):
    """launch/finetune.py's main at tp=2, in the 2-rank pool as torchrun runs it (tests/mains.py)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf, data, rows = task
    out = tmp_path / "sft"
    ranks = dist_run(2, run_main, "zoo.dispatch:finetune_main",
                     ["--init", hf, "--data", data, "--tp", "2", "--out", out, *FINETUNE])
    assert [code for code, _, _ in ranks] == [0, 0], [err[-3000:] for _, _, err in ranks]
    log = "".join(stdout for _, stdout, _ in ranks)
    assert "tp=2 pp=1 dp=1" in log and "60 training examples, validation 4 examples" in log
    assert f"HF model {out / 'hf'}" in log
    assert "sample (greedy) for the first validation prompt: 'reverse " in log

    valid = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "val_loss" in r]
    assert [r["step"] for r in valid] == [0, 20, 40] and valid[-1]["val_loss"] < valid[0]["val_loss"]

    original = AutoModelForCausalLM.from_pretrained(hf).eval()
    tuned = AutoModelForCausalLM.from_pretrained(out / "hf").eval()
    tok = AutoTokenizer.from_pretrained(out / "hf")
    assert tok.eos_token_id == EOS and tuned.config.eos_token_id == EOS
    a, b = original.state_dict(), tuned.state_dict()
    assert a.keys() == b.keys() and all(a[k].shape == b[k].shape for k in a)
    assert sum(not torch.equal(a[k], b[k]) for k in a) > len(a) // 2
    before, after = response_loss(original, tok, rows), response_loss(tuned, tok, rows)
    assert math.isfinite(after) and after < 0.8 * before, (before, after)
    # The zoo folder beside it holds the same model with its tokenizer.
    assert {"config.json", "tokenizer.json", "generation_config.json"} <= {p.name for p in (out / "model").iterdir()}


def test_finetune_tp2_a_sliding_window_mistral(tmp_path, dist_run):
    """A tiny Mistral whose window (8) is shorter than training.seq_length (32) fine-tunes at tp=2 from its HF folder
    (the window applied in training, and in the greedy sample's rolling KV cache); the export is a Mistral with the
    same window, which transformers loads and scores better on the task, and whose window still bites."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.convert.test_hf_gpt import hf_llama
    from zoo.data.tokenizer import train_bpe_tokenizer

    rows = reverse_rows(64)
    data = tmp_path / "reverse.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    hf = tmp_path / "hf-mistral"
    torch.manual_seed(0)
    hf_llama(arch="mistral", sliding_window=8).save_pretrained(hf)
    train_bpe_tokenizer([r["prompt"] + r["response"] for r in rows], 300, hf)
    out = tmp_path / "sft"
    ranks = dist_run(2, run_main, "zoo.dispatch:finetune_main",
                     ["--init", hf, "--data", data, "--tp", "2", "--out", out, *FINETUNE])
    assert [code for code, _, _ in ranks] == [0, 0], [err[-3000:] for _, _, err in ranks]
    log = "".join(stdout for _, stdout, _ in ranks)
    assert "tp=2 pp=1 dp=1" in log and "sample (greedy) for the first validation prompt: 'reverse " in log

    original = AutoModelForCausalLM.from_pretrained(hf).eval()
    tuned = AutoModelForCausalLM.from_pretrained(out / "hf").eval()
    tok = AutoTokenizer.from_pretrained(out / "hf")
    assert type(tuned).__name__ == "MistralForCausalLM" and tuned.config.sliding_window == 8
    a, b = original.state_dict(), tuned.state_dict()
    assert a.keys() == b.keys() and sum(not torch.equal(a[k], b[k]) for k in a) > len(a) // 2
    before, after = response_loss(original, tok, rows), response_loss(tuned, tok, rows)
    assert math.isfinite(after) and after < 0.8 * before, (before, after)
    ids = torch.randint(1, 300, (1, 32), generator=torch.Generator().manual_seed(0))
    unwindowed = AutoModelForCausalLM.from_pretrained(out / "hf", sliding_window=None).eval()
    with torch.no_grad():  # the same weights without the window: other logits past position 8
        assert (tuned(ids).logits[0, 8:] - unwindowed(ids).logits[0, 8:]).abs().max() > 1e-3
        torch.testing.assert_close(tuned(ids).logits[0, :8], unwindowed(ids).logits[0, :8], rtol=0, atol=1e-5)


def _copy_without_tokenizer(hf: Path, dst: Path) -> Path:
    dst.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy2(hf / name, dst / name)
    return dst


def test_bad_inputs_one_line_and_nothing_written(task, tmp_path, capsys):
    from zoo.finetune.gpt import main

    hf, data, _ = task
    files = {"empty": "\n", "not-json": '{"prompt": "a", "response": "b"}\n\n{"prompt": oops}\n',
             "keys": '{"question": "a", "answer": "b"}\n',
             "no-assistant": '{"messages": [{"role": "user", "content": "hi"}]}\n'}
    for name, text in files.items():
        (tmp_path / f"{name}.jsonl").write_text(text)
    cases = [
        (["--data", tmp_path / "missing.jsonl"], ["missing.jsonl does not exist"]),
        (["--data", tmp_path / "empty.jsonl"], ["holds no examples"]),
        (["--data", tmp_path / "not-json.jsonl"], ["not-json.jsonl line 3 is not JSON"]),
        (["--data", tmp_path / "keys.jsonl"], ["line 1: missing key(s) ['prompt', 'response']", '"messages"']),
        (["--data", tmp_path / "no-assistant.jsonl"], ["line 1: the conversation has no assistant turn"]),
        (["--data", data, "--valid-data", tmp_path / "keys.jsonl"], ["keys.jsonl line 1: missing key(s)"]),
        (["--data", data, "--init", _copy_without_tokenizer(hf, tmp_path / "no-tok")],
         ["holds no tokenizer", "--set data.tokenizer=DIR"]),
    ]
    for k, (argv, expected) in enumerate(cases):
        out = tmp_path / f"out{k}"
        argv = ["--init", hf, *argv] if "--init" not in argv else argv
        capsys.readouterr()
        assert main([str(a) for a in argv + ["--out", out, "--set", "training.seq_length=32"]]) == 2, argv
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(err) == 1 and err[0].startswith("error: "), err
        assert all(e in err[0] for e in expected), (expected, err[0])
        assert not out.exists()


def init_from_hf_case(hf, out):
    """Trainer.fit() at tp=2 from the HF folder ``hf`` (converted on the fly by rank 0 into out/init-model)."""
    import torch.distributed as dist

    from zoo.parallel.topology import initialize_model_parallel
    from zoo.training.config import load, validate
    from zoo.training.trainer import Trainer

    cfg = load(ROOT / "configs/gpt/tiny.yaml", [
        f"training.init_from={hf}", "parallel.tp=2", "training.steps=3", f"out={out}", "data.source=synthetic",
        "training.seq_length=32", "training.micro_batch_size=4", "training.global_batch_size=8",
        "training.eval_interval=0", "training.save=false"])
    model_cfg = validate(cfg, dist.get_world_size())
    grid = initialize_model_parallel(cfg.parallel.tp, cfg.parallel.pp)
    with Trainer(cfg, model_cfg, grid, log=lambda s: None) as trainer:
        return trainer.fit().losses


def test_train_from_hf_folder_at_tp2(task, tmp_path, dist_run):
    """training.init_from <HF folder> at tp=2 (launch/train.py --init; its command line is the fine-tuning test's):
    step 1's loss is the HF model's loss on that batch."""
    from transformers import AutoModelForCausalLM

    from zoo.data.synthetic import SyntheticTokens

    hf, _, _ = task
    losses = dist_run(2, init_from_hf_case, str(hf), str(tmp_path / "run"))[0]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)

    model = AutoModelForCausalLM.from_pretrained(hf).eval()
    data = SyntheticTokens(model.config.vocab_size, 32, seed=1234)  # tiny.yaml's seed
    with torch.no_grad():
        micro = []
        for m in range(2):  # global batch 8 = 2 micro-batches of 4 at dp=1
            tokens = torch.stack([data[m * 4 + i] for i in range(4)])
            logits = model(tokens[:, :-1]).logits
            micro.append(float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())))
    assert abs(losses[0] - sum(micro) / 2) < 1e-4, (losses[0], micro)

"""``zoo.load_model``: any zoo folder as the plain model of one process, checked against a model built and loaded
separately (``SpecSequential`` + ``zoo.convert.io.load_model``, the training loss ``GPTLoss``, the command line of
``launch/generate.py``), and the README's library example run as written.
"""

from __future__ import annotations

import contextlib
import io as stdio
import json
import re
from pathlib import Path

import pytest
import torch

from zoo.convert.io import CheckpointError, iter_tensors, write_model_folder
from zoo.convert.io import load_model as load_into
from zoo.models.gpt import GPTConfig, GPTLoss, ParallelOptions, layer_specs
from zoo.models.specs import SpecSequential

README = Path(__file__).resolve().parents[2] / "README.md"
SENTENCES = ["the cat sat on the mat.", "a dog ran in the park.", "def add(a, b): return a + b",
             "we went to the market and bought some bread."] * 3

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def stored(model) -> list[tuple[str, torch.Tensor]]:
    """A built model's tensors as a model folder holds them (vocabulary padding dropped), moved off their init so
    that a tensor left unloaded cannot hide."""
    g = torch.Generator().manual_seed(0)
    out = []
    for name, t in model.state_dict(keep_vars=True).items():
        value = t.detach()[: getattr(t, "unpadded_size", None)].clone()
        if value.is_floating_point():
            value += 0.02 * torch.randn(value.shape, generator=g)
        out.append((name, value))
    return out


def reference(folder, specs) -> SpecSequential:
    model = SpecSequential(specs)
    load_into(folder, model)
    return model.eval()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from zoo.data.tokenizer import train_bpe_tokenizer

    path = tmp_path_factory.mktemp("tok") / "tokenizer"
    train_bpe_tokenizer(SENTENCES, 300, path)
    return path


def gpt_folder(path, tokenizer_dir, preset="tiny", **overrides) -> tuple[Path, GPTConfig]:
    from zoo.data.tokenizer import load_tokenizer

    cfg = GPTConfig.from_preset(preset, vocab_size=len(load_tokenizer(tokenizer_dir)), num_hidden_layers=2,
                                max_position_embeddings=64, **overrides)
    built = SpecSequential(layer_specs(cfg, ParallelOptions()))
    return write_model_folder(path, "gpt", cfg.to_dict(), stored(built), tokenizer_dir=tokenizer_dir), cfg


def readme_example() -> str:
    text = README.read_text()
    section = text[text.index("### zoo as a Python library"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_example_runs_as_written(tmp_path, tokenizer_dir, monkeypatch):
    """The README's lines load, generate, take one AdamW step and save: the text is the command line's, the step's
    gradients are those of the training loss on a separately loaded model, and the saved folder is the stepped model."""
    from zoo.data.tokenizer import load_tokenizer
    from zoo.generate.gpt import main as generate_main

    code = readme_example()
    assert len([line for line in code.splitlines() if line.strip()]) <= 10
    monkeypatch.chdir(tmp_path)
    folder, cfg = gpt_folder(tmp_path / "runs" / "gpt-main" / "model", tokenizer_dir)

    # The reference: the plain model of the training code and its loss (vocabulary-padded logits).
    ref = reference(folder, layer_specs(cfg, ParallelOptions())).train()
    ids = load_tokenizer(folder)("def add(a, b):\n    return a + b\n", return_tensors="pt").input_ids
    GPTLoss(cfg)(ref(ids[:, :-1]), ids[:, 1:]).backward()

    out, namespace = stdio.StringIO(), {"__name__": "readme"}
    had_group = torch.distributed.is_initialized()  # another test of this process may have left one
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), namespace)
    assert torch.distributed.is_initialized() == had_group  # one process: the example starts no process group

    cli = stdio.StringIO()
    with contextlib.redirect_stdout(cli), contextlib.redirect_stderr(stdio.StringIO()):
        assert generate_main(["--ckpt", str(folder), "--prompt", "The ", "--max-new-tokens", "32"]) == 0
    assert out.getvalue() == cli.getvalue() and out.getvalue().startswith("The ")

    # The step's gradients are the training loss's; what was saved is the stepped model, every tensor changed.
    stepped = dict(namespace["model"].named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(stepped[name].grad, p.grad, rtol=1e-4, atol=1e-7, msg=f"gradient of {name}")
    saved, before = dict(iter_tensors(tmp_path / "runs" / "gpt-main-ft")), dict(iter_tensors(folder))
    assert sorted(saved) == sorted(stepped)
    for name, value in saved.items():
        assert value.shape == before[name].shape, f"{name}: saved {value.shape}, the folder had {before[name].shape}"
        assert torch.equal(value, stepped[name].detach()[: value.shape[0]]), name
        assert not torch.equal(value, before[name]), f"{name} unchanged by the step"


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-moe"])
def test_gpt_logits_loss_and_generate(tmp_path, tokenizer_dir, preset):
    from zoo import load_model
    from zoo.generate.gpt import PretrainedGPT
    from zoo.models.generate import Generator, SamplingOptions

    folder, cfg = gpt_folder(tmp_path / "model", tokenizer_dir, preset)
    model = load_model(tmp_path)  # the run folder holding model/ works too
    assert type(model) is PretrainedGPT and not model.training and model.tokenizer is not None
    ref = reference(folder, layer_specs(cfg, ParallelOptions()))
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = ref(ids)
        assert torch.equal(model(ids), logits[..., : cfg.vocab_size])
        torch.testing.assert_close(model.loss(ids), GPTLoss(cfg)(logits[:, :-1], ids[:, 1:]))
    # Token ids in, token ids out: the decoder on the separately loaded model gives the same tokens.
    greedy = Generator(ref).generate(ids[:, :5], max_new_tokens=6, sampling=SamplingOptions(),
                                     eos_token_id=model.tokenizer.eos_token_id).tokens
    assert torch.equal(model.generate(ids[:, :5], max_new_tokens=6), greedy)
    # Text in, text out; a list gives a list; sampling is seeded.
    text = model.generate("the cat", max_new_tokens=8)
    assert text.startswith("the cat") and model.generate(["the cat"], max_new_tokens=8) == [text]
    assert model.generate("a", max_new_tokens=8, temperature=0.9, seed=3) == \
        model.generate("a", max_new_tokens=8, temperature=0.9, seed=3)


def test_device_dtype_and_save_round_trip(tmp_path, tokenizer_dir):
    from zoo import load_model
    from zoo.generate.gpt import PretrainedGPT

    folder, cfg = gpt_folder(tmp_path / "model", tokenizer_dir)
    half = PretrainedGPT.from_pretrained(folder, device="cpu", dtype=torch.bfloat16)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16} and {p.device.type for p in half.parameters()} \
        == {"cpu"}
    full = load_model(folder)
    with torch.no_grad():
        for (name, p), (_, q) in zip(full.named_parameters(), half.named_parameters()):
            assert torch.equal(p.to(torch.bfloat16), q), name
    full.save_pretrained(tmp_path / "again")
    assert json.loads((tmp_path / "again" / "config.json").read_text())["config"] == cfg.to_dict()
    assert (tmp_path / "again" / "tokenizer.json").is_file()
    assert {n: t for n, t in iter_tensors(tmp_path / "again")}.keys() == dict(iter_tensors(folder)).keys()
    for (name, a), (_, b) in zip(sorted(iter_tensors(folder)), sorted(iter_tensors(tmp_path / "again"))):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("head", ["classification", "mlm+nsp"])
def test_bert(tmp_path, head):
    from zoo import load_model
    from zoo.convert.bert import LABELS_FILE, family_of, zoo_config_dict
    from zoo.generate.bert import PretrainedBert
    from zoo.models.bert import BertConfig
    from zoo.models.bert import layer_specs as bert_specs

    cfg = BertConfig.from_preset("tiny", vocab_size=300, num_hidden_layers=2, num_labels=3)
    built = SpecSequential(bert_specs(cfg, ParallelOptions(), head=head))
    extra = {LABELS_FILE: json.dumps({"id2label": {"0": "neg", "1": "neu", "2": "pos"}})} \
        if head == "classification" else {}
    folder = write_model_folder(tmp_path / "bert", family_of(head), zoo_config_dict(cfg, head), stored(built),
                                extra_files=extra)
    model = load_model(folder)
    assert type(model) is PretrainedBert and model.head == head
    assert model.labels == (["neg", "neu", "pos"] if head == "classification" else None)
    ref = reference(folder, bert_specs(cfg, ParallelOptions(), head=head))
    ids = torch.randint(0, cfg.vocab_size, (2, 10), generator=torch.Generator().manual_seed(2))
    types = torch.zeros_like(ids).index_fill_(1, torch.arange(5, 10), 1)
    mask = torch.ones_like(ids).index_fill_(1, torch.tensor([8, 9]), 0)
    with torch.no_grad():
        ours, theirs = model(ids, types, mask), ref((ids, types, mask))
    if head == "classification":
        assert ours.shape == (2, 3) and torch.equal(ours, theirs)
    else:
        assert ours[0].shape == (2, 10, cfg.vocab_size) and torch.equal(ours[0], theirs[0][..., : cfg.vocab_size])
        assert torch.equal(ours[1], theirs[1])


def test_unet(tmp_path):
    from zoo import load_model
    from zoo.generate.unet import PretrainedUNet
    from zoo.models.unet import SegUNetConfig

    built = PretrainedUNet(SegUNetConfig.from_preset("tiny"))
    write_model_folder(tmp_path / "seg", built.family, built.config.to_dict(), stored(built))
    model = load_model(tmp_path / "seg")
    assert type(model) is PretrainedUNet and model.family == "unet-segmentation"
    images = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(3)) * 2 - 1
    ref = PretrainedUNet(built.config)  # built afresh, loaded by the training code's reader
    load_into(tmp_path / "seg", ref)
    with torch.no_grad():
        assert torch.equal(model(images), ref.eval()(images))
        assert torch.equal(model.segment(images), ref(images).argmax(1))


def test_refusals(tmp_path):
    from zoo import load_model

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "gpt2",
                                                             "architectures": ["GPT2LMHeadModel"]}))
    (tmp_path / "empty").mkdir()
    for folder, match in ((tmp_path / "hf", "launch/convert.py hf-to-zoo"), (tmp_path / "empty", "neither a zoo model"),
                          (tmp_path / "nope", "does not exist")):
        with pytest.raises(CheckpointError, match=match) as e:
            load_model(folder)
        assert "\n" not in str(e.value)
    write_model_folder(tmp_path / "odd", "rnn", {}, [("w", torch.zeros(1))])
    with pytest.raises(CheckpointError, match="family 'rnn'"):
        load_model(tmp_path / "odd")

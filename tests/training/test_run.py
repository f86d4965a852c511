"""What a run command says around the loop (zoo/training/run.py): the end-of-run summary, the warning of an init
folder without a tokenizer, the loss plot's axis, and what ``launch/train.py --help`` promises."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from zoo.training.config import load, validate
from zoo.training.families import REGISTRY, get_family
from zoo.training.run import init_without_tokenizer, loss_change

ROOT = Path(__file__).resolve().parents[2]


def test_loss_change_compares_the_first_evaluation_with_the_last():
    assert loss_change([(0, 6.2), (30, 5.011)], share=True) == \
        "validation loss 6.200 (step 0) -> 5.011 (step 30), 81% of the first"


def test_after_a_resume_one_evaluation_is_not_compared_with_itself():
    # a run resumed at step 20 evaluates at its end only: nothing to compare with
    line = loss_change([(30, 5.011)], share=True)
    assert line == "validation loss 5.011 (step 30; this run evaluated at that step only)"
    assert loss_change([(30, 5.011), (30, 5.011)], "validation loss (response tokens)").startswith(
        "validation loss (response tokens) 5.011 (step 30; ")


@pytest.fixture(scope="module")
def hf_gpt2_without_tokenizer(tmp_path_factory):
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path_factory.mktemp("hf-gpt2")
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=300, n_positions=64, bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(config).save_pretrained(folder)
    return folder


def test_init_from_a_folder_without_a_tokenizer_says_a_new_one_is_trained(hf_gpt2_without_tokenizer):
    cfg = load(None, [f"training.init_from={hf_gpt2_without_tokenizer}"])
    model_cfg = validate(cfg, 1)
    line = init_without_tokenizer(cfg, model_cfg)
    assert line.startswith(f"warning: {hf_gpt2_without_tokenizer} holds no tokenizer") and "\n" not in line
    assert "--set data.tokenizer=DIR" in line
    cfg.data.tokenizer = str(hf_gpt2_without_tokenizer)  # a tokenizer given: nothing to say
    assert init_without_tokenizer(cfg, model_cfg) is None
    fresh = load(None, [])
    assert init_without_tokenizer(fresh, validate(fresh, 1)) is None  # no --init: the new tokenizer is the plan


@pytest.mark.parametrize("family", sorted(REGISTRY))
def test_the_loss_plot_names_the_familys_loss(family, tmp_path, monkeypatch):
    from matplotlib.axes import Axes

    from zoo.training.trainer import plot_losses

    label = get_family(family).loss_label(load(None, [f"model.family={family}"]))
    assert ("nats/token" in label) == (family == "gpt"), label
    seen = []
    monkeypatch.setattr(Axes, "set_ylabel", lambda self, text, *a, **k: seen.append(text))
    plot_losses([{"step": 1, "loss": 2.0}, {"step": 1, "val_loss": 2.1}], tmp_path / "loss.png", label)
    assert seen == [label]


def test_diffusion_loss_label_follows_the_objective():
    family = get_family("unet-diffusion")
    assert family.loss_label(load(None, ["model.family=unet-diffusion"])).endswith("predicted noise")
    flow = load(None, ["model.family=unet-diffusion", "training.objective=flow"])
    assert family.loss_label(flow).endswith("predicted velocity")


def test_train_help_describes_the_readmes_main_job(capsys):
    """--help names the main job's config and the time measured for it (docs/results.yaml, the one place figures
    live), and the README's Quickstart runs that same command."""
    import yaml

    from zoo.training.train import DEFAULT_CONFIG, parse_args

    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert str(DEFAULT_CONFIG.relative_to(ROOT)) in text
    minutes = re.search(r"about (\d+:\d\d) on 2 idle CPU cores", text)
    rows = [row for topic in yaml.safe_load((ROOT / "docs/results.yaml").read_text())["topics"]
            for row in topic.get("rows", []) if row.get("command") == "python launch/train.py"]
    assert minutes and rows and rows[0]["figure"].startswith(f"{minutes[1]} in all"), (text, rows)
    assert "python launch/train.py" in (ROOT / "README.md").read_text().split("```")[1]

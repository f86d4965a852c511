"""Every registered HF architecture goes through the same generic code path: hf-to-zoo, verify at tp 1 in this
process, zoo-to-hf bit-exact with the original tensors (``zoo.convert.registry``).

Each case is a tiny random model made from its own transformers / diffusers config class, the same small models
the per-family tests use (tests/convert/test_hf_gpt.py, test_hf_moe.py, test_hf_bert.py, test_diffusers_cli.py).
An architecture registered without an entry in ``MODELS`` fails :func:`test_every_architecture_has_a_case`, so
adding one means adding its line here (docs/adding-a-model.md).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.convert import test_diffusers_cli as unet_cases
from tests.convert import test_hf_bert as bert_cases
from tests.convert import test_hf_gpt as gpt_cases
from tests.convert import test_hf_moe as moe_cases
from zoo.convert.cli import main
from zoo.convert.registry import ARCHITECTURES, FAMILIES, hf_family

TOL = 1e-4
CONVERT = Path(__file__).resolve().parents[2] / "zoo" / "convert"


def _randomized(model, seed: int = 0):
    gpt_cases.randomize_(model, seed)
    return model.eval()


# One tiny model per registered HF class: how to make it.
MODELS = {
    "GPT2LMHeadModel": lambda: _randomized(gpt_cases.hf_gpt2()),
    "LlamaForCausalLM": lambda: _randomized(gpt_cases.hf_llama(tied=False)),
    "MistralForCausalLM": lambda: _randomized(gpt_cases.hf_llama(arch="mistral", sliding_window=None)),
    "Qwen2ForCausalLM": lambda: _randomized(gpt_cases.hf_llama(arch="qwen2", use_sliding_window=False)),
    "MixtralForCausalLM": lambda: _randomized(moe_cases.hf_model("mixtral")),
    "Qwen2MoeForCausalLM": lambda: _randomized(moe_cases.hf_model("qwen2-moe")),
    "Qwen3MoeForCausalLM": lambda: _randomized(moe_cases.hf_model("qwen3-moe")),
    "OlmoeForCausalLM": lambda: _randomized(moe_cases.hf_model("olmoe")),
    "Gemma2ForCausalLM": lambda: _randomized(gpt_cases.hf_gemma2()),
    "BertModel": lambda: bert_cases.hf_model("BertModel"),
    "BertForMaskedLM": lambda: bert_cases.hf_model("BertForMaskedLM"),
    "BertForPreTraining": lambda: bert_cases.hf_model("BertForPreTraining"),
    "BertForSequenceClassification": lambda: bert_cases.hf_model("BertForSequenceClassification"),
    "UNet2DModel": lambda: unet_cases.random_unet2d(),
}


def test_every_architecture_has_a_case():
    assert sorted(MODELS) == ARCHITECTURES.names(), "give every registered HF architecture a line in MODELS"


def test_every_family_an_architecture_imports_into_is_convertible():
    assert {ARCHITECTURES[name].family for name in ARCHITECTURES} <= set(FAMILIES)


def hf_tensors(folder: Path) -> dict:
    return {k: t for f in sorted(folder.glob("*.safetensors")) for k, t in load_file(f).items()}


def cli(capsys, *argv) -> tuple[int, str]:
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    out = capsys.readouterr()
    assert rc == 0, out.out + out.err
    return rc, out.out


@pytest.mark.parametrize("name", sorted(MODELS))
def test_import_verify_export(name, tmp_path, capsys, monkeypatch):
    """hf-to-zoo picks the architecture's family from the registry, verify (tp 1, this process) finds the same
    outputs, zoo-to-hf writes every original tensor back bit for bit."""
    if ARCHITECTURES[name].library == "diffusers":
        pytest.importorskip("diffusers")
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "ZOO_WORLD_OF_ONE"):
        monkeypatch.delenv(var, raising=False)  # restored afterwards: verify makes this process a world of one
    src, zoo, out = tmp_path / "hf", tmp_path / "zoo", tmp_path / "back"
    torch.manual_seed(0)
    MODELS[name]().save_pretrained(src)
    assert hf_family(src) == ARCHITECTURES[name].family

    cli(capsys, "hf-to-zoo", "--src", src, "--out", zoo)
    lines = cli(capsys, "verify", "--hf", src, "--zoo", zoo)[1].strip().splitlines()
    m = re.fullmatch(r"max_abs_diff=(\S+)", lines[-1])
    assert m and float(m.group(1)) < TOL, lines[-3:]
    cli(capsys, "zoo-to-hf", "--src", zoo, "--out", out)

    original, exported = hf_tensors(src), hf_tensors(out)
    assert sorted(exported) == sorted(original)
    for key, t in original.items():
        assert exported[key].dtype == t.dtype and torch.equal(exported[key], t), key

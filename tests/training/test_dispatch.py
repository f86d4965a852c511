"""launch/generate.py and launch/finetune.py pick the family's implementation from the model folder."""

import json

from zoo.dispatch import _flag, family_of


def write(folder, meta):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(meta))
    return str(folder)


def test_family_of_folders(tmp_path):
    assert family_of(write(tmp_path / "zoo", {"zoo_format": 1, "family": "unet-diffusion", "config": {}})) \
        == "unet-diffusion"
    run = tmp_path / "run"
    write(run / "model", {"zoo_format": 1, "family": "bert", "config": {}})
    assert family_of(str(run)) == "bert"  # a run folder: its model/
    assert family_of(write(tmp_path / "cls", {"architectures": ["BertForSequenceClassification"]})) == "bert-classifier"
    assert family_of(write(tmp_path / "mlm", {"architectures": ["BertForMaskedLM"]})) == "bert"
    assert family_of(write(tmp_path / "unet", {"_class_name": "UNet2DModel"})) == "unet-diffusion"
    assert family_of(write(tmp_path / "llama", {"architectures": ["LlamaForCausalLM"]})) == "gpt"
    assert family_of(str(tmp_path / "missing")) is None and family_of(None) is None


def test_flag_forms():
    assert _flag(["--ckpt", "a", "--x"], "--ckpt") == "a"
    assert _flag(["--ckpt=b"], "--ckpt") == "b"
    assert _flag(["--ckpt"], "--ckpt") is None

"""diffusers UNet2DModel through ``launch/convert.py``: hf-to-zoo, verify at every (tp, pp), zoo-to-hf.

A small UNet2DModel with random weights (norm affines and biases too) is saved with ``save_pretrained`` and
imported with the command line. ``verify`` runs in one 4-rank gloo pool at (tp, pp) in {(1,1), (2,1), (1,2), (2,2)}
(dp = 4 / (tp x pp) replicas, rank 0's compared): the predicted noise within 1e-4 of diffusers'. Exporting back
gives every tensor bit for bit, in a folder ``UNet2DModel.from_pretrained`` loads. A pipeline folder (``unet/``)
imports the same; other diffusers classes are refused with one line naming the supported one.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from zoo.convert import io
from zoo.convert.cli import main

TOL = 1e-4
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (tp, pp)
WEIGHTS = "diffusion_pytorch_model.safetensors"
CONFIG = dict(sample_size=16, in_channels=3, out_channels=3, block_out_channels=(32, 64), layers_per_block=1,
              norm_num_groups=8, attention_head_dim=8, down_block_types=("DownBlock2D", "AttnDownBlock2D"),
              up_block_types=("AttnUpBlock2D", "UpBlock2D"))
SUPPORTED = "supported diffusers models: UNet2DModel (a model folder, or a pipeline folder with it in unet/)"


def _diffusers():
    """Imported on use: the gloo workers that import this module for verify_case skip diffusers' import."""
    return pytest.importorskip("diffusers")


def random_unet2d(seed: int = 0):
    """A UNet2DModel of CONFIG whose 1-D tensors are moved off their init (norm weights ~1, biases ~0), so a
    swapped norm or a dropped bias shows in the output."""
    diffusers = _diffusers()
    torch.manual_seed(seed)
    model = diffusers.UNet2DModel(**CONFIG).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                base = 1.0 if "norm" in name and name.endswith("weight") else 0.0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=g))
    return model


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    """``main(argv)``: exit code, stdout, stderr."""
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def assert_error(capsys, message: str, *argv) -> None:
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 2 and err.strip().splitlines() == [f"error: {message}"], (rc, err)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("diffusers") / "unet"
    random_unet2d().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def zoo_dir(hf_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("zoo") / "unet"
    assert main(["hf-to-zoo", "--src", str(hf_dir), "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def pipeline_dir(hf_dir, tmp_path_factory) -> Path:
    """A DDPM pipeline folder: model_index.json, the model in unet/, a scheduler beside it."""
    pipe = tmp_path_factory.mktemp("pipeline") / "ddpm"
    shutil.copytree(hf_dir, pipe / "unet")
    (pipe / "scheduler").mkdir()
    (pipe / "scheduler" / "scheduler_config.json").write_text(json.dumps({"_class_name": "DDPMScheduler"}))
    (pipe / "model_index.json").write_text(json.dumps({"_class_name": "DDPMPipeline",
                                                       "scheduler": ["diffusers", "DDPMScheduler"],
                                                       "unet": ["diffusers", "UNet2DModel"]}))
    return pipe


def test_hf_to_zoo_writes_the_diffusion_family(zoo_dir):
    family, config = io.read_config(zoo_dir)
    assert family == "unet-diffusion"
    assert config["block_out_channels"] == [32, 64] and config["down_block_types"] == list(CONFIG["down_block_types"])


# ---------------------------------------------------------------------------------------------------------------
# verify at every layout, in one 4-rank pool
# ---------------------------------------------------------------------------------------------------------------


def verify_case(hf, zoo, tp, pp):
    from zoo.convert.verify import verify

    return verify(hf, zoo, tp, pp)


def test_verify_every_layout(hf_dir, zoo_dir, tmp_path, dist_run):
    for tp, pp in LAYOUTS[1:]:  # tp=pp=1: the command's own test below, in this process
        per_rank = dist_run(4, verify_case, str(hf_dir), str(zoo_dir), tp, pp)
        assert all(r == per_rank[0] for r in per_rank)  # every rank returns rank 0's number
        assert per_rank[0] < TOL, f"tp={tp} pp={pp}: max |noise diff| {per_rank[0]}"
    # Heads rotated in one attention's fused qkv (every tensor still the right shape): verify notices.
    family, config = io.read_config(zoo_dir)
    tensors = ((k, t.roll(8, dims=0) if k.endswith(".qkv.weight") else t) for k, t in io.iter_tensors(zoo_dir))
    io.write_model_folder(tmp_path / "bad", family, config, tensors)
    assert dist_run(4, verify_case, str(hf_dir), str(tmp_path / "bad"), 2, 2)[0] > 1e-2


def test_verify_command_prints_max_abs_diff_last(pipeline_dir, zoo_dir, capsys):
    """In this process (a world of one), with the pipeline folder as --hf; --tol below the difference exits 1."""
    for tol, code, verdict in ((TOL, 0, "ok"), (-1.0, 1, "FAILED")):
        rc, out, err = run_cli(capsys, "verify", "--hf", pipeline_dir, "--zoo", zoo_dir, "--tol", tol)
        lines = out.strip().splitlines()
        assert rc == code, out + err
        assert lines[-2].startswith("tp=1 pp=1") and lines[-2].endswith(verdict), lines[-2:]
        m = re.fullmatch(r"max_abs_diff=(\S+)", lines[-1])
        assert m and float(m.group(1)) < TOL, lines[-1]


# ---------------------------------------------------------------------------------------------------------------
# zoo-to-hf, the pipeline folder, refusals
# ---------------------------------------------------------------------------------------------------------------


def test_zoo_to_hf_is_bit_exact_and_loads(hf_dir, zoo_dir, tmp_path, capsys):
    rc, out, err = run_cli(capsys, "zoo-to-hf", "--src", zoo_dir, "--out", tmp_path / "back")
    assert rc == 0 and out.strip().splitlines()[-1] == f"wrote {tmp_path / 'back'}", out + err
    original, back = load_file(hf_dir / WEIGHTS), load_file(tmp_path / "back" / WEIGHTS)
    assert sorted(back) == sorted(original)
    for key, t in original.items():
        assert back[key].dtype == t.dtype and torch.equal(back[key], t), key
    diffusers = _diffusers()
    a = diffusers.UNet2DModel.from_pretrained(hf_dir).eval()
    b, info = diffusers.UNet2DModel.from_pretrained(tmp_path / "back", output_loading_info=True)
    assert not any(info.values()), info
    x, t = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1)), torch.tensor([3, 700])
    with torch.no_grad():
        assert torch.equal(a(x, t).sample, b.eval()(x, t).sample)


def test_pipeline_folder_imports(pipeline_dir, zoo_dir, tmp_path, capsys):
    rc, out, err = run_cli(capsys, "hf-to-zoo", "--src", pipeline_dir, "--out", tmp_path / "zoo")
    assert rc == 0, out + err
    ours, reference = dict(io.iter_tensors(tmp_path / "zoo")), dict(io.iter_tensors(zoo_dir))
    assert sorted(ours) == sorted(reference) and all(torch.equal(ours[k], reference[k]) for k in reference)


def test_the_scheduler_travels_and_flow_samples_equal_diffusers(hf_dir, pipeline_dir, tmp_path, capsys):
    """A flow-matching pipeline (FlowMatchEulerDiscreteScheduler): imported, the zoo folder samples with Euler steps,
    the same images as diffusers' UNet2DModel + scheduler loop; exported, the scheduler config is beside the
    weights where diffusers' ``from_pretrained`` reads it. A DDPM pipeline's scheduler comes along too; a scheduler
    zoo does not sample (DDIM) stays behind (the model samples with DDPM's chain)."""
    from zoo.generate.unet import PretrainedUNet

    diffusers = _diffusers()
    flow = tmp_path / "flow"
    shutil.copytree(hf_dir, flow / "unet")
    diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000).save_pretrained(flow / "scheduler")
    assert run_cli(capsys, "hf-to-zoo", "--src", flow, "--out", tmp_path / "zoo")[0] == 0
    model = PretrainedUNet.from_pretrained(tmp_path / "zoo")
    assert model.objective == "flow"
    ours = model.sample(2, steps=3, seed=5)
    unet = diffusers.UNet2DModel.from_pretrained(flow / "unet").eval()
    sched = diffusers.FlowMatchEulerDiscreteScheduler.from_pretrained(flow / "scheduler")
    sched.set_timesteps(3)
    x = torch.randn((2, 3, 16, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        for t in sched.timesteps:
            x = sched.step(unet(x, t.expand(2)).sample, t, x).prev_sample
    torch.testing.assert_close(ours, x.clamp(-1, 1), rtol=0, atol=TOL)
    assert run_cli(capsys, "zoo-to-hf", "--src", tmp_path / "zoo", "--out", tmp_path / "back")[0] == 0
    back = diffusers.FlowMatchEulerDiscreteScheduler.from_pretrained(tmp_path / "back")
    assert back.config.num_train_timesteps == 1000 and back.config.shift == 1.0
    assert run_cli(capsys, "hf-to-zoo", "--src", pipeline_dir, "--out", tmp_path / "ddpm")[0] == 0
    assert PretrainedUNet.from_pretrained(tmp_path / "ddpm").scheduler_config == {"_class_name": "DDPMScheduler"}
    ddim = tmp_path / "ddim"
    shutil.copytree(pipeline_dir, ddim)
    (ddim / "scheduler" / "scheduler_config.json").write_text(json.dumps({"_class_name": "DDIMScheduler"}))
    assert run_cli(capsys, "hf-to-zoo", "--src", ddim, "--out", tmp_path / "ddim-zoo")[0] == 0
    model = PretrainedUNet.from_pretrained(tmp_path / "ddim-zoo")
    assert model.scheduler_config is None and model.objective == "ddpm"


def test_refusals_are_one_line(hf_dir, zoo_dir, tmp_path, capsys):
    out = tmp_path / "out"
    meta = json.loads((hf_dir / "config.json").read_text())
    cond = tmp_path / "cond"
    cond.mkdir()
    (cond / "config.json").write_text(json.dumps({**meta, "_class_name": "UNet2DConditionModel",
                                                  "cross_attention_dim": 64}))
    assert_error(capsys, f"{cond / 'config.json'}: diffusers model class UNet2DConditionModel is not supported; "
                 f"{SUPPORTED}", "hf-to-zoo", "--src", cond, "--out", out)
    sd = tmp_path / "sd"  # a pipeline whose unet/ is a conditional U-Net
    shutil.copytree(cond, sd / "unet")
    (sd / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))
    assert_error(capsys, f"{sd / 'unet' / 'config.json'}: diffusers model class UNet2DConditionModel is not "
                 f"supported; {SUPPORTED}", "hf-to-zoo", "--src", sd, "--out", out)
    dit = tmp_path / "dit"  # a pipeline without a U-Net
    dit.mkdir()
    (dit / "model_index.json").write_text(json.dumps({"_class_name": "DiTPipeline"}))
    assert_error(capsys, f"{dit / 'model_index.json'}: diffusers pipeline DiTPipeline has no unet/ model; "
                 f"{SUPPORTED}", "hf-to-zoo", "--src", dit, "--out", out)
    assert not out.exists()

    # verify: a layout the heads do not allow, before any process group; a diffusers model of another shape
    assert_error(capsys, "down_blocks.0.resnets.0: 32 channels are not divisible by tp 3 (its conv1, norm2 and conv2 "
                 "are split over channels); use a tp in 1, 2, 4, 8, 16, 32", "verify", "--hf", hf_dir, "--zoo",
                 zoo_dir, "--tp", "3")
    assert_error(capsys, "down_blocks.1.attentions.0: 8 attention head(s) (64 channels / attention_head_dim 8) cannot "
                 "be split over tp 16; use a tp in 1, 2, 4, 8 or a smaller attention_head_dim", "verify", "--hf",
                 hf_dir, "--zoo", zoo_dir, "--tp", "16")
    other = tmp_path / "other"
    shutil.copytree(hf_dir, other)
    (other / "config.json").write_text(json.dumps({**meta, "norm_num_groups": 4}))
    assert_error(capsys, f"{other} and the zoo folder are different models: norm_num_groups 4 vs 8", "verify",
                 "--hf", other, "--zoo", zoo_dir)

    # zoo-to-hf names the families it exports
    io.write_model_folder(tmp_path / "seg", "unet-segmentation", {"classes": 3}, iter([("0.w", torch.zeros(1))]))
    assert_error(capsys, f"{tmp_path / 'seg'} holds a 'unet-segmentation' model; zoo-to-hf exports the families gpt, "
                 f"bert, bert-classifier, unet-diffusion", "zoo-to-hf", "--src", tmp_path / "seg", "--out", out)

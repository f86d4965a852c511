"""The U-Net families through the training run: layouts against one process, metrics, pictures, resume, errors.

Each layout run trains 3 steps through ``zoo.training.trainer.Trainer`` from the same seed on the same global batch;
losses must agree with the single-process run within 1e-5 relative at every step (fp32), on the gloo pools of
1, 2 and 4 ranks. The short end-to-end runs call ``launch/train.py``'s ``main`` in this process (a world of one).
"""

import json
import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = {"seg": ROOT / "configs/unet/segmentation.yaml", "diffusion": ROOT / "configs/unet/diffusion.yaml",
           "flow": ROOT / "configs/unet/diffusion.yaml"}
VARIANT = {"flow": ["training.objective=flow"]}  # flow matching: the diffusion U-Net, another objective
STEPS = 3
COMMON = [f"training.steps={STEPS}", "training.micro_batch_size=2", "training.global_batch_size=4",
          "training.lr=3e-3", "training.warmup_steps=1", "training.save=false", "training.eval_interval=0",
          "training.log_interval=1", "parallel.zero_stage=0"]


def setup_run(variant, overrides, out):
    import torch.distributed as dist

    from zoo.parallel.topology import initialize_model_parallel
    from zoo.training.config import load, validate

    cfg = load(CONFIGS[variant], COMMON + VARIANT.get(variant, []) + list(overrides) + [f"out={out}"])
    model_cfg = validate(cfg, dist.get_world_size())
    return cfg, model_cfg, initialize_model_parallel(cfg.parallel.tp, cfg.parallel.pp)


def train_case(variant, overrides, out, resume_step=None, universal=False):
    """Trainer.fit() in this worker in the layout of ``overrides``; the per-step losses."""
    from zoo.training.checkpoint import find_checkpoint
    from zoo.training.trainer import Trainer

    cfg, model_cfg, grid = setup_run(variant, overrides, out)
    resume = find_checkpoint(out, resume_step) if resume_step is not None else None
    with Trainer(cfg, model_cfg, grid, log=lambda s: None, resume=resume, universal=universal) as trainer:
        return trainer.fit().losses


LAYOUTS = {  # name: (world size, overrides) for (tp, pp, dp)
    "tp2": (2, ["parallel.tp=2"]),
    "pp2": (2, ["parallel.pp=2"]),
    "dp2": (2, []),
    "tp2-pp2": (4, ["parallel.tp=2", "parallel.pp=2"]),
}
_reference = {}


def reference(dist_run, variant):
    if variant not in _reference:
        _reference[variant] = dist_run(1, train_case, variant, [], f"/tmp/zoo-unet-ref-{variant}")[0]
    return _reference[variant]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("variant", ["seg", "diffusion"])
def test_layout_matches_single_process(dist_run, tmp_path, variant, layout):
    check_layout(dist_run, tmp_path, variant, layout)


@pytest.mark.parametrize("layout", ["dp2", "pp2"])
def test_flow_matching_layout_matches_single_process(dist_run, tmp_path, layout):
    """Flow matching's pairs (a float level per sample, seeded per sample) cut into micro-batches and ranks, and
    the float timesteps through the pipeline's first stage, train as in one process."""
    check_layout(dist_run, tmp_path, "flow", layout)
    assert reference(dist_run, "flow") != reference(dist_run, "diffusion"), "the objective changes the training"


def check_layout(dist_run, tmp_path, variant, layout):
    expected = reference(dist_run, variant)
    assert expected[-1] < expected[0], f"the reference run must learn: {expected}"
    world, overrides = LAYOUTS[layout]
    for rank_losses in dist_run(world, train_case, variant, overrides, str(tmp_path)):
        torch.testing.assert_close(torch.tensor(rank_losses), torch.tensor(expected), rtol=1e-5, atol=0)


@pytest.mark.parametrize("variant", ["seg", "diffusion"])
def test_tp2_checkpoint_resumes_at_tp1_pp2(dist_run, tmp_path, variant):
    """Saved at tp=2 (ZeRO-1), resumed at tp=1 x pp=2 through DeepSpeed's universal checkpoint: column- and
    row-parallel convs, the attention's stride-3 qkv (sub-parameters) and the replicated layers all come back."""
    base = ["parallel.zero_stage=1", "training.steps=4"]
    out = str(tmp_path / "run")
    uninterrupted = dist_run(2, train_case, variant, base + ["parallel.tp=2", "training.save=true",
                                                             "training.save_interval=3"], out)[0]
    resumed = dist_run(2, train_case, variant, base + ["parallel.pp=2"], out, 3, True)[0]
    assert len(resumed) == 1
    torch.testing.assert_close(resumed[0], uninterrupted[3], rtol=1e-5, atol=0)
    assert (Path(out) / "checkpoints" / "step_00000003_universal" / "zoo.json").is_file()


def grid_and_export_case(out):
    """pp=2: the evaluation grid through every stage, then the layout-free export joined into one file."""
    from zoo.convert.io import save_model
    from zoo.finetune.unet import consolidate
    from zoo.training.families import get_family
    from zoo.training.trainer import Trainer, build_data

    cfg, model_cfg, grid = setup_run("seg", ["parallel.pp=2", "training.steps=1"], out)
    data = build_data(cfg, model_cfg, grid)
    with Trainer(cfg, model_cfg, grid, data, log=lambda s: None) as trainer:
        trainer.fit()
        engine = trainer.engine
        path = get_family("unet-segmentation").after_evaluation(engine, cfg, grid, data, 1)
        save_model(Path(out) / "model", engine.module, grid, "unet-segmentation", model_cfg.to_dict())
    if grid.rank != 0:
        return None
    files = sorted(p.name for p in (Path(out) / "model").iterdir())
    consolidate(Path(out) / "model")
    return str(path), files, sorted(p.name for p in (Path(out) / "model").iterdir())


def test_pipeline_evaluation_grid_and_consolidated_export(dist_run, tmp_path):
    from zoo.generate.unet import PretrainedUNet

    path, before, after = dist_run(2, grid_and_export_case, str(tmp_path))[0]
    assert Path(path) == tmp_path / "samples" / "step_00000001.png"
    assert Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "model.safetensors.index.json" in before  # one file per stage
    assert after == ["config.json", "model.safetensors"]
    model = PretrainedUNet.from_pretrained(tmp_path / "model")
    assert model.family == "unet-segmentation" and model.segment(torch.zeros(2, 3, 32, 32)).shape == (2, 32, 32)


# ---- end to end through launch/train.py's main (one process) ---------------------------------------------------

def records(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def seg_run(tmp_path_factory):
    """Also logged to an offline W&B run (no network), which must receive the prediction grids."""
    from zoo.training.train import main

    out = tmp_path_factory.mktemp("seg") / "run"
    env = {"WANDB_MODE": "offline", "WANDB_CONSOLE": "off"}
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        assert main(["--config", str(CONFIGS["seg"]), "--out", str(out), "--steps", "30", "--eval-interval", "15",
                     "--set", "training.eval_iters=2", "training.log_interval=10",
                     "training.loggers=[tensorboard,wandb]"]) == 0
    finally:
        for k, v in before.items():
            os.environ.pop(k) if v is None else os.environ.update({k: v})
    return out


def test_segmentation_run_improves_dice_and_draws_grids(seg_run):
    recs = records(seg_run)
    train, valid = [r for r in recs if "loss" in r], [r for r in recs if "val_loss" in r]
    assert [r["step"] for r in valid] == [0, 15, 30]
    for key in ("dice", "iou", "pixel_accuracy", "samples_per_s", "tflops_per_device"):
        assert key in train[0], key
    assert all(0 <= r["val_dice"] <= 1 and 0 <= r["val_iou"] <= r["val_dice"] for r in valid)
    assert valid[-1]["val_loss"] < valid[0]["val_loss"]
    assert valid[-1]["val_dice"] > valid[0]["val_dice"] + 0.02, [r["val_dice"] for r in valid]
    assert (seg_run / "samples" / "step_00000030.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    meta = json.loads((seg_run / "model" / "config.json").read_text())
    assert meta["family"] == "unet-segmentation"


def test_segmentation_grids_reach_wandb(seg_run):
    """Each evaluation's grid PNG (the file in OUT/samples) is a W&B image at its step; the last step's file is
    drawn again from the exported model after training, so only its presence is checked."""
    from tests.training.test_loggers import read_wandb_run

    run = read_wandb_run(seg_run)
    for step in (0, 15, 30):
        row = run["history"][step]
        assert row["val/predictions/_type"] == "image-file"
        logged = (run["dir"] / "files" / row["val/predictions/path"]).read_bytes()
        png = (seg_run / "samples" / f"step_{step:08d}.png").read_bytes()
        assert logged == png if step < 30 else logged[:8] == png[:8] == b"\x89PNG\r\n\x1a\n"
    assert run["summary"]["val/val_dice"] == records(seg_run)[-1]["val_dice"]


def test_segmentation_metrics_are_dice_and_iou_of_the_counts():
    from zoo.models.unet import SegUNetConfig, dice_score, iou_score
    from zoo.training.families.unet import SegmentationLossWithStats, segmentation_metrics

    cfg = SegUNetConfig.from_preset("tiny")
    loss = SegmentationLossWithStats(cfg)
    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(3, 4, 8, 8, generator=g), torch.randint(0, 3, (3, 8, 8), generator=g)
    loss(logits[:2], labels[:2])
    loss(logits[2:], labels[2:])
    got = segmentation_metrics(loss.stats())
    dice, iou = dice_score(logits, labels, 4)[1:], iou_score(logits, labels, 4)[1:]
    assert got["dice"] == pytest.approx(float(dice[~dice.isnan()].mean()))
    assert got["iou"] == pytest.approx(float(iou[~iou.isnan()].mean()))
    assert got["pixel_accuracy"] == pytest.approx(float((logits.argmax(1) == labels).double().mean()))
    assert set(segmentation_metrics(loss.stats()).values()) == {1.0}  # reset after stats(): nothing counted
    background = torch.zeros(2, 8, 8, dtype=torch.int64)
    labels = background.clone()
    labels[:, :4] = 2
    loss(torch.nn.functional.one_hot(background, 4).permute(0, 3, 1, 2).float(), labels)
    assert segmentation_metrics(loss.stats())["dice"] == 0.0  # all background predicted: Dice 0


def write_folders(root, n, size=32, seed=5):
    from zoo.data.image_folders import save_image, save_mask
    from zoo.data.shapes import ShapesSegmentation

    ds = ShapesSegmentation(size, seed=seed)
    for sub in ("images", "masks"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    for i in range(n):
        image, mask = ds[i]
        save_image(root / "images" / f"{i:04d}.png", image)
        save_mask(root / "masks" / f"{i:04d}.png", mask)
    return root / "images", root / "masks"


def test_finetune_from_exported_model_on_folders(seg_run, tmp_path, capsys):
    from zoo.finetune.unet import main
    from zoo.generate.unet import PretrainedUNet

    images, masks = write_folders(tmp_path / "data", 12)
    out = tmp_path / "ft"
    assert main(["--init", str(seg_run), "--images", str(images), "--masks", str(masks), "--valid-fraction", "0.25",
                 "--steps", "4", "--eval-interval", "4", "--out", str(out), "--set", "training.micro_batch_size=3",
                 "training.global_batch_size=3"]) == 0
    log = capsys.readouterr().out
    assert "9 training pairs, 3 validation pairs" in log
    assert sorted(p.name for p in (out / "model").iterdir()) == ["config.json", "model.safetensors"]
    model = PretrainedUNet.from_pretrained(out / "model")
    start = PretrainedUNet.from_pretrained(seg_run)
    assert model.config == start.config
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), start.parameters())), "it trained"
    assert (out / "samples" / "step_00000004.png").is_file()
    assert [r["step"] for r in records(out) if "val_dice" in r] == [0, 4]


@pytest.fixture(scope="module")
def diffusion_run(tmp_path_factory):
    """launch/train.py's main in this process (a world of one), with W&B offline beside TensorBoard; its end-of-run
    grid sampled in 10 DDPM steps instead of the 250 a real run takes (the sampler's own tests are elsewhere)."""
    import zoo.training.families.unet as unet
    from zoo.training.train import main

    out = tmp_path_factory.mktemp("diffusion") / "run"
    before, sample_steps = os.environ.get("WANDB_MODE"), unet.SAMPLE_STEPS
    os.environ["WANDB_MODE"] = "offline"
    unet.SAMPLE_STEPS = 10
    try:
        assert main(["--config", str(CONFIGS["diffusion"]), "--out", str(out), "--steps", "12", "--eval-interval",
                     "12", "--set", "training.eval_iters=2", "training.micro_batch_size=8",
                     "training.global_batch_size=8", "training.warmup_steps=2",
                     "training.loggers=[tensorboard,wandb]"]) == 0
    finally:
        os.environ.pop("WANDB_MODE") if before is None else os.environ.update(WANDB_MODE=before)
        unet.SAMPLE_STEPS = sample_steps
    return out


def test_diffusion_run_learns_and_writes_its_sample_grid(diffusion_run, tmp_path):
    from PIL import Image

    from zoo.generate.unet import main

    valid = [r for r in records(diffusion_run) if "val_loss" in r]
    assert valid[-1]["val_loss"] < valid[0]["val_loss"]
    grid = Image.open(diffusion_run / "samples.png")
    assert grid.size == (4 * 64 + 5 * 2,) * 2  # 16 images of 16x16 drawn at 64x64, 2-pixel gaps
    # The samples drawn from the export after training are in the W&B run too, at the last step: the very PNG.
    from tests.training.test_loggers import read_wandb_run

    run = read_wandb_run(diffusion_run)
    image = run["history"][12]
    assert image["samples/_type"] == "image-file"
    assert (run["dir"] / "files" / image["samples/path"]).read_bytes() == (diffusion_run / "samples.png").read_bytes()
    assert main(["--ckpt", str(diffusion_run), "--out", str(tmp_path / "g.png"), "--num", "3", "--steps", "4",
                 "--seed", "7"]) == 0
    assert main(["--ckpt", str(diffusion_run / "model"), "--out", str(tmp_path / "h.png"), "--num", "3", "--steps",
                 "4", "--seed", "7"]) == 0
    assert (tmp_path / "g.png").read_bytes() == (tmp_path / "h.png").read_bytes(), "same seed, same images"
    scheduler = json.loads((diffusion_run / "model" / "scheduler_config.json").read_text())
    assert scheduler["_class_name"] == "DDPMScheduler" and scheduler["prediction_type"] == "epsilon"
    from zoo.training.config import load, validate

    cfg = load(CONFIGS["diffusion"], [f"training.init_from={diffusion_run / 'model'}"])
    validate(cfg, 1)
    assert cfg.training.objective == "ddpm", "training from a DDPM model goes on with DDPM"


def test_flow_matching_run_exports_its_scheduler_and_samples_with_it(tmp_path, capsys):
    """launch/train.py with training.objective=flow and one large shape per image: model/ records the objective
    as diffusers' FlowMatchEulerDiscreteScheduler config, and the end-of-run grid and the sampling CLI take Euler
    steps (2 here, the sampler's own tests are elsewhere) from it."""
    import zoo.training.families.unet as unet
    from zoo.generate.unet import main as sample_main
    from zoo.training.train import main

    out, steps = tmp_path / "run", unet.FLOW_SAMPLE_STEPS
    unet.FLOW_SAMPLE_STEPS = 2
    try:
        assert main(["--config", str(CONFIGS["diffusion"]), "--out", str(out), "--steps", "3", "--set",
                     "training.objective=flow", "data.shapes_per_image=1", "data.shape_radius=[0.35, 0.35]",
                     "data.shape_offset=0",
                     "training.micro_batch_size=4", "training.global_batch_size=4", "training.eval_interval=0",
                     "training.loggers=[]"]) == 0
    finally:
        unet.FLOW_SAMPLE_STEPS = steps
    assert "samples (16 images, 2 Euler (flow matching) steps, seed 1234)" in capsys.readouterr().out
    scheduler = json.loads((out / "model" / "scheduler_config.json").read_text())
    assert scheduler["_class_name"] == "FlowMatchEulerDiscreteScheduler" and scheduler["shift"] == 1.0
    assert (out / "samples.png").is_file() and len([r for r in records(out) if "loss" in r]) == 3
    assert sample_main(["--ckpt", str(out), "--out", str(tmp_path / "g.png"), "--num", "2", "--steps", "2"]) == 0
    assert capsys.readouterr().out.strip().endswith("(2 images, 2 Euler (flow matching) steps, seed 0)")
    # Training from it goes on with flow matching (from the zoo folder or its diffusers export) unless told otherwise.
    from zoo.convert.unet import export_unet2d
    from zoo.training.config import load, validate

    export_unet2d(out / "model", tmp_path / "hf")
    for init, given, want in ((out / "model", [], "flow"), (tmp_path / "hf", [], "flow"),
                              (out / "model", ["training.objective=ddpm"], "ddpm")):
        cfg = load(CONFIGS["diffusion"], [f"training.init_from={init}", *given])
        validate(cfg, 1)
        assert cfg.training.objective == want, (init, given)


def test_sampling_cli_refuses_other_folders(seg_run, tmp_path, capsys):
    from zoo.generate.unet import main

    assert main(["--ckpt", str(seg_run), "--out", str(tmp_path / "x.png")]) == 2
    assert "needs a unet-diffusion folder" in capsys.readouterr().err
    assert main(["--ckpt", str(tmp_path / "nope"), "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "does not exist" in err[0]


def test_benchmark_runs_both_models(capsys):
    from zoo.bench.unet import main

    assert main(["--steps", "1", "--warmup", "0", "--batch-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "zoo" in out and "diffusers" in out and "ratio zoo / diffusers" in out


def test_flow_example_trains_on_centred_shapes_of_one_size():
    """configs/unet/diffusion-flow.yaml's data options reach the images the run trains and validates on."""
    from zoo.training.config import load, validate
    from zoo.training.families.unet import FAMILIES

    cfg = load(ROOT / "configs/unet/diffusion-flow.yaml", [])
    data = FAMILIES["unet-diffusion"].build_data(cfg, validate(cfg, 1), None)
    for split in (data.train, data.valid):
        for i in range(5):
            (shape,) = split.images.shapes(i)
            assert (shape.cx, shape.cy, shape.radius) == (16, 16, 0.35 * 32)


# ---- bad input: one error line from launch/train.py's main, before any process group -------------------------

def error_line(capsys, argv):
    from zoo.training.train import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_bad_inputs_give_one_error_line(capsys, tmp_path, monkeypatch):
    seg = ["--config", str(CONFIGS["seg"]), "--steps", "1", "--out", str(tmp_path / "run")]
    diffusion = ["--config", str(CONFIGS["diffusion"]), "--steps", "1", "--out", str(tmp_path / "run")]
    monkeypatch.setenv("WORLD_SIZE", "3")  # validation happens before any process group: nothing starts
    msg = error_line(capsys, seg + ["--tp", "3"])
    assert "16 channels are not divisible by tp 3" in msg
    monkeypatch.setenv("WORLD_SIZE", "2")
    msg = error_line(capsys, seg + ["--tp", "2", "--set", "parallel.sequence_parallel=true"])
    assert "sequence_parallel is not implemented for U-Nets" in msg
    monkeypatch.delenv("WORLD_SIZE")
    msg = error_line(capsys, diffusion + ["--set", "model.norm_num_groups=3"])
    assert "norm_num_groups 3 does not divide the 32 channels" in msg
    msg = error_line(capsys, seg + ["--set", "model.image_size=33"])
    assert "image_size 33 cannot be halved" in msg
    msg = error_line(capsys, diffusion + ["--set", "model.out_channels=1"])
    assert "must equal model.in_channels" in msg
    msg = error_line(capsys, diffusion + ["--set", "training.objective=v"])
    assert "training.objective must be ddpm (noise prediction) or flow (flow matching), got 'v'" in msg
    msg = error_line(capsys, seg + ["--set", "training.objective=flow"])
    assert "training.objective is for the unet-diffusion family, not 'unet-segmentation'" in msg
    msg = error_line(capsys, diffusion + ["--set", "data.shape_radius=[0.3, 0.6]"])
    assert "data.shape_radius must be [min, max] fractions" in msg and "[0.3, 0.6]" in msg
    msg = error_line(capsys, seg + ["--set", "data.shapes_per_image=0"])
    assert "data.shapes_per_image must be a positive integer, got 0" in msg
    msg = error_line(capsys, diffusion + ["--set", "data.shape_offset=0.7"])
    assert "data.shape_offset must be a fraction of the image size in [0, 0.5]" in msg and "0.7" in msg

    images, masks = write_folders(tmp_path / "data", 3, size=16)
    folders = ["--set", "data.source=folders", f"data.paths=[{images}, {masks}]"]
    from zoo.data.image_folders import save_image, save_mask

    save_mask(masks / "0001.png", torch.full((16, 16), 9))
    msg = error_line(capsys, seg + folders)
    assert "0001.png holds label 9" in msg and "classes 4" in msg
    save_mask(masks / "0001.png", torch.zeros(16, 16, dtype=torch.int64))
    (masks / "0002.png").rename(masks / "other.png")
    msg = error_line(capsys, seg + folders)
    assert "0002.png" in msg and "other.png" in msg and "do not pair up" in msg
    (masks / "other.png").rename(masks / "0002.png")
    for i in range(3):
        save_image(images / f"{i:04d}.png", torch.zeros(3, 15, 15))
        save_mask(masks / f"{i:04d}.png", torch.zeros(15, 15, dtype=torch.int64))
    msg = error_line(capsys, seg + folders)
    assert "15x15" in msg and "multiples of 4" in msg
    assert not (tmp_path / "run").exists()  # nothing written

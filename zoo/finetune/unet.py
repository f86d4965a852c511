"""Fine-tune a segmentation U-Net on image/mask folders, in any layout; the result as a zoo folder.

    python -m zoo.finetune.unet --init runs/unet-segmentation/model --images data/images --masks data/masks
    torchrun --nproc_per_node 2 -m zoo.finetune.unet --init DIR --images I --masks M --tp 2 --out runs/ft

The run is launch/train.py's (``zoo.training.train.train``: tp/pp/dp/ZeRO, evaluation with Dice and IoU,
checkpoints, exact resume) on the ``unet-segmentation`` family, with the weights and the model config from ``--init``
(a zoo model folder or a run folder holding ``model/``) and the samples from ``--images``/``--masks`` (pairs matched
by file name, ``zoo.data.image_folders``); validation from ``--valid-images``/``--valid-masks`` or a held-out
``--valid-fraction``. The result, ``<out>/model``, is ``config.json`` + ``model.safetensors`` in every layout
(pipeline stages' files are joined into one), which ``PretrainedUNet.from_pretrained`` (zoo.models.sample_unet)
loads back in one process; at the end the grid of the first validation images is drawn from it into
``<out>/samples/``. Everything about the input is checked before any process group exists: each problem is one
``error: ...`` line and exit status 2, and nothing is written.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import yaml

from zoo.training.config import ConfigError, RunConfig, validate
from zoo.training.train import add_run_flags
from zoo.training.train import config_from_args as train_config_from_args
from zoo.training.train import resume_plan

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "unet" / "segmentation.yaml"
DEFAULT_OUT = "runs/unet-finetune"
FAMILY = "unet-segmentation"


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m zoo.finetune.unet",
        description="Fine-tune a segmentation U-Net on image/mask folders. Works in one process, under torchrun and "
                    "under the deepspeed launcher; data parallelism is world_size / (tp x pp). Writes OUT/model.")
    p.add_argument("--init", required=True, metavar="DIR",
                   help="the U-Net to start from: a zoo unet-segmentation model folder, or a run folder with model/")
    p.add_argument("--images", required=True, metavar="DIR", help="training images (PNG, JPEG, ...)")
    p.add_argument("--masks", required=True, metavar="DIR",
                   help="training masks, same file names (stems) as the images; one class index per pixel")
    p.add_argument("--valid-images", metavar="DIR", help="validation images (default: hold out --valid-fraction)")
    p.add_argument("--valid-masks", metavar="DIR", help="validation masks (with --valid-images)")
    p.add_argument("--valid-fraction", type=float, metavar="F",
                   help="without --valid-images: hold out this fraction of the pairs for validation (0: none)")
    p.add_argument("--config", default=str(DEFAULT_CONFIG),
                   help=f"run config YAML (default: {DEFAULT_CONFIG.relative_to(DEFAULT_CONFIG.parents[2])})")
    add_run_flags(p, eval_help="validation loss, Dice and IoU")
    p.add_argument("--out", help=f"output folder (default {DEFAULT_OUT}): config.yaml, metrics.jsonl, loss.png, "
                                 f"checkpoints/, model/, samples/")
    p.add_argument("--no-sample", action="store_true", help="skip the grid drawn from the exported model")
    args, _unknown = p.parse_known_args(argv)  # the deepspeed launcher adds --local_rank=N
    return args


def config_from_args(args) -> RunConfig:
    # Paths are set as given, not through --set's YAML parsing (a path may hold ':' or look like a number).
    cfg = train_config_from_args(argparse.Namespace(**{**vars(args), "init": None, "out": None}))
    cfg.training.init_from = args.init
    cfg.out = args.out or DEFAULT_OUT
    cfg.model.family = FAMILY
    # The model comes from --init: drop the config file's model fields, keep what --set names (refused if it
    # changes the weights, by config.init_model_config).
    named = {item.split("=", 1)[0][len("model."):] for item in args.set if item.startswith("model.")}
    cfg.model.overrides = {k: v for k, v in cfg.model.overrides.items() if k in named}
    cfg.data.source = "folders"
    cfg.data.paths = [args.images, args.masks]
    if (args.valid_images is None) != (args.valid_masks is None):
        raise ConfigError("--valid-images and --valid-masks go together; give both or neither")
    if args.valid_images is not None:
        cfg.data.valid_paths = [args.valid_images, args.valid_masks]
    if args.valid_fraction is not None:
        cfg.data.valid_fraction = args.valid_fraction
    return cfg


def resolve_init(path: str) -> str:
    """A run folder stands for its ``model/``."""
    from zoo.convert import io

    p = Path(path).expanduser()
    return str(p / "model") if not io.is_model_folder(p) and io.is_model_folder(p / "model") else str(p)


def consolidate(model_dir: Path) -> None:
    """One ``model.safetensors`` in place of the per-stage files a pipeline run writes (U-Nets are small)."""
    from zoo.convert import io
    from zoo.models.sample_unet import PretrainedUNet

    if (model_dir / io.INDEX_FILE).is_file():
        PretrainedUNet.from_pretrained(model_dir).save_pretrained(model_dir)


def main(argv=None) -> int:
    from zoo.convert.io import save_model
    from zoo.parallel.topology import destroy_model_parallel, initialize_model_parallel
    from zoo.training.checkpoint import ResumeError
    from zoo.training.families import get_family
    from zoo.training.train import build_data, train

    args = parse_args(argv)
    args.init = resolve_init(args.init)
    rank0 = os.environ.get("RANK", "0") == "0"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cfg = config_from_args(args)
        model_cfg = validate(cfg, world)  # layout, batch, and every image and mask file (before any process group)
        resume, universal = resume_plan(cfg, model_cfg, args)
    except (ConfigError, ResumeError) as e:
        if rank0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    grid = initialize_model_parallel(cfg.parallel.tp, cfg.parallel.pp)
    out, tr = Path(cfg.out), cfg.training
    say = lambda s: print(s, flush=True)  # noqa: E731
    try:
        data = build_data(cfg, model_cfg, grid)
        if grid.rank == 0:
            from zoo.models.unet import num_parameters

            n_valid = 0 if data.valid is None else len(data.valid)
            say(f"zoo fine-tune of {tr.init_from}: unet-segmentation {num_parameters(model_cfg) / 1e6:.2f}M "
                f"parameters, {model_cfg.classes} classes | tp={grid.tp} pp={grid.pp} dp={grid.dp} "
                f"zero={cfg.parallel.zero_stage} | global batch {cfg.global_batch_size} | {tr.precision} | "
                f"{len(data.train)} training pairs, {n_valid} validation pairs")
            out.mkdir(parents=True, exist_ok=True)
            (out / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        result = train(cfg, model_cfg, grid, log=say, resume=resume, universal=universal, data=data,
                       keep_engine=True, progress=True)
        engine = result.engine
        if tr.save:
            save_model(out / "model", engine.module, grid, cfg.model.family, model_cfg.to_dict())
        engine.destroy()
        if grid.rank == 0 and result.val_losses:
            (s0, v0), (s1, v1) = result.val_losses[0], result.val_losses[-1]
            say(f"validation loss {v0:.3f} (step {s0}) -> {v1:.3f} (step {s1})")
    finally:
        is_rank0 = grid.rank == 0
        destroy_model_parallel()
    if not (is_rank0 and tr.save):
        return 0
    consolidate(out / "model")
    say(f"done: model {out / 'model'} (config.json + model.safetensors; PretrainedUNet.from_pretrained loads it) | "
        f"metrics {out / 'metrics.jsonl'} | loss plot {out / 'loss.png'}")
    if not args.no_sample:
        get_family(cfg.model.family).after_training(out / "model", say)
    return 0


if __name__ == "__main__":
    sys.exit(main())

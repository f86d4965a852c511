"""Fine-tune a segmentation U-Net on image/mask folders, in any layout; the result as a zoo folder.

    python -m zoo.finetune.unet --init runs/unet-segmentation/model --images data/images --masks data/masks
    torchrun --nproc_per_node 2 -m zoo.finetune.unet --init DIR --images I --masks M --tp 2 --out runs/ft

The run is launch/train.py's (``zoo.training.trainer.Trainer``: tp/pp/dp/ZeRO, evaluation with Dice and IoU,
checkpoints, exact resume) on the ``unet-segmentation`` family, with the weights and the model config from ``--init``
(a zoo model folder or a run folder holding ``model/``) and the samples from ``--images``/``--masks`` (pairs matched
by file name, ``zoo.data.image_folders``); validation from ``--valid-images``/``--valid-masks`` or a held-out
``--valid-fraction``. The result, ``<out>/model``, is ``config.json`` + ``model.safetensors`` in every layout
(pipeline stages' files are joined into one), which ``PretrainedUNet.from_pretrained`` (zoo.generate.unet)
loads back in one process; at the end the grid of the first validation images is drawn from it into
``<out>/samples/``. Everything about the input is checked before any process group exists: each problem is one
``error: ...`` line and exit status 2, and nothing is written.
"""

from __future__ import annotations

import sys
from pathlib import Path

from zoo.finetune.common import add_finetune_flags, run_config
from zoo.models.unet import DIFFUSION_FAMILY
from zoo.models.unet import SEG_FAMILY as FAMILY
from zoo.package import config_file
from zoo.training.config import ConfigError, RunConfig, validate
from zoo.training.run import RunParser, command, layout_line, loss_change, process_group, say, start_run, train_and_save
from zoo.training.train import resume_plan
from zoo.training.trainer import Trainer

DEFAULT_CONFIG = config_file("unet/segmentation.yaml")
DEFAULT_OUT = "runs/unet-finetune"


def parse_args(argv=None):
    p = RunParser("python -m zoo.finetune.unet", "Fine-tune a segmentation U-Net on image/mask folders.",
                  "Writes OUT/model.")
    p.add_argument("--init", required=True, metavar="DIR",
                   help="the U-Net to start from: a zoo unet-segmentation model folder, or a run folder with model/")
    p.add_argument("--images", required=True, metavar="DIR", help="training images (PNG, JPEG, ...)")
    p.add_argument("--masks", required=True, metavar="DIR",
                   help="training masks, same file names (stems) as the images; one class index per pixel")
    p.add_argument("--valid-images", metavar="DIR", help="validation images (default: hold out --valid-fraction)")
    p.add_argument("--valid-masks", metavar="DIR", help="validation masks (with --valid-images)")
    p.add_argument("--valid-fraction", type=float, metavar="F",
                   help="without --valid-images: hold out this fraction of the pairs for validation (0: none)")
    add_finetune_flags(p, DEFAULT_CONFIG, evaluation="validation loss, Dice and IoU",
                       sample="skip the grid drawn from the exported model",
                       outputs=f"output folder (default {DEFAULT_OUT}): config.yaml, metrics.jsonl, loss.png, "
                               f"checkpoints/, model/, samples/")
    return p.parse_args(argv)


def config_from_args(args) -> RunConfig:
    cfg = run_config(args, "folders", [args.images, args.masks], valid_fraction=args.valid_fraction)
    cfg.out = args.out or DEFAULT_OUT
    cfg.model.family = FAMILY
    # The model comes from --init: drop the config file's model fields, keep what --set names (refused if it
    # changes the weights, by config.init_model_config).
    named = {item.split("=", 1)[0][len("model."):] for item in args.set if item.startswith("model.")}
    cfg.model.overrides = {k: v for k, v in cfg.model.overrides.items() if k in named}
    if (args.valid_images is None) != (args.valid_masks is None):
        raise ConfigError("--valid-images and --valid-masks go together; give both or neither")
    if args.valid_images is not None:
        cfg.data.valid_paths = [args.valid_images, args.valid_masks]
    return cfg


def resolve_init(path: str) -> str:
    """A run folder stands for its ``model/``."""
    from zoo.convert import io

    try:
        return str(io.resolve_model_folder(path))
    except io.CheckpointError:  # validate() names the problem
        return str(Path(path).expanduser())


def consolidate(model_dir: Path) -> None:
    """One ``model.safetensors`` in place of the per-stage files a pipeline run writes (U-Nets are small)."""
    from zoo.convert import io
    from zoo.generate.unet import PretrainedUNet

    if (model_dir / io.INDEX_FILE).is_file():
        PretrainedUNet.from_pretrained(model_dir).save_pretrained(model_dir)


def plan(args, world_size: int) -> tuple:
    """``(run config, model config, resume, universal)``: the layout, the batch, every image and mask file, all
    checked before any process group exists."""
    args.init = resolve_init(args.init)
    cfg = config_from_args(args)
    model_cfg = validate(cfg, world_size)
    return (cfg, model_cfg, *resume_plan(cfg, model_cfg, args))


def run(args, cfg: RunConfig, model_cfg, resume, universal: bool) -> int:
    from zoo.models.unet import num_parameters
    from zoo.training.families import get_family
    from zoo.training.trainer import build_data

    out, tr = Path(cfg.out), cfg.training
    with process_group(cfg) as grid:
        rank0 = grid.rank == 0
        data = build_data(cfg, model_cfg, grid)
        n_valid = 0 if data.valid is None else len(data.valid)
        start_run(cfg, grid, f"zoo fine-tune of {tr.init_from}: unet-segmentation "
                             f"{num_parameters(model_cfg) / 1e6:.2f}M parameters, {model_cfg.classes} classes | "
                             f"{layout_line(cfg, grid)} | global batch "
                             f"{cfg.global_batch_size} | {tr.precision} | {len(data.train)} training pairs, "
                             f"{n_valid} validation pairs")
        with Trainer(cfg, model_cfg, grid, data, log=say, resume=resume, universal=universal, progress=True) as trainer:
            result = train_and_save(trainer)
        if rank0 and result.val_losses:
            say(loss_change(result.val_losses))
    if not (rank0 and tr.save):
        return 0
    consolidate(out / "model")
    say(f"done: model {out / 'model'} (config.json + model.safetensors; PretrainedUNet.from_pretrained loads it) | "
        f"metrics {out / 'metrics.jsonl'} | loss plot {out / 'loss.png'}")
    if not args.no_sample:
        get_family(cfg.model.family).after_training(out / "model", say)
    return 0


def main(argv=None) -> int:
    return command(parse_args(argv), plan, run)


# zoo.finetune.COMMANDS: a diffusion U-Net has no fine-tune command of its own (launch/finetune.py gives its folders
# to the GPT's, which refuses them in one line).
COMMANDS = {FAMILY: main, DIFFUSION_FAMILY: None}

if __name__ == "__main__":
    sys.exit(main())

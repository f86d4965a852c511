"""The U-Net families in the training run (zoo/models/unet/): per-pixel segmentation and DDPM noise prediction.

``unet-segmentation``: a sample is ``(image [C, H, W] in [-1, 1], mask [H, W] int64)``; the loss is the pixel cross
entropy, and the loss object also counts, per class, the pixels of prediction and mask and of their intersection
(``stats()``), from which every step and evaluation reports Dice and IoU (means over the foreground classes present
in prediction or mask; background excluded) and pixel accuracy.

``unet-diffusion``: a sample is ``((x_t [C, H, W], t), target)``, the training pair of ``training.objective`` for
clean image ``x0``: ``ddpm`` (default; Ho et al. 2020, Algorithm 1), an integer step and the noise as target;
``flow`` (flow matching, ``zoo.models.unet.FlowMatchSchedule``), a float step ``s * 1000`` and the velocity
``noise - x0``. The level and the noise come from the sample's own seeded generator, so the pair is a pure function
of the global sample index like every zoo dataset; the loss is the MSE to the target.

Data (``data.source``): ``embedded`` (default; ``synthetic`` is a synonym): ``zoo.data.shapes``, procedurally
generated shapes, nothing to download; ``folders``: ``data.paths: [images_dir, masks_dir]`` (segmentation) or
``[images_dir]`` (diffusion), read by ``zoo.data.image_folders``; validation from ``data.valid_paths`` (same form)
or a seeded ``data.valid_fraction`` of the pairs. ``training.seq_length`` means nothing here and is ignored.

What is shown: segmentation, a grid (image / true mask / predicted mask of the first validation images) in
``OUT/samples/step_XXXXXXXX.png``, drawn at the end from the exported model (``after_training``) and, where the
training loop calls the hook after an evaluation, by :meth:`SegmentationFamily.after_evaluation` (any layout);
diffusion, ``OUT/samples.png`` sampled from the exported model with its objective's sampler (DDPM's ancestral
chain, or flow matching's Euler steps), which the export records as ``model/scheduler_config.json``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from zoo.models.unet import DDPM_SAMPLE_STEPS as SAMPLE_STEPS
from zoo.models.unet import DIFFUSION_FAMILY, FLOW_SAMPLE_STEPS, SEG_FAMILY
from zoo.training.families import Data, Family, read_run_config

SOURCES = ("embedded", "synthetic", "folders")
EMBEDDED_LENGTH = 1 << 40  # the procedural datasets have no end; sample indices stay far below this
GRID_IMAGES = 4  # validation images in a segmentation grid
# The diffusion grid: its images; its sampling steps (imported above) are module globals, so a test can shorten them.
SAMPLE_IMAGES = 16
SAMPLES_DIR = "samples"


# ---------------------------------------------------------------------------------------------------------------
# Losses and datasets
# ---------------------------------------------------------------------------------------------------------------


class SegmentationLossWithStats:
    """``SegmentationLoss`` plus running per-class counts ``(intersection, predicted, actual)`` for Dice and IoU.

    ``stats()`` returns the sums since its last call as ``{"inter_03": n, "pred_03": n, "actual_03": n, ...}``
    (the same keys on every rank: zeros on pipeline stages that never see logits) and resets them.
    """

    def __init__(self, config):
        from zoo.models.unet import SegmentationLoss

        self.loss, self.classes = SegmentationLoss(config), config.classes
        self.counts = torch.zeros(3, self.classes, dtype=torch.float64)

    def __call__(self, logits, labels):
        from zoo.models.unet import confusion_counts

        with torch.no_grad():
            counts = confusion_counts(logits.detach(), labels, self.classes, self.loss.ignore_index)
            self.counts += torch.stack(counts).double().cpu()
        return self.loss(logits, labels)

    def stats(self) -> dict:
        out = {f"{kind}_{c:02d}": float(self.counts[k, c])
               for k, kind in enumerate(("inter", "pred", "actual")) for c in range(self.classes)}
        self.counts.zero_()
        return out


def segmentation_metrics(stats: dict) -> dict:
    """Dice, IoU (means over the foreground classes present in prediction or mask) and pixel accuracy from summed
    counts. With no foreground anywhere, Dice and IoU are 1 (nothing to find, nothing found)."""
    from zoo.models.unet import dice_from_counts, iou_from_counts

    classes = len([k for k in stats if k.startswith("inter_")])
    if classes == 0:
        return {}
    inter, pred, actual = (torch.tensor([stats[f"{kind}_{c:02d}"] for c in range(classes)], dtype=torch.float64)
                           for kind in ("inter", "pred", "actual"))
    dice, iou = dice_from_counts(inter, pred, actual)[1:], iou_from_counts(inter, pred, actual)[1:]
    present = ~torch.isnan(dice)
    total = float(actual.sum())
    return {"dice": float(dice[present].mean()) if present.any() else 1.0,
            "iou": float(iou[present].mean()) if present.any() else 1.0,
            "pixel_accuracy": float(inter.sum()) / total if total else 1.0}


class NoisedImages:
    """Diffusion training pairs from clean images: ``ds[i] -> ((x_t [C, H, W], t []), target [C, H, W])`` of
    ``schedule`` (a ``DDPMSchedule`` or ``FlowMatchSchedule``); the level and the noise come from a generator seeded
    with ``(seed, i)``, so the pair is a pure function of ``i``."""

    def __init__(self, images, seed: int, schedule=None):
        from zoo.models.unet import DDPMSchedule

        self.images, self.seed, self.schedule = images, seed, schedule or DDPMSchedule()

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int):
        x0 = self.images[index][None]  # [1, C, H, W]
        (x_t, t), target = self.schedule.training_batch(x0, seeds=[self.seed * (1 << 32) + index])
        return (x_t[0], t[0]), target[0]


def shapes_options(data) -> dict:
    """The embedded shapes images' keyword arguments from ``data.shapes_per_image`` / ``shape_radius`` /
    ``shape_offset``."""
    options = {}
    if getattr(data, "shapes_per_image", None) is not None:
        options["max_shapes"] = int(data.shapes_per_image)
    if getattr(data, "shape_radius", None) is not None:
        options["radius_range"] = tuple(float(v) for v in data.shape_radius)
    if getattr(data, "shape_offset", None) is not None:
        options["centre_offset"] = float(data.shape_offset)
    return options


def _square_size(sizes: tuple[int, int], what: str) -> int:
    if sizes[0] != sizes[1]:
        raise ValueError(f"the embedded shapes data is square; {what} {sizes[0]}x{sizes[1]} is not (use "
                         f"data.source folders for other shapes)")
    return sizes[0]


def _folder_pair(paths, name: str, n: int) -> list[str]:
    if not paths or len(paths) != n:
        form = "[images_dir, masks_dir]" if n == 2 else "[images_dir]"
        raise ValueError(f"data.source folders needs {name}: {form}, got {paths!r}")
    return [str(Path(p).expanduser()) for p in paths]


# ---------------------------------------------------------------------------------------------------------------
# Universal checkpoint: how each U-Net parameter is split over TP (zoo.models.unet's parallel plan)
# ---------------------------------------------------------------------------------------------------------------


def universal_checkpoint_info(config) -> dict:
    """The name patterns DeepSpeed's universal checkpoint needs (``re.match`` on ``"<layer>.<param>"``; each must
    match some parameter of this config).

    ===========================================  ======================================================
    ``<i>.conv1.*``, ``time_emb_proj.*``,         column-parallel (output channels): joined on dim 0,
    ``norm2.*`` (ResNet blocks)                   DeepSpeed's default, so no pattern
    ``<i>.conv2.weight``, ``to_out.weight``       row-parallel: joined on dim 1
    ``<i>.qkv.{weight,bias}``                     column-parallel with stride 3: rows ``[W_q; W_k; W_v]``,
                                                  each third split over TP (sub-parameters)
    everything else                               replicated: stem, head, down/up-sampling convs, norm1,
                                                  conv_shortcut, attention group_norm, row-parallel biases
    ===========================================  ======================================================
    """
    from zoo.models.unet import units

    plan = units(config, sizes=(1, 1))
    kinds = {u.kind for u in plan}
    replicated = [r"0\.", rf"{len(plan) - 1}\.", r"\d+\.norm1\.", r"\d+\.conv2\.bias"]
    if any(u.kind == "res" and u.in_channels != u.out_channels for u in plan):
        replicated.append(r"\d+\.conv_shortcut\.")
    if kinds & {"down", "up"}:
        replicated.append(r"\d+\.conv\.")
    row = [r"\d+\.conv2\.weight"]
    sub_params = []
    if "attn" in kinds:
        replicated += [r"\d+\.group_norm\.", r"\d+\.to_out\.bias"]
        row.append(r"\d+\.to_out\.weight")
        for i, u in enumerate(plan):
            if u.kind == "attn":
                c = u.in_channels  # heads x head_dim = channels
                sub_params += [{"patterns": [rf"{i}\.qkv\.weight"], "shape": ((c, c, c), -1), "partition_dim": 0},
                               {"patterns": [rf"{i}\.qkv\.bias"], "shape": ((c, c, c),), "partition_dim": 0}]
    info = {"tp_replicated_parameter_patterns": replicated, "parameter_with_row_parallelism_patterns": row}
    if sub_params:
        info["parameter_with_sub_params"] = sub_params
    return info


# ---------------------------------------------------------------------------------------------------------------
# Pictures
# ---------------------------------------------------------------------------------------------------------------


def class_colors(classes: int):
    """RGB in [0, 1] per class: background near-black, then matplotlib's tab10/tab20 colours."""
    import matplotlib

    table = matplotlib.colormaps["tab10" if classes <= 11 else "tab20"]
    return [(0.08, 0.08, 0.08)] + [table(i % table.N)[:3] for i in range(classes - 1)]


def draw_segmentation_grid(images, masks, predictions, classes: int, path, title: str = "",
                           class_names: tuple[str, ...] | None = None) -> Path:
    """One row per image: the image, its true mask, the predicted mask; PNG at ``path``.
    ``images [n, C, H, W]`` in [-1, 1], ``masks`` and ``predictions`` ``[n, H, W]`` class indices."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    colors = class_colors(classes)
    cmap = ListedColormap(colors)
    n = images.shape[0]
    fig, axes = plt.subplots(n, 3, figsize=(6.6, 2.2 * n + (0.5 if title else 0.2)), squeeze=False)
    for r in range(n):
        img = ((images[r].float().clamp(-1, 1) + 1) / 2).permute(1, 2, 0).numpy()
        panels = [(img[..., 0] if img.shape[2] == 1 else img, "gray" if img.shape[2] == 1 else None),
                  (masks[r].numpy(), cmap), (predictions[r].numpy(), cmap)]
        for c, (data, cm) in enumerate(panels):
            ax = axes[r][c]
            ax.imshow(data, cmap=cm, vmin=0 if cm is cmap else None, vmax=classes - 1 if cm is cmap else None,
                      interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if r == 0:
                ax.set_title(("image", "true mask", "predicted")[c], fontsize=10)
    names = class_names if class_names and len(class_names) == classes else [f"class {i}" for i in range(classes)]
    fig.legend(handles=[Patch(color=colors[i], label=names[i]) for i in range(classes)], loc="lower center",
               ncol=min(classes, 4), fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def grid_path(out, step: int) -> Path:
    return Path(out) / SAMPLES_DIR / f"step_{step:08d}.png"


# ---------------------------------------------------------------------------------------------------------------
# The families
# ---------------------------------------------------------------------------------------------------------------


class _UNetFamily(Family):
    unit = "samples"
    embedded_shapes = True

    @property
    def checkpointable_layers(self):
        from zoo.models.unet import CHECKPOINTABLE_LAYERS

        return CHECKPOINTABLE_LAYERS

    def layer_specs(self, config, par):
        from zoo.models.unet import layer_specs

        return layer_specs(config, par)

    def build_pipeline(self, config, specs, grid, *, loss_fn, cfg):
        """Stages balanced by FLOPs (``parallel.partition_method: compute``) or by DeepSpeed's methods; the tuple
        ``(h, [temb,] *skips)`` crosses stage boundaries packed into one tensor (``build_unet_pipeline``)."""
        from zoo.models.unet import build_unet_pipeline

        par = cfg.parallel
        return build_unet_pipeline(config, specs, grid, loss_fn=loss_fn, base_seed=cfg.training.seed,
                                   partition_method=par.partition_method,
                                   activation_checkpointing=par.activation_checkpointing)

    def units_per_sample(self, cfg) -> int:
        return 1

    def universal_checkpoint_info(self, config) -> dict:
        return universal_checkpoint_info(config)

    def _validate_common(self, cfg, config) -> None:
        data, par = cfg.data, cfg.parallel
        if data.source not in SOURCES:
            raise ValueError(f"data.source {data.source!r} is not available for {self.name}; supported: "
                             f"{list(SOURCES)} (embedded: generated shapes; folders: data.paths of image folders)")
        if par.sequence_parallel:
            raise ValueError("parallel.sequence_parallel is not implemented for U-Nets (activations are "
                             "[b, C, H, W]); set parallel.sequence_parallel=false")
        if not 0.0 <= data.valid_fraction < 1.0:
            raise ValueError(f"data.valid_fraction must be in [0, 1), got {data.valid_fraction}")
        if config.in_channels not in (1, 3) and data.source == "folders":
            raise ValueError(f"image folders give 1 (grayscale) or 3 (RGB) channels, the model has in_channels "
                             f"{config.in_channels}")

    def data_sizes(self, cfg, config) -> tuple[int, int]:
        """``(H, W)`` of the training images: the folder's (all equal, checked), else the config's."""
        if cfg.data.source == "folders":
            from zoo.data.image_folders import image_size, list_images

            return image_size(next(iter(list_images(cfg.data.paths[0]).values())))
        return config.sizes

    def training_flops_per_sample(self, cfg, config):
        """Forward + backward (2x forward) of ``flops_per_sample``, plus one more forward of the checkpointed
        layers (ResNet and attention blocks) under activation checkpointing."""
        from zoo.models.unet import layer_flops, units

        sizes = self.data_sizes(cfg, config)
        flops = layer_flops(config, sizes)
        total = 3 * sum(flops)
        if cfg.parallel.activation_checkpointing:
            total += sum(f for f, u in zip(flops, units(config, sizes)) if u.kind in ("res", "attn"))
        return float(total)


class SegmentationFamily(_UNetFamily):
    name = SEG_FAMILY

    @property
    def config_class(self):
        from zoo.models.unet import SegUNetConfig

        return SegUNetConfig

    def loss(self, config, par=None):
        return SegmentationLossWithStats(config)

    def loss_label(self, cfg) -> str:
        return "cross entropy (nats/pixel)"

    def derive_metrics(self, stats: dict) -> dict:
        return segmentation_metrics(stats)

    def validate(self, cfg, config) -> None:
        """Data checks before any process group: the folders are opened file by file (pairs, sizes, labels)."""
        from zoo.data.image_folders import ImageMaskFolders
        from zoo.data.shapes import CLASSES

        self._validate_common(cfg, config)
        data, depth = cfg.data, len(config.block_out_channels)
        if data.source != "folders":
            if config.classes < len(CLASSES):
                raise ValueError(f"the embedded shapes data has {len(CLASSES)} classes ({', '.join(CLASSES)}) but "
                                 f"the model has classes {config.classes}; set model.classes >= {len(CLASSES)}")
            _square_size(config.sizes, "model.image_size")
            return
        sizes = []
        for name, paths in (("data.paths", data.paths), ("data.valid_paths", data.valid_paths)):
            if name == "data.valid_paths" and paths is None:
                continue
            images, masks = _folder_pair(paths, name, 2)
            sizes.append(ImageMaskFolders(images, masks, channels=config.in_channels).check(config.classes, depth))
        if len(set(sizes)) > 1:
            raise ValueError(f"training images are {sizes[0][0]}x{sizes[0][1]} but validation images "
                             f"{sizes[1][0]}x{sizes[1][1]} (HxW); use one size")

    def build_data(self, cfg, config, grid) -> Data:
        data, tr = cfg.data, cfg.training
        if data.source != "folders":
            from zoo.data.shapes import ShapesSegmentation

            size = _square_size(config.sizes, "model.image_size")
            kw = dict(length=EMBEDDED_LENGTH, channels=config.in_channels, **shapes_options(data))
            return Data(ShapesSegmentation(size, seed=tr.seed, **kw), ShapesSegmentation(size, seed=tr.seed + 1, **kw))
        return Data(*self.folder_datasets(data, tr.seed, config.in_channels))

    @staticmethod
    def folder_datasets(data, seed: int, ch: int):
        """(train, valid or None) image/mask datasets of ``data.paths`` / ``data.valid_paths`` / ``valid_fraction``
        (``data``: the run's data section), ``ch`` channels per image."""
        from zoo.data.image_folders import ImageMaskFolders, split_stems

        images, masks = _folder_pair(data.paths, "data.paths", 2)
        if data.valid_paths:
            v_images, v_masks = _folder_pair(data.valid_paths, "data.valid_paths", 2)
            return (ImageMaskFolders(images, masks, channels=ch, seed=seed),
                    ImageMaskFolders(v_images, v_masks, channels=ch, seed=seed, shuffle=False))
        full = ImageMaskFolders(images, masks, channels=ch, seed=seed)
        train, valid = split_stems(full.stems, data.valid_fraction, seed)
        return (ImageMaskFolders(images, masks, channels=ch, seed=seed, stems=train),
                ImageMaskFolders(images, masks, channels=ch, seed=seed, stems=valid, shuffle=False) if valid else None)

    # -- pictures ---------------------------------------------------------------------------------------------

    @staticmethod
    def grid_batch(valid, n: int = GRID_IMAGES):
        """The first ``n`` validation samples: ``(images [n, C, H, W], masks [n, H, W])``."""
        samples = [valid[i] for i in range(min(n, len(valid)))]
        return torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples])

    def after_evaluation(self, engine, cfg, grid, data: Data, step: int) -> Path | None:
        """The grid of the first validation images at this evaluation, in any layout. Collective: every rank
        calls it (TP and pipeline stages take part in the forward); global rank 0 writes the PNG."""
        from zoo.parallel.pipe_forward import move_tensor

        if data.valid is None:
            return None
        images, masks = self.grid_batch(data.valid)
        device = next(engine.module.parameters()).device
        module = engine.module
        was_training = module.training
        module.eval()
        logits = _forward_all_stages(module, images.to(device), grid, device)
        module.train(was_training)
        if grid.pp > 1:  # the last stage holds the logits; hand them to stage 0 of the same pipeline
            logits = move_tensor(logits, grid.pp_ranks[-1], grid.pp_ranks[0], device)
        if grid.rank != 0:
            return None
        return self.draw(images, masks, logits.argmax(1).cpu(), logits.shape[1], grid_path(cfg.out, step),
                         f"step {step}", source=cfg.data.source)

    @staticmethod
    def draw(images, masks, predictions, classes: int, path, title: str, source: str = "embedded") -> Path:
        from zoo.data.shapes import CLASSES
        from zoo.models.unet import dice_score

        dice = dice_score(predictions, masks, classes)[1:]
        present = dice[~torch.isnan(dice)]
        shown = f"{title} | Dice of these {masks.shape[0]}: {float(present.mean()):.3f}" if len(present) else title
        names = CLASSES if source != "folders" and classes == len(CLASSES) else None
        return draw_segmentation_grid(images, masks, predictions, classes, path, shown, names)

    def after_training(self, model_dir, log) -> dict:
        """The grid from the exported model, read back from disk in this process (any training layout)."""
        from zoo.generate.unet import PretrainedUNet
        from zoo.training.config import DataSection

        out = Path(model_dir).parent
        raw = read_run_config(out)
        model = PretrainedUNet.from_pretrained(model_dir)
        tr = raw.get("training") or {}
        seed, step = int(tr.get("seed", 1234)), int(tr.get("steps", 0))
        data = DataSection(**(raw.get("data") or {}))
        if data.source == "folders":
            train, valid = self.folder_datasets(data, seed, model.config.in_channels)
            valid = train if valid is None else valid
        else:
            from zoo.data.shapes import ShapesSegmentation

            size = _square_size(model.config.sizes, "model.image_size")
            valid = ShapesSegmentation(size, seed=seed + 1, length=EMBEDDED_LENGTH, channels=model.config.in_channels,
                                       **shapes_options(data))
        images, masks = self.grid_batch(valid)
        path = self.draw(images, masks, model.segment(images), model.config.classes, grid_path(out, step),
                         f"step {step} (exported model)", source=data.source)
        log(f"segmentation grid (image / true mask / predicted): {path}")
        return {"predictions/exported_model": path}


def _forward_all_stages(module, x, grid, device):
    """The model's output for input ``x`` on the last pipeline stage (None on the others), without DeepSpeed's
    engine: each stage receives the previous one's packed ``(flat, shapes)`` pair (``UNetPipelineModule``)."""
    from zoo.parallel.pipe_forward import recv_tensor, send_tensor

    with torch.no_grad():
        if grid.pp == 1:
            return module(x)
        stage, ranks = grid.pp_rank, grid.pp_ranks
        if stage > 0:
            x = (recv_tensor(ranks[stage - 1], device), recv_tensor(ranks[stage - 1], device))
        out = module(x)
        if stage < grid.pp - 1:
            for t in out:
                send_tensor(t, ranks[stage + 1])
            return None
        return out


def init_objective(src) -> str:
    """The objective the diffusion model in ``src`` (a zoo or diffusers folder) was trained with, from its scheduler
    config (none: DDPM): training from it goes on with that one unless training.objective says otherwise."""
    from zoo.convert import io
    from zoo.convert.unet import model_folder, scheduler_config_of
    from zoo.models.unet import objective_of

    src = Path(src).expanduser()
    folder = src if io.is_model_folder(src) else model_folder(src)
    return objective_of(scheduler_config_of(src, folder))


class DiffusionFamily(_UNetFamily):
    name = DIFFUSION_FAMILY
    diffusion_objective = True

    @property
    def config_class(self):
        from zoo.models.unet import DiffusionUNetConfig

        return DiffusionUNetConfig

    def config_from_init(self, src, overrides):
        """A diffusers ``UNet2DModel`` folder (or a pipeline folder with ``unet/``): its config, converted."""
        import json

        from zoo.convert.unet import diffusers_config_to_zoo, model_folder

        folder = model_folder(src)
        config = diffusers_config_to_zoo(json.loads((folder / "config.json").read_text()))
        return self.config_class.from_dict({**config.to_dict(), **overrides}), None

    def import_folder(self, src, out):
        from zoo.convert.unet import import_unet2d

        import_unet2d(src, out)

    def loss(self, config, par=None):
        from zoo.models.unet import DiffusionLoss

        return DiffusionLoss(config)

    def loss_label(self, cfg) -> str:
        target = "velocity" if cfg.training.objective == "flow" else "noise"
        return f"mean squared error of the predicted {target}"

    def validate(self, cfg, config) -> None:
        from zoo.data.image_folders import ImageFolder

        self._validate_common(cfg, config)
        if cfg.training.init_from is not None and cfg.training.objective is None:
            cfg.training.objective = init_objective(cfg.training.init_from)
        if config.out_channels != config.in_channels:
            raise ValueError(f"DDPM predicts the noise added to the image: model.out_channels {config.out_channels} "
                             f"must equal model.in_channels {config.in_channels}")
        if config.sample_size is None:
            raise ValueError("model.sample_size is None; set the training image size (e.g. model.sample_size=32)")
        data, depth = cfg.data, len(config.block_out_channels)
        if data.source != "folders":
            _square_size(config.sizes, "model.sample_size")
            return
        for name, paths in (("data.paths", data.paths), ("data.valid_paths", data.valid_paths)):
            if name == "data.valid_paths" and paths is None:
                continue
            (images,) = _folder_pair(paths, name, 1)
            size = ImageFolder(images, channels=config.in_channels).check(depth)
            if size != config.sizes:
                raise ValueError(f"images in {images} are {size[0]}x{size[1]} (HxW) but model.sample_size is "
                                 f"{config.sample_size}: the model samples images of that size; set "
                                 f"model.sample_size={size[0] if size[0] == size[1] else list(size)}")

    def build_data(self, cfg, config, grid) -> Data:
        data, seed = cfg.data, cfg.training.seed
        if data.source != "folders":
            from zoo.data.shapes import ShapesImages

            size = _square_size(config.sizes, "model.sample_size")
            kw = dict(length=EMBEDDED_LENGTH, channels=config.in_channels, **shapes_options(data))
            train, valid = ShapesImages(size, seed=seed, **kw), ShapesImages(size, seed=seed + 1, **kw)
        else:
            from zoo.data.image_folders import ImageFolder, split_stems

            (images,) = _folder_pair(data.paths, "data.paths", 1)
            ch = config.in_channels
            if data.valid_paths:
                (v_images,) = _folder_pair(data.valid_paths, "data.valid_paths", 1)
                train = ImageFolder(images, channels=ch, seed=seed)
                valid = ImageFolder(v_images, channels=ch, seed=seed, shuffle=False)
            else:
                t_stems, v_stems = split_stems(ImageFolder(images, channels=ch).stems, data.valid_fraction, seed)
                train = ImageFolder(images, channels=ch, seed=seed, stems=t_stems)
                valid = ImageFolder(images, channels=ch, seed=seed, stems=v_stems, shuffle=False) if v_stems else None
        from zoo.models.unet import schedule_for

        schedule = schedule_for(cfg.training.objective)
        return Data(NoisedImages(train, seed, schedule),
                    None if valid is None else NoisedImages(valid, seed + 1, schedule))

    def export_files(self, cfg, config) -> dict[str, str]:
        """``scheduler_config.json``: the diffusers scheduler of the objective, so the folder says how to sample it
        (zoo's sampler, and diffusers' ``<Scheduler>.from_pretrained`` on the diffusers export)."""
        import json

        from zoo.models.unet import SCHEDULER_CONFIG, schedule_for

        return {SCHEDULER_CONFIG: json.dumps(schedule_for(cfg.training.objective).to_diffusers(), indent=2)}

    def after_training(self, model_dir, log, num: int | None = None, steps: int | None = None) -> dict:
        """``OUT/samples.png``: ``num`` images sampled from the exported model (``steps`` sampling steps of its
        objective), read back from disk in this process."""
        from zoo.generate.unet import PretrainedUNet, save_grid

        out = Path(model_dir).parent
        seed = int((read_run_config(out).get("training") or {}).get("seed", 0))
        model = PretrainedUNet.from_pretrained(model_dir)
        flow = model.objective == "flow"
        num, steps = num or SAMPLE_IMAGES, steps or (FLOW_SAMPLE_STEPS if flow else SAMPLE_STEPS)
        path = save_grid(out / "samples.png", model.sample(num, steps=steps, seed=seed))
        log(f"samples ({num} images, {steps} {'Euler (flow matching)' if flow else 'DDPM'} steps, seed {seed}): "
            f"{path}")
        return {"samples": path}


FAMILIES = {SEG_FAMILY: SegmentationFamily(), DIFFUSION_FAMILY: DiffusionFamily()}  # zoo.training.families.REGISTRY

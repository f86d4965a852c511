"""diffusers <-> zoo for the diffusion U-Net family: import, export and verify (by the predicted noise).

The key table and the config mapping are ``zoo.convert.hf.unet2d``'s (the one diffusers class zoo converts,
UNet2DModel); this module reads and writes the folders. Reading accepts a model folder or a pipeline folder with
the model in ``unet/``, weights in ``diffusion_pytorch_model.safetensors`` (or sharded with its index). Import
streams one tensor at a time into ``zoo.convert.io.write_model_folder``; export writes one
``diffusion_pytorch_model.safetensors`` (UNet2DModels are small) plus ``config.json``, loadable with
``UNet2DModel.from_pretrained``. The scheduler config that says how the model samples (``scheduler_config.json``:
``DDPMScheduler`` or ``FlowMatchEulerDiscreteScheduler``) travels both ways: export copies the zoo folder's beside
the weights (``<Scheduler>.from_pretrained(folder)`` reads it); import takes a pipeline's ``scheduler/`` one or one
beside the model, when zoo's sampler implements it (another scheduler, e.g. DDIM's, is left behind: zoo samples the
model with DDPM's chain). Refused, one line each: pickle-only folders, missing, misshapen or unused tensors, a zoo
folder of another family.

Verify: the predicted noise on seeded samples ``[b, in_channels, H, W]`` (H, W from sample_size) and integer
timesteps ``[b]``; pipeline stages pass the U-Net's packed ``(flat, shapes)`` boundary tensors
(``zoo.models.unet.UNetPipelineModule``), and only rank 0 imports diffusers.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from zoo.convert import io, verify
from zoo.convert.errors import ConvertError
from zoo.convert.hf.unet2d import (  # noqa: F401  (public here: the family's names)
    CLASS_NAME,
    diffusers_config_to_zoo,
    key_table,
    resolve_deprecated,
    to_zoo,
    zoo_config_to_diffusers,
)
from zoo.convert.hub import resolve_hf_folder
from zoo.convert.reader import header_shapes, read_zoo_config
from zoo.models.gpt import ParallelOptions
from zoo.models.unet import DIFFUSION_FAMILY, SCHEDULER_CONFIG, SEG_FAMILY, DiffusionUNetConfig, schedule_from_config
from zoo.parallel.topology import initialize_model_parallel

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX = "diffusion_pytorch_model.safetensors.index.json"
PICKLE_NAME = "diffusion_pytorch_model.bin"


def read_zoo_unet(folder, refusal: str) -> DiffusionUNetConfig:
    """The DiffusionUNetConfig of a zoo folder; another family refused in one line, ``"... ; <refusal>"``."""
    family, meta = read_zoo_config(folder)
    if family != DIFFUSION_FAMILY:
        raise ConvertError(f"{folder} holds a {family!r} model; {refusal}")
    try:
        return DiffusionUNetConfig.from_dict(meta)
    except ValueError as e:
        raise ConvertError(str(e)) from None


# ---------------------------------------------------------------------------------------------------------------
# Import and export
# ---------------------------------------------------------------------------------------------------------------


def model_folder(src: str | os.PathLike) -> Path:
    """The folder holding the UNet2DModel: ``src`` itself, or its ``unet/`` subfolder (a pipeline folder)."""
    folder = Path(src).expanduser()
    if not folder.is_dir():
        raise ConvertError(f"diffusers folder {src} does not exist")
    if (folder / CONFIG_NAME).is_file():
        return folder
    if (folder / "unet" / CONFIG_NAME).is_file():
        return folder / "unet"
    raise ConvertError(f"{folder} has no {CONFIG_NAME} (nor unet/{CONFIG_NAME}); pass a UNet2DModel folder or a "
                       f"pipeline folder with the model in unet/")


def weight_files(folder: Path) -> dict[str, str]:
    """Tensor name -> safetensors file of a diffusers model folder."""
    if (folder / WEIGHTS_INDEX).is_file():
        return dict(json.loads((folder / WEIGHTS_INDEX).read_text())["weight_map"])
    if (folder / WEIGHTS_NAME).is_file():
        with safe_open(folder / WEIGHTS_NAME, "pt") as f:
            return {k: WEIGHTS_NAME for k in f.keys()}
    if (folder / PICKLE_NAME).is_file():
        raise ConvertError(f"{folder} holds only a pickle checkpoint ({PICKLE_NAME}), which can run code when loaded; "
                           f"re-save it as safetensors (UNet2DModel.from_pretrained(...).save_pretrained(...))")
    raise ConvertError(f"{folder} has no weights ({WEIGHTS_NAME} or {WEIGHTS_INDEX})")


def expected_shapes(config: DiffusionUNetConfig) -> dict[str, tuple[int, ...]]:
    """Full (tp=1) shape of every zoo tensor, from the model built on the meta device (no memory, no weights)."""
    from zoo.models.specs import SpecSequential
    from zoo.models.unet import layer_specs
    from zoo.parallel.topology import get_tensor_model_parallel_group, group_rank_and_size

    tp = group_rank_and_size(get_tensor_model_parallel_group())[1]  # 1 unless called inside a TP run
    with torch.device("meta"):
        model = SpecSequential(layer_specs(config))
    shapes = {}
    for name, p in model.named_parameters():
        shape = list(p.shape)
        if getattr(p, "tensor_model_parallel", False):
            shape[p.partition_dim] *= tp
        shapes[name] = tuple(shape)
    return shapes


def import_unet2d(src_folder: str | os.PathLike, out_folder: str | os.PathLike, *, dtype: torch.dtype | None = None,
                  max_shard_bytes: int = io.DEFAULT_SHARD_BYTES) -> Path:
    """Write the diffusers UNet2DModel in ``src_folder`` (or its ``unet/``) as a zoo model folder ``out_folder``.

    Everything is checked (class, config, every tensor's presence and shape, no unused tensor) before a byte is
    written; tensors are then streamed one at a time. ``dtype`` None keeps the checkpoint's dtypes.
    """
    folder = model_folder(src_folder)
    try:
        meta = json.loads((folder / CONFIG_NAME).read_text())
    except ValueError as e:
        raise ConvertError(f"{folder / CONFIG_NAME} is not valid JSON ({e})") from None
    config = diffusers_config_to_zoo(meta)
    files = weight_files(folder)
    shapes = header_shapes(folder, files)
    rows = resolve_deprecated(key_table(config), shapes)
    expected = expected_shapes(config)
    assert sorted(r.zoo for r in rows) == sorted(expected), "key table and model disagree"
    for row in rows:
        for key in row.hf:
            if key not in shapes:
                raise ConvertError(f"tensor {key} is missing from {folder}")
        got = tuple(row.to_zoo(*(torch.empty(shapes[k], device="meta") for k in row.hf)).shape)
        if got != expected[row.zoo]:
            raise ConvertError(f"tensor(s) {', '.join(row.hf)} in {folder} have shape(s) "
                               f"{[shapes[k] for k in row.hf]}; config.json implies {expected[row.zoo]} for {row.zoo}")
    unused = sorted(set(shapes) - {k for r in rows for k in r.hf})
    if unused:
        raise ConvertError(f"{folder}: {len(unused)} tensor(s) the UNet2DModel table does not use, e.g. {unused[:3]}; "
                           f"the model has a feature zoo does not convert")

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        with ExitStack() as stack:
            handles = {f: stack.enter_context(safe_open(folder / f, "pt")) for f in sorted(set(files.values()))}
            for row in rows:
                t = row.to_zoo(*(handles[files[k]].get_tensor(k) for k in row.hf))
                yield row.zoo, t if dtype is None else t.to(dtype)

    extra = {}
    scheduler = scheduler_config_of(Path(src_folder).expanduser(), folder)
    if scheduler is not None:
        extra[SCHEDULER_CONFIG] = json.dumps(scheduler, indent=2)
    return io.write_model_folder(out_folder, DIFFUSION_FAMILY, config.to_dict(), tensors(),
                                 max_shard_bytes=max_shard_bytes, extra_files=extra)


def scheduler_config_of(src: Path, model_dir: Path) -> dict | None:
    """The scheduler config of a diffusers pipeline (``scheduler/``) or model folder that zoo's sampler implements,
    else None."""
    for path in (src / "scheduler" / SCHEDULER_CONFIG, model_dir / SCHEDULER_CONFIG):
        if path.is_file():
            try:
                config = json.loads(path.read_text())
                schedule_from_config(config)
            except ValueError:
                return None
            return config
    return None


def export_unet2d(zoo_folder: str | os.PathLike, out_folder: str | os.PathLike, *,
                  dtype: torch.dtype | None = None) -> Path:
    """Write the zoo diffusion U-Net in ``zoo_folder`` as a diffusers UNet2DModel folder ``out_folder``
    (``config.json`` + ``diffusion_pytorch_model.safetensors``). ``dtype`` None keeps the stored dtypes."""
    src = Path(zoo_folder)
    config = read_zoo_unet(src, f"this converter exports the {DIFFUSION_FAMILY} family")
    try:
        files = io.weight_map(src)
    except io.CheckpointError as e:
        raise ConvertError(str(e)) from None
    rows = key_table(config)
    stored = header_shapes(src, files)
    expected = expected_shapes(config)
    for row in rows:
        if row.zoo not in stored:
            raise ConvertError(f"tensor {row.zoo} is missing from {src}")
        if stored[row.zoo] != expected[row.zoo]:
            raise ConvertError(f"tensor {row.zoo}: {src} has shape {stored[row.zoo]}, its config implies "
                               f"{expected[row.zoo]}")
    out: dict[str, torch.Tensor] = {}
    with ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(src / f, "pt")) for f in sorted(set(files.values()))}
        for row in rows:
            value = handles[files[row.zoo]].get_tensor(row.zoo)
            for key, t in zip(row.hf, row.hf_tensors(value)):
                out[key] = (t if dtype is None else t.to(dtype)).contiguous()
    final = Path(out_folder)
    staging = io.staging_folder(final)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    save_file(out, str(staging / WEIGHTS_NAME), metadata={"format": "pt"})
    (staging / CONFIG_NAME).write_text(json.dumps(zoo_config_to_diffusers(config), indent=2))
    if (src / SCHEDULER_CONFIG).is_file():
        shutil.copyfile(src / SCHEDULER_CONFIG, staging / SCHEDULER_CONFIG)
    io.publish(staging, final)
    return final


def verify_unet2d(diffusers_folder: str | os.PathLike, zoo_folder: str | os.PathLike, *, batch_size: int = 2,
                  seed: int = 0) -> float:
    """Max absolute difference between diffusers' UNet2DModel and the zoo model in one process without process
    groups (tp=1, fp32) on the fixed batch (:func:`unet_inputs`): ~1e-6 for a faithful conversion."""
    from zoo.models.specs import SpecSequential
    from zoo.models.unet import layer_specs

    config = read_zoo_unet(zoo_folder, f"not {DIFFUSION_FAMILY!r}")
    model = SpecSequential(layer_specs(config)).eval()
    io.load_model(zoo_folder, model)
    model.float()
    inputs = unet_inputs(config, batch_size, seed)
    with torch.no_grad():
        ours = model(inputs)
    return verify.max_abs_diff([ours], [diffusers_unet_output(model_folder(diffusers_folder), inputs)])


# ---------------------------------------------------------------------------------------------------------------
# verify: the predicted noise
# ---------------------------------------------------------------------------------------------------------------

# Fields that make two UNet2DModels different models (others, e.g. eps or flip_sin_to_cos, show up as a difference).
UNET_STRUCTURE = ("in_channels", "out_channels", "block_out_channels", "layers_per_block", "down_block_types",
                  "up_block_types", "mid_block_type", "add_attention", "attention_head_dim", "norm_num_groups",
                  "time_embedding_dim")
UNET_TIMESTEPS = 1000  # DDPM's training steps: the timesteps of the fixed batch are drawn below this
UNET_DEFAULT_SIZE = 32  # the sample size when the config has none (diffusers' sample_size None)


def check_unet_zoo(zoo, tp: int, pp: int):
    """The zoo folder's DiffusionUNetConfig, and whether (tp, pp) can hold it; on every rank, before any group."""
    cfg = read_zoo_unet(zoo, f"this verifier compares {DIFFUSION_FAMILY} models")
    verify.check_layout(cfg, tp, pp)
    return cfg


def check_unet_hf(hf, cfg):
    """The diffusers model folder (``hf`` itself or its ``unet/``), checked to be a UNet2DModel in safetensors with
    ``cfg``'s structure."""
    folder = model_folder(resolve_hf_folder(hf))
    try:
        meta = json.loads((folder / CONFIG_NAME).read_text())
    except ValueError as e:
        raise ConvertError(f"{folder / CONFIG_NAME} is not valid JSON ({e})") from None
    if not isinstance(meta, dict) or "_class_name" not in meta:
        raise ConvertError(f"{folder / CONFIG_NAME} is not a diffusers model config (no _class_name); "
                           f"the zoo folder holds a {CLASS_NAME}")
    theirs = to_zoo(meta)  # without the warnings about fields UNet2DModel ignores: import already said so
    weight_files(folder)  # refuses a pickle-only or weightless folder
    for name in UNET_STRUCTURE:
        if getattr(theirs, name) != getattr(cfg, name):
            raise ConvertError(f"{hf} and the zoo folder are different models: {name} {getattr(theirs, name)} vs "
                               f"{getattr(cfg, name)}")
    return folder


def unet_sizes(cfg) -> tuple[int, int]:
    """(H, W) of the fixed batch: the config's sample_size, or 32 rounded up to what the levels can halve."""
    if cfg.sample_size is not None:
        return cfg.sizes
    multiple = 2 ** (len(cfg.block_out_channels) - 1)
    size = -(-UNET_DEFAULT_SIZE // multiple) * multiple
    return size, size


def unet_inputs(cfg, batch: int = 2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed batch: noisy samples ``[batch, in_channels, H, W]`` (fp32, N(0, 1)) and integer timesteps
    ``[batch]`` in [0, 1000), seeded."""
    g = torch.Generator().manual_seed(seed)
    sample = torch.randn(batch, cfg.in_channels, *unet_sizes(cfg), generator=g)
    timesteps = torch.randint(0, UNET_TIMESTEPS, (batch,), generator=g)
    return sample, timesteps


def zoo_unet_output(zoo, cfg, tp: int, pp: int, inputs) -> torch.Tensor | None:
    """The predicted noise ``[b, out_channels, H, W]`` (fp32) of the zoo folder at (tp, pp), on global rank 0;
    None elsewhere. Stages are :func:`zoo.models.unet.build_unet_pipeline`'s (balanced by FLOPs): each sends the
    next its packed ``(flat, shapes)`` pair; ResNet convs and attention heads are split over TP, the output is
    replicated on the TP group."""
    import dataclasses

    from deepspeed.accelerator import get_accelerator

    from zoo.models.specs import SpecSequential
    from zoo.models.unet import build_unet_pipeline
    from zoo.models.unet import layer_specs as unet_layer_specs

    device = get_accelerator().current_device_name()
    grid = initialize_model_parallel(tp, pp)
    # The stage split weighs layers by FLOPs at the image size; without one in the config, at the batch's
    # (sample_size changes no layer, so the keys and shapes are the same).
    built = cfg if cfg.sample_size is not None else dataclasses.replace(cfg, sample_size=tuple(inputs[0].shape[-2:]))
    specs = unet_layer_specs(built, ParallelOptions(tp_group=grid.tp_group))
    module = build_unet_pipeline(built, specs, grid, loss_fn=None) if pp > 1 else SpecSequential(specs)
    io.load_model(zoo, module, grid.tp_group)
    module.to(device).float().eval()
    with torch.no_grad():
        out = verify.pipeline_forward_tuple(module, tuple(t.to(device) for t in inputs), grid, device)
        out = None if out is None else out.float()
    return verify.to_rank0(out, grid, device)


def diffusers_unet_output(folder, inputs) -> torch.Tensor:
    """diffusers' ``UNet2DModel(sample, timesteps).sample`` in fp32."""
    from zoo.package import require

    UNet2DModel = require("diffusers").UNet2DModel  # the diffusion extra

    model = UNet2DModel.from_pretrained(folder, torch_dtype=torch.float32, use_safetensors=True).eval()
    with torch.no_grad():
        return model(*inputs).sample.float()


def verify_unet(hf, zoo, tp: int = 1, pp: int = 1, *, batch: int = 2, seed: int = 0, **_) -> verify.Verification:
    """max |zoo - diffusers| of the predicted noise on the fixed batch (:func:`unet_inputs`). Collective, as
    ``verify.verify``; only global rank 0 imports diffusers."""
    cfg = check_unet_zoo(zoo, tp, pp)
    initialize_model_parallel(tp, pp)
    folder = verify.on_rank0(lambda: check_unet_hf(hf, cfg))
    inputs = unet_inputs(cfg, batch, seed)
    ours = zoo_unet_output(zoo, cfg, tp, pp, inputs)
    return verify.compare_on_rank0([ours] if ours is not None else None,
                                   lambda device_map: ([diffusers_unet_output(folder, inputs)], None))


class UNetConverter:
    """The diffusion U-Net family in the convert registry: import, export (one file), verify."""

    name = DIFFUSION_FAMILY
    streams = False  # checked whole
    expert_parallel = False

    @staticmethod
    def import_hf(folder, out, *, dtype=None, allow_pickle=False, max_shard_bytes=io.DEFAULT_SHARD_BYTES):
        return import_unet2d(folder, out, dtype=dtype, max_shard_bytes=max_shard_bytes)

    @staticmethod
    def export(src, out, *, dtype=None, **_):  # one diffusion_pytorch_model.safetensors: UNet2DModels are small
        return export_unet2d(src, out, dtype=dtype)

    verify = staticmethod(verify_unet)


# zoo.convert.registry. The segmentation U-Net has no HF counterpart (diffusers has no such model): listed without a
# converter, so zoo-to-hf and verify refuse it in one line naming the families they do convert.
FAMILIES = {DIFFUSION_FAMILY: UNetConverter(), SEG_FAMILY: None}

"""diffusers ``UNet2DModel`` <-> zoo's diffusion U-Net (family ``unet-diffusion``, ``zoo.models.unet``).

zoo's diffusion U-Net is diffusers' UNet2DModel unit for unit, and its layers keep diffusers' parameter names, so
the mapping is a table per kind of unit (torchtitan's style): ``{}`` on zoo's side is the layer index, on diffusers'
side the unit's module path (``zoo.models.unet.units`` gives both, e.g. layer 5 <-> "down_blocks.1.attentions.0").
The one transform: attention's separate q/k/v projections are fused into zoo's ``qkv`` (rows ``[W_q; W_k; W_v]``,
which ``ParallelConvAttention`` shards with stride 3). All data movement, so diffusers -> zoo -> diffusers is
bit-exact; checked numerically against diffusers in tests/convert/test_diffusers.py.

Reading accepts a model folder or a pipeline folder with the model in ``unet/``, weights in
``diffusion_pytorch_model.safetensors`` (or sharded with its index), and the attention names of old checkpoints
(query/key/value/proj_attn, as google/ddpm-* ship). Import streams one tensor at a time into
``zoo.convert.io.write_model_folder``; export writes one ``diffusion_pytorch_model.safetensors`` (UNet2DModels are
small) plus ``config.json``, loadable with ``UNet2DModel.from_pretrained``. The scheduler config that says how the
model samples (``scheduler_config.json``: ``DDPMScheduler`` or ``FlowMatchEulerDiscreteScheduler``) travels both
ways: export copies the zoo folder's beside the weights (``<Scheduler>.from_pretrained(folder)`` reads it); import
takes a pipeline's ``scheduler/`` one or one beside the model, when zoo's sampler implements it (another scheduler,
e.g. DDIM's, is left behind: zoo samples the model with DDPM's chain). Refused, one line each: other model
classes, the UNet2DModel options zoo does not implement (``DiffusionUNetConfig.validate``), pickle-only folders,
missing, misshapen or unused tensors.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from contextlib import ExitStack
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from zoo.convert import io
from zoo.convert.hf_gpt import ConvertError
from zoo.models.unet import DIFFUSION_FAMILY, SCHEDULER_CONFIG, DiffusionUNetConfig, schedule_from_config, units

CLASS_NAME = "UNet2DModel"
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX = "diffusion_pytorch_model.safetensors.index.json"
PICKLE_NAME = "diffusion_pytorch_model.bin"


def same(w):
    """Same layout on both sides."""
    return w


def fuse_qkv(q, k, v):
    """diffusers' to_q, to_k, to_v ``[C, C]`` (or biases ``[C]``) -> zoo's qkv ``[3C, ...]`` = [q; k; v] by rows."""
    return torch.cat([q, k, v], dim=0)


def split_qkv(w):
    """zoo's qkv -> (to_q, to_k, to_v), the inverse of :func:`fuse_qkv` (clones: safetensors refuses shared views)."""
    return tuple(t.clone() for t in w.chunk(3, dim=0))


@dataclass(frozen=True)
class Row:
    """One zoo tensor from one or more diffusers tensors. ``{}``: layer index (zoo), module path (diffusers)."""

    zoo: str
    hf: tuple[str, ...]
    to_zoo: Callable = same
    to_hf: Callable = same

    def at(self, layer: int, path: str) -> "Row":
        return Row(self.zoo.format(layer), tuple(k.format(path) for k in self.hf), self.to_zoo, self.to_hf)

    def hf_tensors(self, zoo_tensor) -> tuple:
        out = self.to_hf(zoo_tensor)
        return out if isinstance(out, tuple) else (out,)


# ---------------------------------------------------------------------------------------------------------------
# Key tables, one per kind of unit (zoo.models.unet.Unit.kind)
# ---------------------------------------------------------------------------------------------------------------

STEM_TABLE = [  # top-level modules of UNet2DModel (time_proj has no weights)
    Row("{}.conv_in.weight", ("conv_in.weight",)),
    Row("{}.conv_in.bias", ("conv_in.bias",)),
    Row("{}.time_embedding.linear_1.weight", ("time_embedding.linear_1.weight",)),
    Row("{}.time_embedding.linear_1.bias", ("time_embedding.linear_1.bias",)),
    Row("{}.time_embedding.linear_2.weight", ("time_embedding.linear_2.weight",)),
    Row("{}.time_embedding.linear_2.bias", ("time_embedding.linear_2.bias",)),
]
RESNET_TABLE = [  # {down_blocks.i,mid_block,up_blocks.i}.resnets.j
    Row("{}.norm1.weight", ("{}.norm1.weight",)),
    Row("{}.norm1.bias", ("{}.norm1.bias",)),
    Row("{}.conv1.weight", ("{}.conv1.weight",)),
    Row("{}.conv1.bias", ("{}.conv1.bias",)),
    Row("{}.time_emb_proj.weight", ("{}.time_emb_proj.weight",)),
    Row("{}.time_emb_proj.bias", ("{}.time_emb_proj.bias",)),
    Row("{}.norm2.weight", ("{}.norm2.weight",)),
    Row("{}.norm2.bias", ("{}.norm2.bias",)),
    Row("{}.conv2.weight", ("{}.conv2.weight",)),
    Row("{}.conv2.bias", ("{}.conv2.bias",)),
]
SHORTCUT_TABLE = [  # ResNet blocks whose input and output channels differ
    Row("{}.conv_shortcut.weight", ("{}.conv_shortcut.weight",)),
    Row("{}.conv_shortcut.bias", ("{}.conv_shortcut.bias",)),
]
ATTENTION_TABLE = [  # {down_blocks.i,mid_block,up_blocks.i}.attentions.j
    Row("{}.group_norm.weight", ("{}.group_norm.weight",)),
    Row("{}.group_norm.bias", ("{}.group_norm.bias",)),
    Row("{}.qkv.weight", ("{}.to_q.weight", "{}.to_k.weight", "{}.to_v.weight"), fuse_qkv, split_qkv),
    Row("{}.qkv.bias", ("{}.to_q.bias", "{}.to_k.bias", "{}.to_v.bias"), fuse_qkv, split_qkv),
    Row("{}.to_out.weight", ("{}.to_out.0.weight",)),  # to_out.1 is dropout
    Row("{}.to_out.bias", ("{}.to_out.0.bias",)),
]
SAMPLER_TABLE = [  # down_blocks.i.downsamplers.0 and up_blocks.i.upsamplers.0
    Row("{}.conv.weight", ("{}.conv.weight",)),
    Row("{}.conv.bias", ("{}.conv.bias",)),
]
HEAD_TABLE = [
    Row("{}.conv_norm_out.weight", ("conv_norm_out.weight",)),
    Row("{}.conv_norm_out.bias", ("conv_norm_out.bias",)),
    Row("{}.conv_out.weight", ("conv_out.weight",)),
    Row("{}.conv_out.bias", ("conv_out.bias",)),
]
TABLES = {"stem": STEM_TABLE, "res": RESNET_TABLE, "attn": ATTENTION_TABLE, "down": SAMPLER_TABLE,
          "up": SAMPLER_TABLE, "head": HEAD_TABLE}

# Attention names of checkpoints saved before diffusers' Attention class (read on import, never written).
DEPRECATED_ATTENTION = {".to_q.": ".query.", ".to_k.": ".key.", ".to_v.": ".value.", ".to_out.0.": ".proj_attn."}


def key_table(config: DiffusionUNetConfig) -> list[Row]:
    """Every row of the model, ``{}`` filled in, in layer order."""
    rows = []
    for layer, u in enumerate(units(config, sizes=(1, 1))):
        table = TABLES[u.kind] + (SHORTCUT_TABLE if u.kind == "res" and u.in_channels != u.out_channels else [])
        rows += [r.at(layer, u.path) for r in table]
    return rows


# ---------------------------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------------------------


def diffusers_config_to_zoo(cfg_dict: dict) -> DiffusionUNetConfig:
    """A UNet2DModel ``config.json`` (as a dict) -> DiffusionUNetConfig. diffusers' bookkeeping keys (``_*``) are
    dropped; keys UNet2DModel does not take either are ignored with a warning (diffusers does the same)."""
    name = cfg_dict.get("_class_name", CLASS_NAME)
    if name != CLASS_NAME:
        raise ConvertError(f"model class {name} is not supported; zoo converts {CLASS_NAME} only")
    known = {f.name for f in fields(DiffusionUNetConfig)}
    kwargs = {k: v for k, v in cfg_dict.items() if not k.startswith("_")}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        warnings.warn(f"ignoring config field(s) {unknown}, which {CLASS_NAME} does not take")
    kwargs = {k: v for k, v in kwargs.items() if k in known}
    kwargs.setdefault("sample_size", None)  # diffusers' default, where ours is 32
    try:
        return DiffusionUNetConfig.from_dict(kwargs)
    except ValueError as e:
        raise ConvertError(str(e)) from None


def zoo_config_to_diffusers(config: DiffusionUNetConfig | dict) -> dict:
    """DiffusionUNetConfig (or its dict) -> the ``config.json`` dict of the same UNet2DModel."""
    if isinstance(config, dict):
        config = DiffusionUNetConfig.from_dict(config)
    out = {"_class_name": CLASS_NAME}
    try:
        import diffusers

        out["_diffusers_version"] = diffusers.__version__
    except ImportError:
        pass
    return {**out, **config.to_dict()}


# ---------------------------------------------------------------------------------------------------------------
# Reading a diffusers folder
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


def _header_shapes(folder: Path, files: dict[str, str]) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for fname in sorted(set(files.values())):
        if not (folder / fname).is_file():
            raise ConvertError(f"{folder / fname} is listed in the index but missing")
        with safe_open(folder / fname, "pt") as f:
            shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
    return shapes


def _resolve_deprecated(rows: list[Row], present) -> list[Row]:
    """Rows whose diffusers keys are renamed to the deprecated attention names where only those are present."""
    out = []
    for row in rows:
        keys = []
        for key in row.hf:
            if key not in present:
                for new, old in DEPRECATED_ATTENTION.items():
                    if new in key and key.replace(new, old) in present:
                        key = key.replace(new, old)
                        break
            keys.append(key)
        out.append(Row(row.zoo, tuple(keys), row.to_zoo, row.to_hf))
    return out


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
    shapes = _header_shapes(folder, files)
    rows = _resolve_deprecated(key_table(config), shapes)
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
    try:
        family, meta = io.read_config(src)
        files = io.weight_map(src)
    except io.CheckpointError as e:
        raise ConvertError(str(e)) from None
    if family != DIFFUSION_FAMILY:
        raise ConvertError(f"{src} holds a {family!r} model; this converter exports the {DIFFUSION_FAMILY} family")
    try:
        config = DiffusionUNetConfig.from_dict(meta)
    except ValueError as e:
        raise ConvertError(str(e)) from None
    rows = key_table(config)
    stored = _header_shapes(src, files)
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
    """Max absolute difference between diffusers' UNet2DModel and the zoo model (one process, tp=1, fp32) on one
    random batch of noisy samples and timesteps: ~1e-6 for a faithful conversion."""
    from zoo.models.specs import SpecSequential
    from zoo.models.unet import layer_specs
    from zoo.package import require

    UNet2DModel = require("diffusers").UNet2DModel  # the diffusion extra

    family, meta = io.read_config(zoo_folder)
    if family != DIFFUSION_FAMILY:
        raise ConvertError(f"{zoo_folder} holds a {family!r} model, not {DIFFUSION_FAMILY!r}")
    config = DiffusionUNetConfig.from_dict(meta)
    reference = UNet2DModel.from_pretrained(model_folder(diffusers_folder), torch_dtype=torch.float32).eval()
    model = SpecSequential(layer_specs(config)).eval()
    io.load_model(zoo_folder, model)
    model.float()
    h, w = config.sizes if config.sample_size is not None else (32, 32)
    g = torch.Generator().manual_seed(seed)
    sample = torch.randn(batch_size, config.in_channels, h, w, generator=g)
    timesteps = torch.randint(0, 1000, (batch_size,), generator=g)
    with torch.no_grad():
        return float((model((sample, timesteps)) - reference(sample, timesteps).sample).abs().max())

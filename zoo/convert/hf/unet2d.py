"""diffusers ``UNet2DModel`` <-> zoo's diffusion U-Net (``zoo.models.unet``).

zoo's diffusion U-Net is diffusers' UNet2DModel unit for unit, and its layers keep diffusers' parameter names, so
the mapping is a table per kind of unit (torchtitan's style): ``{}`` on zoo's side is the layer index, on diffusers'
side the unit's module path (``zoo.models.unet.units`` gives both, e.g. layer 5 <-> "down_blocks.1.attentions.0").
The one transform: attention's separate q/k/v projections are fused into zoo's ``qkv`` (rows ``[W_q; W_k; W_v]``,
which ``ParallelConvAttention`` shards with stride 3). All data movement, so diffusers -> zoo -> diffusers is
bit-exact; checked numerically against diffusers in tests/convert/test_diffusers.py. Old checkpoints' attention
names (query/key/value/proj_attn, as google/ddpm-* ship) are read, never written.
Refused, one line each: other model classes, the UNet2DModel options zoo does not implement
(``DiffusionUNetConfig.validate``).
"""

from __future__ import annotations

import warnings
from dataclasses import fields

from zoo.convert.errors import ConvertError
from zoo.convert.registry import Architecture
from zoo.convert.tables import Row, concat_qkv, split_qkv
from zoo.models.unet import DIFFUSION_FAMILY, DiffusionUNetConfig, units

CLASS_NAME = "UNet2DModel"


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
    Row("{}.qkv.weight", ("{}.to_q.weight", "{}.to_k.weight", "{}.to_v.weight"), to_zoo=concat_qkv, to_hf=split_qkv),
    Row("{}.qkv.bias", ("{}.to_q.bias", "{}.to_k.bias", "{}.to_v.bias"), to_zoo=concat_qkv, to_hf=split_qkv),
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
        rows += [r.fill(layer, u.path) for r in table]
    return rows


def groups(config: DiffusionUNetConfig, **_) -> list[list[Row]]:
    """The table as one conversion group per layer (UNet2DModels are small; import and export read tensor by
    tensor anyway)."""
    rows = key_table(config)
    return [[r for r in rows if r.zoo.split(".")[0] == str(layer)] for layer in range(len(units(config, (1, 1))))]


def resolve_deprecated(rows: list[Row], present) -> list[Row]:
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
        out.append(row.with_hf(tuple(keys)))
    return out


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
        warnings.warn(f"ignoring config field(s) {unknown}, which {CLASS_NAME} does not take", stacklevel=2)
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


def to_zoo(meta: dict) -> DiffusionUNetConfig:
    """``diffusers_config_to_zoo`` without its warnings (for a folder already imported, where they were said)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return diffusers_config_to_zoo(meta)


class _ConfigDict:
    """diffusers has no config class apart from the model: config.json is read as a dict (``from_dict``)."""

    @staticmethod
    def from_dict(meta: dict) -> dict:
        return dict(meta)


ARCHITECTURES = {CLASS_NAME: Architecture(
    CLASS_NAME, DIFFUSION_FAMILY, lambda: _ConfigDict, diffusers_config_to_zoo, groups,
    lambda config, dtype=None, extra=None: zoo_config_to_diffusers(config), library="diffusers")}

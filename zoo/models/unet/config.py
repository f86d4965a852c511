"""The U-Net configs: the segmentation U-Net's and the diffusion U-Net's (diffusers' ``UNet2DModel`` arguments), their
presets, the family names of a zoo model folder, and the checks that refuse, in one line, a config or a tp/pp layout
zoo cannot build (read from the plan of units, :mod:`zoo.models.unet.plan`)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from zoo.models.config import ModelConfig, preset_config

# The plan (zoo.models.unet.plan) is built from these configs, and the checks and the parameter count here read it:
# they import it inside the function (at the top the import would be circular).

SEG_FAMILY, DIFFUSION_FAMILY = "unet-segmentation", "unet-diffusion"  # the "family" of a zoo model folder


def _need(ok: bool, where: str, msg: str) -> None:
    if not ok:
        raise ValueError(f"{where}: {msg}")


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


class _UNetConfig(ModelConfig):
    """What both U-Net configs share: the layout check and the parameter count of the network they describe."""

    def check_layout(self, tp: int, pp: int = 1) -> None:
        _check_layout(self, tp, pp)

    def num_parameters(self) -> int:
        from zoo.models.unet.plan import num_parameters

        return num_parameters(self)


@dataclass
class SegUNetConfig(_UNetConfig):
    in_channels: int = 3
    classes: int = 4  # including the background, class 0
    block_out_channels: tuple[int, ...] = (64, 128, 256, 512)  # width per level; depth = len
    layers_per_block: int = 2
    norm_num_groups: int = 32
    norm_eps: float = 1e-5
    image_size: int = 128  # for validation and cost estimates; any multiple of 2^(depth-1) runs
    dropout: float = 0.0

    def __post_init__(self):
        self.block_out_channels = tuple(self.block_out_channels)
        self.validate()

    def validate(self) -> None:
        where = "SegUNetConfig"
        _need(len(self.block_out_channels) >= 1, where, "block_out_channels needs at least one level")
        _need(self.layers_per_block >= 1, where, f"layers_per_block must be >= 1, got {self.layers_per_block}")
        _need(self.classes >= 2, where, f"classes must be >= 2 (background and one kind), got {self.classes}")
        _need(0.0 <= self.dropout < 1.0, where, f"dropout must be in [0, 1), got {self.dropout}")
        _check_sizes(where, "image_size", (self.image_size, self.image_size), len(self.block_out_channels))
        _check_groups(where, self)

    @property
    def sizes(self) -> tuple[int, int]:
        return self.image_size, self.image_size

    def to_dict(self) -> dict:
        d = asdict(self)
        d["block_out_channels"] = list(self.block_out_channels)
        return d

    @classmethod
    def from_preset(cls, name: str, **overrides) -> SegUNetConfig:
        return preset_config(cls, SEG_PRESETS, "segmentation U-Net", name, overrides)


SEG_PRESETS: dict[str, dict] = {
    "tiny": dict(in_channels=3, classes=4, block_out_channels=(16, 32), layers_per_block=1, norm_num_groups=4,
                 image_size=32),
    "base": dict(in_channels=3, classes=4, block_out_channels=(64, 128, 256, 512), layers_per_block=2,
                 norm_num_groups=32, image_size=128),
}

DOWN_BLOCK_TYPES = ("DownBlock2D", "AttnDownBlock2D")
UP_BLOCK_TYPES = ("UpBlock2D", "AttnUpBlock2D")


@dataclass
class DiffusionUNetConfig(_UNetConfig):
    """diffusers' ``UNet2DModel`` arguments, names and defaults (diffusers 0.42), except ``sample_size``."""

    sample_size: int | tuple[int, int] | None = 32
    in_channels: int = 3
    out_channels: int = 3
    center_input_sample: bool = False
    time_embedding_type: str = "positional"
    time_embedding_dim: int | None = None  # None: 4 x block_out_channels[0]
    freq_shift: int = 0
    flip_sin_to_cos: bool = True
    down_block_types: tuple[str, ...] = ("DownBlock2D", "AttnDownBlock2D", "AttnDownBlock2D", "AttnDownBlock2D")
    mid_block_type: str | None = "UNetMidBlock2D"
    up_block_types: tuple[str, ...] = ("AttnUpBlock2D", "AttnUpBlock2D", "AttnUpBlock2D", "UpBlock2D")
    block_out_channels: tuple[int, ...] = (224, 448, 672, 896)
    layers_per_block: int = 2
    mid_block_scale_factor: float = 1.0
    downsample_padding: int = 1
    downsample_type: str = "conv"
    upsample_type: str = "conv"
    dropout: float = 0.0
    act_fn: str = "silu"
    attention_head_dim: int | None = 8  # None: one head over all channels
    norm_num_groups: int = 32
    attn_norm_num_groups: int | None = None
    norm_eps: float = 1e-5
    resnet_time_scale_shift: str = "default"
    add_attention: bool = True
    class_embed_type: str | None = None
    num_class_embeds: int | None = None
    num_train_timesteps: int | None = None  # only read by the "learned" time embedding (refused)

    def __post_init__(self):
        for name in ("down_block_types", "up_block_types", "block_out_channels"):
            setattr(self, name, tuple(getattr(self, name)))
        if isinstance(self.sample_size, list):
            self.sample_size = tuple(self.sample_size)
        self.validate()

    def validate(self) -> None:
        where = "DiffusionUNetConfig"
        refuse = [  # (field, value zoo implements, why it matters)
            ("time_embedding_type", ("positional",), "zoo implements the sinusoidal (positional) embedding only"),
            ("resnet_time_scale_shift", ("default",), "zoo adds the time embedding to the ResNet features (default)"),
            ("downsample_type", ("conv",), "zoo downsamples with a stride-2 conv"),
            ("upsample_type", ("conv",), "zoo upsamples nearest-neighbour + conv"),
            ("act_fn", ("silu", "swish"), "zoo's blocks use SiLU"),
            ("mid_block_type", ("UNetMidBlock2D", None), "zoo implements UNetMidBlock2D (or none)"),
            ("class_embed_type", (None,), "class conditioning is not implemented"),
            ("num_class_embeds", (None,), "class conditioning is not implemented"),
        ]
        for name, allowed, why in refuse:
            value = getattr(self, name)
            _need(value in allowed, where, f"{name}={value!r} is not supported ({why}); use "
                  f"{' or '.join(repr(a) for a in allowed)}")
        _need(self.attn_norm_num_groups in (None, self.norm_num_groups), where,
              f"attn_norm_num_groups={self.attn_norm_num_groups} is not supported; the attention GroupNorm uses "
              f"norm_num_groups ({self.norm_num_groups}): set it to None")
        _need(self.downsample_padding in (0, 1), where,
              f"downsample_padding={self.downsample_padding} is not supported; use 1 or 0 (pad right/bottom by one)")
        depth = len(self.block_out_channels)
        _need(depth >= 1, where, "block_out_channels needs at least one level")
        _need(len(self.down_block_types) == depth and len(self.up_block_types) == depth, where,
              f"down_block_types ({len(self.down_block_types)}), up_block_types ({len(self.up_block_types)}) and "
              f"block_out_channels ({depth}) must have the same length")
        for name, kinds, allowed in (("down_block_types", self.down_block_types, DOWN_BLOCK_TYPES),
                                     ("up_block_types", self.up_block_types, UP_BLOCK_TYPES)):
            bad = [k for k in kinds if k not in allowed]
            _need(not bad, where, f"{name} {bad} not supported; use {' or '.join(allowed)}")
        _need(self.layers_per_block >= 1, where, f"layers_per_block must be >= 1, got {self.layers_per_block}")
        _need(0.0 <= self.dropout < 1.0, where, f"dropout must be in [0, 1), got {self.dropout}")
        _need(self.norm_num_groups is not None, where, "norm_num_groups=None is not supported; give a group count")
        if self.sample_size is not None:
            _check_sizes(where, "sample_size", self.sizes, depth)
        _check_groups(where, self)

    @property
    def time_embed_dim(self) -> int:
        return self.time_embedding_dim or 4 * self.block_out_channels[0]

    @property
    def sizes(self) -> tuple[int, int]:
        s = self.sample_size
        if s is None:
            raise ValueError("DiffusionUNetConfig: sample_size is None; set it (cost estimates need the image size)")
        return (s, s) if isinstance(s, int) else (int(s[0]), int(s[1]))

    def to_dict(self) -> dict:
        d = asdict(self)
        for name in ("down_block_types", "up_block_types", "block_out_channels"):
            d[name] = list(d[name])
        if isinstance(d["sample_size"], tuple):
            d["sample_size"] = list(d["sample_size"])
        return d

    @classmethod
    def from_preset(cls, name: str, **overrides) -> DiffusionUNetConfig:
        return preset_config(cls, DIFFUSION_PRESETS, "diffusion U-Net", name, overrides)


DIFFUSION_PRESETS: dict[str, dict] = {
    # Tests and the laptop run: 2 levels, attention at the 8x8 level.
    "tiny": dict(sample_size=16, block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=8,
                 attention_head_dim=8, down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                 up_block_types=("AttnUpBlock2D", "UpBlock2D")),
    # The shape of DDPM's CIFAR-10 model (google/ddpm-cifar10-32, 35.7M parameters).
    "ddpm-32": dict(sample_size=32, block_out_channels=(128, 256, 256, 256), layers_per_block=2,
                    down_block_types=("DownBlock2D", "AttnDownBlock2D", "DownBlock2D", "DownBlock2D"),
                    up_block_types=("UpBlock2D", "UpBlock2D", "AttnUpBlock2D", "UpBlock2D"),
                    attention_head_dim=None, norm_eps=1e-6, downsample_padding=0, flip_sin_to_cos=False,
                    freq_shift=1),
}

UNetConfig = SegUNetConfig | DiffusionUNetConfig


def config_from_dict(family: str, d: dict) -> UNetConfig:
    """The config of a zoo model folder of family ``unet-segmentation`` or ``unet-diffusion``."""
    if family == SEG_FAMILY:
        return SegUNetConfig.from_dict(d)
    if family == DIFFUSION_FAMILY:
        return DiffusionUNetConfig.from_dict(d)
    raise ValueError(f"not a U-Net family: {family!r}; expected {SEG_FAMILY!r} or {DIFFUSION_FAMILY!r}")


def family_of(config: UNetConfig) -> str:
    return DIFFUSION_FAMILY if isinstance(config, DiffusionUNetConfig) else SEG_FAMILY


def _check_sizes(where: str, name: str, sizes: tuple[int, int], depth: int) -> None:
    multiple = 2 ** (depth - 1)
    for s in sizes:
        _need(s >= multiple and s % multiple == 0, where,
              f"{name} {s} cannot be halved {depth - 1} time(s) (depth {depth}); use a multiple of {multiple}")


def _check_groups(where: str, config: UNetConfig) -> None:
    """Every GroupNorm's channels divisible by norm_num_groups; attention channels by attention_head_dim."""
    from zoo.models.unet.plan import units

    g = config.norm_num_groups
    for u in units(config, sizes=(1, 1)):
        for c in ([u.in_channels, u.out_channels] if u.kind == "res" else
                  [u.in_channels] if u.kind in ("attn", "head") else []):
            _need(c % g == 0, where, f"norm_num_groups {g} does not divide the {c} channels of {u.path}; "
                  f"use one of {_divisors(math.gcd(*_norm_channels(config)))}")
        if u.kind == "attn" and config.attention_head_dim is not None:
            _need(u.in_channels % config.attention_head_dim == 0, where,
                  f"attention_head_dim {config.attention_head_dim} does not divide the {u.in_channels} channels of "
                  f"{u.path}; use one of {_divisors(u.in_channels)}")


def _norm_channels(config: UNetConfig) -> list[int]:
    from zoo.models.unet.plan import units

    out = []
    for u in units(config, sizes=(1, 1)):
        out += [u.in_channels, u.out_channels] if u.kind == "res" else [u.in_channels] if u.kind in ("attn", "head") \
            else []
    return out


def _check_layout(config: UNetConfig, tp: int, pp: int) -> None:
    """One line per problem, before anything is built: which channel count or head count tp does not divide."""
    from zoo.models.unet.plan import units

    plan = units(config, sizes=(1, 1))
    for u in plan:
        if u.kind == "res" and u.out_channels % tp:
            raise ValueError(f"{u.path}: {u.out_channels} channels are not divisible by tp {tp} (its conv1, norm2 "
                             f"and conv2 are split over channels); use a tp in {_divisors(u.out_channels)}")
        if u.kind == "attn":
            heads = attention_heads(config, u.in_channels)
            if heads % tp:
                head_dim = getattr(config, "attention_head_dim", None)
                raise ValueError(f"{u.path}: {heads} attention head(s) ({u.in_channels} channels / attention_head_dim "
                                 f"{head_dim}) cannot be split over tp {tp}; use a tp in {_divisors(heads)} or a "
                                 f"smaller attention_head_dim")
    if len(plan) < pp:
        raise ValueError(f"the U-Net has {len(plan)} layers, fewer than pp {pp}; every pipeline stage needs one")


def attention_heads(config: UNetConfig, channels: int) -> int:
    head_dim = getattr(config, "attention_head_dim", None)
    return 1 if head_dim is None else channels // head_dim


FAMILIES = {SEG_FAMILY: SegUNetConfig, DIFFUSION_FAMILY: DiffusionUNetConfig}  # zoo.models.registry

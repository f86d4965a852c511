"""U-Nets from tensor-parallel layers: a segmentation U-Net and the diffusion U-Net of DDPM (diffusers' UNet2DModel).

- Segmentation (Ronneberger et al. 2015, arXiv 1505.04597, with GroupNorm ResNet blocks in place of conv-BN-ReLU
  pairs): an encoder of ``len(block_out_channels)`` levels, each ``layers_per_block`` ResNet blocks then a stride-2
  conv; a decoder mirroring it, each level upsampling (nearest + conv), concatenating the encoder's output of that
  level (the skip connection) and running its ResNet blocks; a 1x1 conv to per-pixel class logits.
- Diffusion (Ho et al. 2020, arXiv 2006.11239), block for block diffusers' ``UNet2DModel``: sinusoidal timestep
  embedding and its MLP, conv_in, down blocks (ResNet blocks, optional self-attention, stride-2 conv), a mid block
  (ResNet, attention, ResNet), up blocks (``layers_per_block + 1`` ResNet blocks each consuming one skip, optional
  attention, nearest-neighbour upsampling + conv), GroupNorm + SiLU + conv_out predicting the noise. Its config
  uses diffusers' field names and defaults; options zoo does not implement are refused with one line.

Parallel plan (Megatron-LM, arXiv 1909.08053, with channels in place of features): in each ResNet block conv1 is
column-parallel (output channels split), the time-embedding projection column-parallel over the same channels,
norm2 a GroupNorm on the channel shards (``ParallelGroupNorm``, exact for any group count), conv2 row-parallel
(one all-reduce forward, one backward in conv1: Megatron's ``g`` and ``f``). Self-attention splits heads
(``ParallelConvAttention``). Replicated on the TP group (computed redundantly; small next to the 3x3 convs of the
ResNet blocks): norm1, the 1x1 conv_shortcut, the timestep MLP, conv_in, the down/up-sampling convs, the output
head. Activations between layers are replicated ``[b, C, H, W]``.

The model is a list of layer specs (:func:`layer_specs`), one per :class:`Unit` of :func:`units`, so the plain
model (``SpecSequential``) and a ``PipelineModule`` hold the same keys (``"<layer>.<param>"``). Pipeline tuples:

- diffusion: the first layer takes ``(sample [b, C_in, H, W] float, timesteps [b] int64)``; every later layer takes
  and returns ``(h, temb, *skips)``: ``h [b, C, H', W']``, ``temb [b, T]`` and the skip stack, newest last;
  the last layer returns the predicted noise ``[b, C_out, H, W]``.
- segmentation: the first layer takes the image ``[b, C_in, H, W]``; later layers ``(h, *skips)``; the last
  returns logits ``[b, classes, H, W]``.

A layer with ``push_skip`` appends its output to the stack; one with ``pop_skip`` concatenates the newest skip to
its input channels first. Between pipeline stages the tuple travels packed as one float tensor plus an int64 shape
header (:class:`UNetPipelineModule`, built by :func:`build_unet_pipeline`; stages balanced by FLOPs with
:func:`pipeline_parts`): build U-Net pipelines with it, not with ``zoo.models.specs.build_pipeline``.

Also here: the two training objectives of the diffusion U-Net, each with its training batch and sampler and the
diffusers scheduler config that records it beside an exported model (:func:`schedule_from_config`): DDPM (linear
betas over 1000 steps, noise prediction, the ancestral sampler) and flow matching (straight paths from data to
noise, velocity prediction, Euler steps); the losses (pixel cross-entropy, the MSE of either target) and
segmentation metrics.

Notation: b batch, C channels (``_local``: this TP rank's share), H W spatial size, T time-embedding width,
N = H*W positions.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule
from torch import nn

from zoo.compat.deepspeed import PipelineModuleWithParts
from zoo.models.config import ModelConfig, preset_config
from zoo.models.gpt import ParallelOptions
from zoo.parallel.layers import (
    ColumnParallelConv2d,
    ColumnParallelLinear,
    ParallelConvAttention,
    ParallelGroupNorm,
    RowParallelConv2d,
    init_method_torch_default,
)
from zoo.parallel.random import tensor_parallel_rng
from zoo.parallel.topology import get_tensor_model_parallel_group, group_rank_and_size

SEG_FAMILY, DIFFUSION_FAMILY = "unet-segmentation", "unet-diffusion"  # the "family" of a zoo model folder
CHECKPOINTABLE_LAYERS = ("UNetResBlock", "UNetAttnBlock")


def _need(ok: bool, where: str, msg: str) -> None:
    if not ok:
        raise ValueError(f"{where}: {msg}")


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


# ---------------------------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------------------------


class _UNetConfig(ModelConfig):
    """What both U-Net configs share: the layout check and the parameter count of the network they describe."""

    def check_layout(self, tp: int, pp: int = 1) -> None:
        _check_layout(self, tp, pp)

    def num_parameters(self) -> int:
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
    def from_preset(cls, name: str, **overrides) -> "SegUNetConfig":
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
    def from_preset(cls, name: str, **overrides) -> "DiffusionUNetConfig":
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
    out = []
    for u in units(config, sizes=(1, 1)):
        out += [u.in_channels, u.out_channels] if u.kind == "res" else [u.in_channels] if u.kind in ("attn", "head") \
            else []
    return out


def _check_layout(config: UNetConfig, tp: int, pp: int) -> None:
    """One line per problem, before anything is built: which channel count or head count tp does not divide."""
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


# ---------------------------------------------------------------------------------------------------------------
# The plan: one Unit per layer, from which the specs, the cost estimates and the checkpoint tables all derive
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Unit:
    """One pipeline layer. ``height``/``width``: its input's spatial size at the configured image size.

    ``path`` names it: for the diffusion U-Net, the module path of the same computation in diffusers'
    ``UNet2DModel`` (``"down_blocks.1.attentions.0"``), which the checkpoint adapter uses; "stem" and "head" for the
    first and last layers (diffusers' top-level conv_in, time_embedding, conv_norm_out, conv_out).
    """

    kind: str  # "stem" | "res" | "attn" | "down" | "up" | "head"
    in_channels: int
    out_channels: int
    height: int
    width: int
    path: str = ""
    pop_skip: bool = False
    push_skip: bool = False
    scale: float = 1.0  # output_scale_factor of a ResNet block / rescale_output_factor of attention


def units(config: UNetConfig, sizes: tuple[int, int] | None = None) -> list[Unit]:
    """The layers of the model, in order. ``sizes`` overrides the configured image size."""
    h, w = sizes or config.sizes
    if isinstance(config, DiffusionUNetConfig):
        return _diffusion_units(config, h, w)
    return _seg_units(config, h, w)


def _diffusion_units(c: DiffusionUNetConfig, h: int, w: int) -> list[Unit]:
    ch, L, D = c.block_out_channels, c.layers_per_block, len(c.block_out_channels)
    out = [Unit("stem", c.in_channels, ch[0], h, w, "stem", push_skip=True)]  # conv_in's output: the first skip
    prev = ch[0]
    for i, kind in enumerate(c.down_block_types):
        attn = kind == "AttnDownBlock2D"
        for j in range(L):
            out.append(Unit("res", prev, ch[i], h, w, f"down_blocks.{i}.resnets.{j}", push_skip=not attn))
            prev = ch[i]
            if attn:
                out.append(Unit("attn", ch[i], ch[i], h, w, f"down_blocks.{i}.attentions.{j}", push_skip=True))
        if i < D - 1:
            out.append(Unit("down", ch[i], ch[i], h, w, f"down_blocks.{i}.downsamplers.0", push_skip=True))
            h, w = h // 2, w // 2
    if c.mid_block_type is not None:
        s = c.mid_block_scale_factor
        out.append(Unit("res", ch[-1], ch[-1], h, w, "mid_block.resnets.0", scale=s))
        if c.add_attention:
            out.append(Unit("attn", ch[-1], ch[-1], h, w, "mid_block.attentions.0", scale=s))
        out.append(Unit("res", ch[-1], ch[-1], h, w, "mid_block.resnets.1", scale=s))
    rev = ch[::-1]
    prev = rev[0]
    for i, kind in enumerate(c.up_block_types):
        attn = kind == "AttnUpBlock2D"
        skip_in = rev[min(i + 1, D - 1)]  # the last block of a level consumes the previous level's downsampler skip
        for j in range(L + 1):
            skip = skip_in if j == L else rev[i]
            out.append(Unit("res", (prev if j == 0 else rev[i]) + skip, rev[i], h, w, f"up_blocks.{i}.resnets.{j}",
                            pop_skip=True))
            if attn:
                out.append(Unit("attn", rev[i], rev[i], h, w, f"up_blocks.{i}.attentions.{j}"))
        if i < D - 1:
            out.append(Unit("up", rev[i], rev[i], h, w, f"up_blocks.{i}.upsamplers.0"))
            h, w = 2 * h, 2 * w
        prev = rev[i]
    out.append(Unit("head", ch[0], c.out_channels, h, w, "head"))
    return out


def _seg_units(c: SegUNetConfig, h: int, w: int) -> list[Unit]:
    ch, L, D = c.block_out_channels, c.layers_per_block, len(c.block_out_channels)
    out = [Unit("stem", c.in_channels, ch[0], h, w, "stem")]
    prev = ch[0]
    for i in range(D):  # encoder: the last block of every level but the deepest saves a skip
        for j in range(L):
            out.append(Unit("res", prev, ch[i], h, w, f"encoder.{i}.resnets.{j}", push_skip=j == L - 1 and i < D - 1))
            prev = ch[i]
        if i < D - 1:
            out.append(Unit("down", ch[i], ch[i], h, w, f"encoder.{i}.downsample"))
            h, w = h // 2, w // 2
    for i in reversed(range(D - 1)):  # decoder: upsample to level i, concatenate its skip, ResNet blocks
        out.append(Unit("up", ch[i + 1], ch[i], h, w, f"decoder.{i}.upsample"))
        h, w = 2 * h, 2 * w
        for j in range(L):
            out.append(Unit("res", ch[i] * (2 if j == 0 else 1), ch[i], h, w, f"decoder.{i}.resnets.{j}",
                            pop_skip=j == 0))
    out.append(Unit("head", ch[0], c.classes, h, w, "head"))
    return out


# ---------------------------------------------------------------------------------------------------------------
# Layers. Each takes and returns the pipeline tuple; helpers pack and unpack it.
# ---------------------------------------------------------------------------------------------------------------


def _unpack(inputs, has_temb: bool):
    """``(h, temb, *skips)`` or ``(h, *skips)`` -> (h, temb or None, skips). A 1-tuple may arrive as a bare tensor
    (PipelineModule unwraps single-element tuples for activation checkpointing)."""
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if has_temb:
        return inputs[0], inputs[1], tuple(inputs[2:])
    return inputs[0], None, tuple(inputs[1:])


def _pack(h, temb, skips: tuple, push: bool) -> tuple:
    h = h.contiguous()  # attention returns a transposed view; p2p sends need contiguous tensors
    skips = skips + (h,) if push else skips
    return (h, *skips) if temb is None else (h, temb, *skips)


def timestep_embedding(timesteps: torch.Tensor, dim: int, flip_sin_to_cos: bool, freq_shift: float,
                       max_period: float = 10000.0) -> torch.Tensor:
    """DDPM's sinusoidal embedding (the Transformer's positions, Vaswani et al. 2017): ``[b] -> [b, dim]`` fp32.

    Frequencies ``max_period^(-k / (dim/2 - freq_shift))`` for k < dim/2; ``[sin, cos]``, or ``[cos, sin]`` with
    ``flip_sin_to_cos``; a zero column appended when dim is odd (diffusers' ``get_timestep_embedding``).
    """
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=timesteps.device)
    freqs = torch.exp(exponent / (half - freq_shift))  # [dim/2]
    args = timesteps[:, None].float() * freqs[None, :]  # [b, dim/2]
    emb = torch.cat([torch.cos(args), torch.sin(args)] if flip_sin_to_cos else [torch.sin(args), torch.cos(args)],
                    dim=-1)
    return F.pad(emb, (0, 1)) if dim % 2 else emb


class UNetTimestepEmbedding(nn.Module):
    """The timestep MLP: linear_1, SiLU, linear_2 (``[b, C_0] -> [b, T]``), replicated on the TP group."""

    def __init__(self, in_features: int, time_embed_dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(in_features, time_embed_dim)
        self.linear_2 = nn.Linear(time_embed_dim, time_embed_dim)

    def forward(self, x):
        return self.linear_2(F.silu(self.linear_1(x)))


class UNetStem(nn.Module):
    """Input -> conv_in. Diffusion: ``(sample, timesteps) -> (h, temb, h)`` (conv_in's output is the first skip);
    segmentation: ``image -> (h,)``. Replicated on the TP group."""

    def __init__(self, in_channels: int, channels: int, *, time_embed_dim: int | None = None,
                 flip_sin_to_cos: bool = True, freq_shift: float = 0, center_input_sample: bool = False,
                 push_skip: bool = False):
        super().__init__()
        self.conv_in = nn.Conv2d(in_channels, channels, 3, padding=1)
        self.time_embedding = None if time_embed_dim is None else UNetTimestepEmbedding(channels, time_embed_dim)
        self.channels, self.flip_sin_to_cos, self.freq_shift = channels, flip_sin_to_cos, freq_shift
        self.center_input_sample, self.push_skip = center_input_sample, push_skip

    def forward(self, inputs):
        if self.time_embedding is None:
            sample = inputs[0] if isinstance(inputs, tuple) else inputs
            temb = None
        else:
            sample, timesteps = inputs
            if timesteps.dim() == 0:
                timesteps = timesteps.expand(sample.shape[0])
            t_emb = timestep_embedding(timesteps, self.channels, self.flip_sin_to_cos, self.freq_shift)  # [b, C_0]
            temb = self.time_embedding(t_emb.to(self.time_embedding.linear_1.weight.dtype))  # [b, T]
        sample = sample.to(self.conv_in.weight.dtype)
        if self.center_input_sample:
            sample = 2 * sample - 1.0
        h = self.conv_in(sample)  # [b, C_0, H, W]
        return _pack(h, temb, (), self.push_skip)


class UNetResBlock(nn.Module):
    """x -> [concat skip] -> norm1, SiLU, conv1 (+ time projection) -> norm2, SiLU, dropout, conv2 -> + shortcut(x)
    -> / scale (diffusers' ``ResnetBlock2D``, ``time_embedding_norm="default"``).

    TP: conv1 ``[b, C_in, H, W] -> [b, C/tp, H, W]`` (column), time_emb_proj ``[b, T] -> [b, C/tp]`` (column),
    norm2 on the shards, conv2 ``-> [b, C, H, W]`` (row, all-reduced). norm1 and the 1x1 conv_shortcut (present
    when C_in != C) act on the replicated input and are replicated.
    """

    def __init__(self, in_channels: int, out_channels: int, *, temb_channels: int | None, norm_num_groups: int,
                 eps: float, dropout: float = 0.0, output_scale_factor: float = 1.0, pop_skip: bool = False,
                 push_skip: bool = False, tp_group=None):
        super().__init__()
        self.norm1 = nn.GroupNorm(norm_num_groups, in_channels, eps=eps)
        self.conv1 = ColumnParallelConv2d(in_channels, out_channels, 3, padding=1, tp_group=tp_group)
        self.time_emb_proj = None if temb_channels is None else ColumnParallelLinear(
            temb_channels, out_channels, init_method=init_method_torch_default, tp_group=tp_group)
        self.norm2 = ParallelGroupNorm(norm_num_groups, out_channels, eps=eps, tp_group=tp_group)
        self.conv2 = RowParallelConv2d(out_channels, out_channels, 3, padding=1, input_is_parallel=True,
                                       tp_group=tp_group)
        self.conv_shortcut = nn.Conv2d(in_channels, out_channels, 1) if in_channels != out_channels else None
        self.dropout, self.output_scale_factor = dropout, output_scale_factor
        self.pop_skip, self.push_skip = pop_skip, push_skip

    def forward(self, inputs):
        x, temb, skips = _unpack(inputs, self.time_emb_proj is not None)
        if self.pop_skip:
            x = torch.cat([x, skips[-1]], dim=1)  # [b, C_prev + C_skip, H, W]
            skips = skips[:-1]
        y = self.conv1(F.silu(self.norm1(x)))  # [b, C/tp, H, W]
        if temb is not None:
            y = y + self.time_emb_proj(F.silu(temb))[:, :, None, None]
        y = F.silu(self.norm2(y))
        if self.training and self.dropout > 0:
            with tensor_parallel_rng():  # channel shards: each rank draws its own channels' mask
                y = F.dropout(y, self.dropout, True)
        y = self.conv2(y)  # [b, C, H, W], summed over TP
        if self.conv_shortcut is not None:
            x = self.conv_shortcut(x)
        h = (x + y) / self.output_scale_factor
        return _pack(h, temb, skips, self.push_skip)


class UNetAttnBlock(ParallelConvAttention):
    """Spatial self-attention with a residual connection (diffusers' ``Attention`` in AttnDown/Up blocks and the
    mid block), heads split over TP; ``[b, C, H, W]`` in and out, in the pipeline tuple."""

    def __init__(self, channels: int, attention_head_dim: int | None, *, norm_num_groups: int, eps: float,
                 rescale_output_factor: float = 1.0, has_temb: bool, push_skip: bool = False, tp_group=None):
        super().__init__(channels, attention_head_dim, norm_num_groups=norm_num_groups, eps=eps,
                         rescale_output_factor=rescale_output_factor, tp_group=tp_group)
        self.has_temb, self.push_skip = has_temb, push_skip

    def forward(self, inputs):
        h, temb, skips = _unpack(inputs, self.has_temb)
        return _pack(super().forward(h), temb, skips, self.push_skip)


class UNetDownsample(nn.Module):
    """A 3x3 stride-2 conv halving H and W (padding 1, or diffusers' ``downsample_padding=0``: pad right and bottom
    by one, then no padding). Replicated on the TP group."""

    def __init__(self, channels: int, out_channels: int, *, padding: int = 1, has_temb: bool, push_skip: bool = False):
        super().__init__()
        self.conv = nn.Conv2d(channels, out_channels, 3, stride=2, padding=padding)
        self.padding, self.has_temb, self.push_skip = padding, has_temb, push_skip

    def forward(self, inputs):
        h, temb, skips = _unpack(inputs, self.has_temb)
        if self.padding == 0:
            h = F.pad(h, (0, 1, 0, 1))
        return _pack(self.conv(h), temb, skips, self.push_skip)  # [b, C', H/2, W/2]


class UNetUpsample(nn.Module):
    """Nearest-neighbour x2, then a 3x3 conv. Replicated on the TP group."""

    def __init__(self, channels: int, out_channels: int, *, has_temb: bool):
        super().__init__()
        self.conv = nn.Conv2d(channels, out_channels, 3, padding=1)
        self.has_temb = has_temb

    def forward(self, inputs):
        h, temb, skips = _unpack(inputs, self.has_temb)
        h = F.interpolate(h, scale_factor=2.0, mode="nearest")  # [b, C, 2H, 2W]
        return _pack(self.conv(h), temb, skips, False)


class UNetHead(nn.Module):
    """GroupNorm, SiLU, conv_out: the predicted noise ``[b, C_out, H, W]`` (diffusion, 3x3) or class logits
    ``[b, classes, H, W]`` (segmentation, 1x1). A plain tensor out, for the loss. Replicated on the TP group."""

    def __init__(self, channels: int, out_channels: int, *, kernel_size: int, norm_num_groups: int, eps: float,
                 has_temb: bool):
        super().__init__()
        self.conv_norm_out = nn.GroupNorm(norm_num_groups, channels, eps=eps)
        self.conv_out = nn.Conv2d(channels, out_channels, kernel_size, padding=kernel_size // 2)
        self.has_temb = has_temb

    def forward(self, inputs):
        h, _, skips = _unpack(inputs, self.has_temb)
        assert not skips, f"{len(skips)} skip(s) left unconsumed at the head"
        return self.conv_out(F.silu(self.conv_norm_out(h)))


def _resolve(par: ParallelOptions | None) -> ParallelOptions:
    par = par or ParallelOptions()
    if par.sequence_parallel:
        raise ValueError("sequence_parallel is not implemented for U-Nets (activations are [b, C, H, W]); "
                         "set parallel.sequence_parallel=false")
    if par.tp_group is None:
        par = ParallelOptions(False, get_tensor_model_parallel_group())
    return par


def layer_specs(config: UNetConfig, par: ParallelOptions | None = None) -> list[LayerSpec]:
    """The model as DeepSpeed layer specs, one per :func:`units` entry; the TP group is resolved here, once."""
    par = _resolve(par)
    config.check_layout(group_rank_and_size(par.tp_group)[1])
    diffusion = isinstance(config, DiffusionUNetConfig)
    temb = config.time_embed_dim if diffusion else None
    g, eps, tp_group = config.norm_num_groups, config.norm_eps, par.tp_group
    specs = []
    for u in units(config, sizes=(1, 1) if diffusion and config.sample_size is None else None):
        if u.kind == "stem":
            extra = dict(time_embed_dim=temb, flip_sin_to_cos=config.flip_sin_to_cos, freq_shift=config.freq_shift,
                         center_input_sample=config.center_input_sample) if diffusion else {}
            specs.append(LayerSpec(UNetStem, u.in_channels, u.out_channels, push_skip=u.push_skip, **extra))
        elif u.kind == "res":
            specs.append(LayerSpec(UNetResBlock, u.in_channels, u.out_channels, temb_channels=temb, norm_num_groups=g,
                                   eps=eps, dropout=config.dropout, output_scale_factor=u.scale, pop_skip=u.pop_skip,
                                   push_skip=u.push_skip, tp_group=tp_group))
        elif u.kind == "attn":
            specs.append(LayerSpec(UNetAttnBlock, u.in_channels, config.attention_head_dim, norm_num_groups=g, eps=eps,
                                   rescale_output_factor=u.scale, has_temb=diffusion, push_skip=u.push_skip,
                                   tp_group=tp_group))
        elif u.kind == "down":
            specs.append(LayerSpec(UNetDownsample, u.in_channels, u.out_channels,
                                   padding=config.downsample_padding if diffusion else 1, has_temb=diffusion,
                                   push_skip=u.push_skip))
        elif u.kind == "up":
            specs.append(LayerSpec(UNetUpsample, u.in_channels, u.out_channels, has_temb=diffusion))
        else:
            specs.append(LayerSpec(UNetHead, u.in_channels, u.out_channels, kernel_size=3 if diffusion else 1,
                                   norm_num_groups=g, eps=eps, has_temb=diffusion))
    return specs


# ---------------------------------------------------------------------------------------------------------------
# Cost per layer and compute-balanced pipeline stages
# ---------------------------------------------------------------------------------------------------------------


def _unit_flops(u: Unit, config: UNetConfig) -> int:
    """Forward FLOPs (2 per multiply-add) of one layer for one sample: convolutions, linears and the attention
    matmuls. Norms and activations (memory-bound, a few FLOPs per element) are left out."""
    n = u.height * u.width
    cin, cout = u.in_channels, u.out_channels
    if u.kind == "stem":
        flops = 2 * cin * cout * 9 * n
        if isinstance(config, DiffusionUNetConfig):
            t = config.time_embed_dim
            flops += 2 * cout * t + 2 * t * t
        return flops
    if u.kind == "res":
        flops = 2 * cin * cout * 9 * n + 2 * cout * cout * 9 * n + (2 * cin * cout * n if cin != cout else 0)
        if isinstance(config, DiffusionUNetConfig):
            flops += 2 * config.time_embed_dim * cout
        return flops
    if u.kind == "attn":
        return 2 * n * cin * 3 * cin + 2 * 2 * n * n * cin + 2 * n * cin * cin  # qkv, scores, weighted sum, out
    if u.kind == "down":
        return 2 * cin * cout * 9 * (n // 4)
    if u.kind == "up":
        return 2 * cin * cout * 9 * (4 * n)
    k = 3 if isinstance(config, DiffusionUNetConfig) else 1
    return 2 * cin * cout * k * k * n


def layer_flops(config: UNetConfig, sizes: tuple[int, int] | None = None) -> list[int]:
    """Forward FLOPs per sample of each layer (aligned with :func:`layer_specs`) at the configured image size."""
    return [_unit_flops(u, config) for u in units(config, sizes)]


def flops_per_sample(config: UNetConfig, sizes: tuple[int, int] | None = None) -> int:
    """Training FLOPs per sample: forward + backward (2x forward), no recomputation; for TFLOP/s and MFU."""
    return 3 * sum(layer_flops(config, sizes))


def num_parameters(config: UNetConfig) -> int:
    """Parameters of the model (as diffusers counts them for the diffusion U-Net)."""
    total = 0
    temb = config.time_embed_dim if isinstance(config, DiffusionUNetConfig) else None
    for u in units(config, sizes=(1, 1)):
        cin, cout = u.in_channels, u.out_channels
        if u.kind == "stem":
            total += cin * cout * 9 + cout + ((cout * temb + temb) + (temb * temb + temb) if temb else 0)
        elif u.kind == "res":
            total += 2 * cin + cin * cout * 9 + cout + 2 * cout + cout * cout * 9 + cout
            total += (temb * cout + cout) if temb else 0
            total += (cin * cout + cout) if cin != cout else 0
        elif u.kind == "attn":
            total += 2 * cin + 4 * (cin * cin + cin)  # heads x head_dim = channels
        elif u.kind in ("down", "up"):
            total += cin * cout * 9 + cout
        else:
            k = 3 if temb else 1
            total += 2 * cin + cin * cout * k * k + cout
    return total


def partition_balanced(costs: list[float], num_stages: int) -> list[int]:
    """Stage boundaries ``parts`` (stage s holds layers ``[parts[s], parts[s+1])``) minimizing the largest stage cost,
    every stage non-empty. Exact (dynamic programming over contiguous splits), O(n^2 p) for n layers."""
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot split {n} layers into {num_stages} pipeline stages; use pp <= {n}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[s][i]: the least max-stage-cost of layers [0, i) in s stages; cut[s][i]: where the last of them starts
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for i in range(s, n + 1):
            for m in range(s - 1, i):
                value = max(best[s - 1][m], prefix[i] - prefix[m])
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, m
    parts, i = [n], n
    for s in range(num_stages, 0, -1):
        i = cut[s][i]
        parts.append(i)
    return parts[::-1]


def pipeline_parts(config: UNetConfig, num_stages: int, sizes: tuple[int, int] | None = None) -> list[int]:
    """Stage boundaries balancing forward FLOPs (:func:`layer_flops`) over ``num_stages``."""
    return partition_balanced(layer_flops(config, sizes), num_stages)


def flatten_activations(outputs) -> tuple[torch.Tensor, torch.Tensor]:
    """A stage's output tuple ``(h, [temb,] *skips)`` -> ``(flat [n], shapes [k, 5] int64)``: every tensor
    flattened into one, and per tensor its rank and sizes (padded with 0), so the next stage can cut it back."""
    outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
    flat = torch.cat([t.reshape(-1) for t in outputs])
    shapes = torch.zeros(len(outputs), 5, dtype=torch.int64)
    for i, t in enumerate(outputs):
        shapes[i, 0] = t.dim()
        shapes[i, 1:1 + t.dim()] = torch.tensor(t.shape)
    return flat, shapes.to(flat.device)


def unflatten_activations(flat: torch.Tensor, shapes: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The inverse of :func:`flatten_activations`: views of ``flat``, so the gradients land in ``flat.grad``."""
    dims = [tuple(row[1:1 + row[0]]) for row in shapes.tolist()]
    sizes = [math.prod(d) for d in dims]
    return tuple(t.view(d) for t, d in zip(torch.split(flat, sizes), dims))


class UNetPipelineModule(PipelineModuleWithParts):
    """DeepSpeed's ``PipelineModule`` with two changes for U-Nets; keys, seeds and layers are the same.

    - Stage boundaries: given ``parts`` (e.g. :func:`pipeline_parts`, balanced by FLOPs), or, with ``parts=None``,
      DeepSpeed's ``partition_method`` ("parameters", "uniform", "type:regex") (``zoo.compat.deepspeed``).
    - Stage outputs travel as ``(flat, shapes)`` (:func:`flatten_activations`): one float tensor and one int64
      header instead of ``(h, temb, *skips)``. DeepSpeed 0.19's engine runs one ``backward`` per float tensor a
      stage sends (with ``retain_graph``), which re-runs the backward of the layers behind every skip and breaks a
      (reentrant) checkpointed last layer with several outputs; with one float tensor it runs once. It also makes
      every received float tensor "used" (a stage that ignores ``temb`` still gives ``flat`` a gradient), and leaves
      a single activation for DeepSpeed's ``pipe_partitioned`` split over TP.
    """

    def forward(self, forward_input):
        if self.stage_start > 0:
            forward_input = unflatten_activations(*forward_input)
        out = super().forward(forward_input)
        if self.stage_stop < self.num_layers:
            out = flatten_activations(out)
        return out


def build_unet_pipeline(config: UNetConfig, specs: list, grid, *, loss_fn, base_seed: int = 1234,
                        partition_method: str = "compute", activation_checkpointing: bool = False) -> PipelineModule:
    """The specs as a :class:`UNetPipelineModule` on ``grid``, seeded and named as ``zoo.models.specs.build_pipeline``
    builds any model (so as ``SpecSequential``). ``partition_method="compute"`` balances :func:`layer_flops`
    (:func:`pipeline_parts`); DeepSpeed's own methods are passed through."""
    from zoo.models.specs import building_pipeline, seed_layer

    compute = partition_method == "compute"
    with building_pipeline():  # DeepSpeed's tied-weight broadcast and stage dump (see there)
        return UNetPipelineModule(
            layers=specs, topology=grid.topology, loss_fn=loss_fn, seed_layers=True, seed_fn=seed_layer,
            base_seed=base_seed, parts=pipeline_parts(config, grid.pp) if compute else None,
            partition_method="uniform" if compute else partition_method,
            activation_checkpoint_interval=1 if activation_checkpointing else 0,
            checkpointable_layers=list(CHECKPOINTABLE_LAYERS) if activation_checkpointing else None)


# ---------------------------------------------------------------------------------------------------------------
# Losses and metrics
# ---------------------------------------------------------------------------------------------------------------


class SegmentationLoss:
    """Mean per-pixel cross entropy: logits ``[b, classes, H, W]``, labels ``[b, H, W]`` int64 (``ignore_index``
    pixels excluded). Logits are replicated over TP, so this is plain ``F.cross_entropy``, in fp32."""

    def __init__(self, config: SegUNetConfig | None = None, ignore_index: int = -100, label_smoothing: float = 0.0):
        self.ignore_index, self.label_smoothing = ignore_index, label_smoothing

    def __call__(self, logits, labels):
        return F.cross_entropy(logits.float(), labels.long(), ignore_index=self.ignore_index,
                               label_smoothing=self.label_smoothing)


class DiffusionLoss:
    """Mean squared error between the prediction and the target ``[b, C, H, W]``, in fp32: DDPM's simplified
    objective (Ho et al. 2020, Eq. 14; the target is the noise) or flow matching's (the target is the velocity)."""

    def __init__(self, config: DiffusionUNetConfig | None = None):
        pass

    def __call__(self, predicted_noise, noise):
        return F.mse_loss(predicted_noise.float(), noise.float())


def loss_for(config: UNetConfig):
    return DiffusionLoss(config) if isinstance(config, DiffusionUNetConfig) else SegmentationLoss(config)


def confusion_counts(pred: torch.Tensor, labels: torch.Tensor, classes: int, ignore_index: int = -100):
    """Per class: (intersection, predicted, actual) pixel counts ``[classes]`` each, int64. ``pred`` is labels
    ``[b, H, W]`` or logits ``[b, classes, H, W]``. Sums over data-parallel ranks combine exactly."""
    if pred.dim() == labels.dim() + 1:
        pred = pred.argmax(dim=1)
    keep = labels != ignore_index
    pred, labels = pred[keep], labels[keep]
    inter = torch.bincount(labels[pred == labels], minlength=classes)[:classes]
    return inter, torch.bincount(pred, minlength=classes)[:classes], torch.bincount(labels, minlength=classes)[:classes]


def dice_from_counts(inter, predicted, actual) -> torch.Tensor:
    """Dice ``2|A∩B| / (|A| + |B|)`` per class; NaN for a class absent from both prediction and labels."""
    denom = (predicted + actual).double()
    return torch.where(denom > 0, 2 * inter.double() / denom.clamp(min=1), torch.nan)


def iou_from_counts(inter, predicted, actual) -> torch.Tensor:
    """IoU ``|A∩B| / |A∪B|`` per class; NaN for a class absent from both prediction and labels."""
    union = (predicted + actual - inter).double()
    return torch.where(union > 0, inter.double() / union.clamp(min=1), torch.nan)


def dice_score(pred, labels, classes: int, ignore_index: int = -100) -> torch.Tensor:
    return dice_from_counts(*confusion_counts(pred, labels, classes, ignore_index))


def iou_score(pred, labels, classes: int, ignore_index: int = -100) -> torch.Tensor:
    return iou_from_counts(*confusion_counts(pred, labels, classes, ignore_index))


# ---------------------------------------------------------------------------------------------------------------
# DDPM: noise schedule, training batches, ancestral sampling (Ho et al. 2020, Algorithms 1 and 2)
# ---------------------------------------------------------------------------------------------------------------


class DDPMSchedule:
    """Linear betas from ``beta_start`` to ``beta_end`` over ``num_train_timesteps`` steps (diffusers' DDPMScheduler
    defaults); ``alphas_cumprod[t]`` = prod_{s<=t} (1 - beta_s), fp32."""

    def __init__(self, num_train_timesteps: int = 1000, beta_start: float = 1e-4, beta_end: float = 0.02,
                 clip_sample: bool = True):
        self.num_train_timesteps, self.clip_sample = num_train_timesteps, clip_sample
        self.beta_start, self.beta_end = beta_start, beta_end
        self.betas = torch.linspace(beta_start, beta_end, num_train_timesteps, dtype=torch.float32)
        self.alphas_cumprod = torch.cumprod(1.0 - self.betas, dim=0)

    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """q(x_t | x_0): sqrt(abar_t) x_0 + sqrt(1 - abar_t) noise, per sample (``t`` is ``[b]``)."""
        abar = self.alphas_cumprod.to(x0.device)[t].to(x0.dtype).view(-1, *([1] * (x0.dim() - 1)))
        return abar.sqrt() * x0 + (1 - abar).sqrt() * noise

    def training_batch(self, x0: torch.Tensor, generator: torch.Generator | None = None, *,
                       seeds: list[int] | None = None):
        """``((x_t, t), noise)`` for clean images ``x0 [b, C, H, W]`` in [-1, 1]: t uniform in [0, T), noise N(0, I).
        The pipeline's input and label.

        Drawn from ``generator`` for the whole batch, or with ``seeds`` (one per sample, e.g. its global index in
        the run) each sample from its own generator, so a sample's noise is the same however the global batch is
        cut into micro-batches and data-parallel ranks.
        """
        gens = _per_sample_generators(x0, generator, seeds)
        if gens is None:
            t = torch.randint(0, self.num_train_timesteps, (x0.shape[0],), generator=generator)
            noise = torch.randn(x0.shape, generator=generator, dtype=x0.dtype)
        else:
            t = torch.cat([torch.randint(0, self.num_train_timesteps, (1,), generator=g) for g in gens])
            noise = torch.stack([torch.randn(x0.shape[1:], generator=g, dtype=x0.dtype) for g in gens])
        noise = noise.to(x0.device)
        return (self.add_noise(x0, noise, t.to(x0.device)), t.to(x0.device)), noise

    def timesteps(self, num_inference_steps: int | None = None) -> list[int]:
        """Sampling timesteps, descending; every ``T // n``-th from 0 ("leading" spacing, as diffusers)."""
        n = num_inference_steps or self.num_train_timesteps
        if not 1 <= n <= self.num_train_timesteps:
            raise ValueError(f"num_inference_steps must be in [1, {self.num_train_timesteps}], got {n}")
        ratio = self.num_train_timesteps // n
        return [k * ratio for k in reversed(range(n))]

    def to_diffusers(self) -> dict:
        """The diffusers ``DDPMScheduler`` config of this schedule (what ``scheduler_config.json`` holds)."""
        return {"_class_name": "DDPMScheduler", "num_train_timesteps": self.num_train_timesteps,
                "beta_start": self.beta_start, "beta_end": self.beta_end, "beta_schedule": "linear",
                "variance_type": "fixed_small", "clip_sample": self.clip_sample, "prediction_type": "epsilon"}

    def sample(self, model_fn, shape, *, seed: int, num_inference_steps: int | None = None, device="cpu",
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return ddpm_sample(model_fn, shape, seed=seed, schedule=self, num_inference_steps=num_inference_steps,
                           device=device, dtype=dtype)

    def step(self, eps: torch.Tensor, t: int, prev_t: int, x_t: torch.Tensor, noise: torch.Tensor | None):
        """x_{t-1} (or x at ``prev_t``) from x_t and the predicted noise: the posterior mean given the predicted
        (clipped) x_0, plus sqrt(beta~_t) ``noise`` (DDPM's "fixed small" variance) when t > 0."""
        abar_t = self.alphas_cumprod[t]
        abar_prev = self.alphas_cumprod[prev_t] if prev_t >= 0 else torch.tensor(1.0)
        alpha_t = abar_t / abar_prev  # 1 - beta_t (over the stride from prev_t to t)
        beta_t = 1 - alpha_t
        x0 = (x_t - (1 - abar_t) ** 0.5 * eps) / abar_t ** 0.5  # Eq. 15
        if self.clip_sample:
            x0 = x0.clamp(-1.0, 1.0)
        mean = (abar_prev ** 0.5 * beta_t / (1 - abar_t)) * x0 + (alpha_t ** 0.5 * (1 - abar_prev) / (1 - abar_t)) * x_t
        if t == 0 or noise is None:
            return mean
        variance = ((1 - abar_prev) / (1 - abar_t) * beta_t).clamp(min=1e-20)
        return mean + variance ** 0.5 * noise


@torch.no_grad()
def ddpm_sample(model_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], shape: tuple[int, ...], *,
                seed: int, schedule: DDPMSchedule | None = None, num_inference_steps: int | None = None,
                device="cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Ancestral sampling (DDPM Algorithm 2): x_T ~ N(0, I), then x_{t-1} from ``model_fn(x_t, t [b]) -> eps``.

    Deterministic given ``seed``: x_T and every step's noise come from one CPU generator, in diffusers'
    DDPMPipeline order, so the same seed gives the same images (and the same as diffusers with
    ``torch.Generator().manual_seed(seed)``). Returns x_0 in [-1, 1] ``shape``; ``(x + 1) / 2`` maps it to [0, 1].
    Under TP every rank runs the same loop with the same seed; with pipelines ``model_fn`` wraps
    ``zoo.parallel.pipe_forward.pipeline_forward``.
    """
    schedule = schedule or DDPMSchedule()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=dtype).to(device)
    steps = schedule.timesteps(num_inference_steps)
    ratio = schedule.num_train_timesteps // len(steps)
    for t in steps:
        eps = model_fn(x, torch.full((shape[0],), t, dtype=torch.long, device=device)).to(dtype)
        noise = torch.randn(shape, generator=g, dtype=dtype).to(device) if t > 0 else None
        x = schedule.step(eps, t, t - ratio, x, noise)
    return x


def _per_sample_generators(x0: torch.Tensor, generator, seeds) -> list[torch.Generator] | None:
    """None to draw the batch from ``generator``, else one generator per sample seeded from ``seeds``."""
    if (generator is None) == (seeds is None):
        raise ValueError("training_batch: pass either a generator or one seed per sample")
    if seeds is None:
        return None
    if len(seeds) != x0.shape[0]:
        raise ValueError(f"training_batch: {len(seeds)} seeds for {x0.shape[0]} samples")
    return [torch.Generator().manual_seed(int(s)) for s in seeds]


# ---------------------------------------------------------------------------------------------------------------
# Flow matching: straight paths from data to noise, velocity prediction, Euler sampling
# ---------------------------------------------------------------------------------------------------------------


class FlowMatchSchedule:
    """Flow matching on straight paths (Lipman et al. 2023, arXiv 2210.02747; rectified flow, Liu et al. 2023), as
    Stable Diffusion 3 trains it (Esser et al. 2024, arXiv 2403.03206): ``x_s = (1 - s) x_0 + s noise`` for a noise
    level ``s`` in (0, 1), drawn logit-normal (``sigmoid`` of N(``logit_mean``, ``logit_std``), which weights the
    middle levels, where the path is hardest to tell); the model is given the timestep ``s * T`` (a float, through
    the same sinusoidal embedding as DDPM's integer steps) and predicts the velocity ``noise - x_0``.

    Sampling integrates ``dx/ds = v(x, s)`` from pure noise at ``s = 1`` to ``s = 0`` with Euler steps over
    diffusers' ``FlowMatchEulerDiscreteScheduler`` levels (``shift`` 1): ``n`` levels evenly from 1 to ``1 / T``,
    then 0. A small model trained for a few CPU minutes draws cleaner images this way than with DDPM's 1000-step
    chain: every step follows the predicted direction, with no noise injected and no clipping.
    """

    def __init__(self, num_train_timesteps: int = 1000, logit_mean: float = 0.0, logit_std: float = 1.0):
        self.num_train_timesteps, self.logit_mean, self.logit_std = num_train_timesteps, logit_mean, logit_std

    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        """``(1 - s) x_0 + s noise`` per sample (``sigma`` is ``[b]``)."""
        s = sigma.to(x0.dtype).view(-1, *([1] * (x0.dim() - 1)))
        return (1 - s) * x0 + s * noise

    def training_batch(self, x0: torch.Tensor, generator: torch.Generator | None = None, *,
                       seeds: list[int] | None = None):
        """``((x_s, s * T), noise - x_0)`` for clean images ``x0 [b, C, H, W]``; the timesteps are float32 ``[b]``.
        Drawn as :meth:`DDPMSchedule.training_batch` draws (one ``generator``, or a generator per sample from
        ``seeds``), so a sample's pair does not depend on how the batch is cut."""
        gens = _per_sample_generators(x0, generator, seeds)
        if gens is None:
            u = torch.randn(x0.shape[0], generator=generator)
            noise = torch.randn(x0.shape, generator=generator, dtype=x0.dtype)
        else:
            u = torch.cat([torch.randn(1, generator=g) for g in gens])
            noise = torch.stack([torch.randn(x0.shape[1:], generator=g, dtype=x0.dtype) for g in gens])
        sigma = torch.sigmoid(self.logit_mean + self.logit_std * u).to(x0.device)
        noise = noise.to(x0.device)
        return (self.add_noise(x0, noise, sigma), sigma * self.num_train_timesteps), noise - x0

    def sigmas(self, num_inference_steps: int) -> torch.Tensor:
        """The ``n + 1`` noise levels of an ``n``-step sampling run, descending, fp32: ``n`` evenly from 1 to
        ``1 / T``, then 0 (diffusers' FlowMatchEulerDiscreteScheduler.set_timesteps, shift 1)."""
        n, big_t = num_inference_steps, self.num_train_timesteps
        if not 1 <= n <= big_t:
            raise ValueError(f"num_inference_steps must be in [1, {big_t}], got {n}")
        levels = torch.linspace(1.0, 1.0 / big_t, n, dtype=torch.float64).float()
        return torch.cat([levels, torch.zeros(1)])

    @staticmethod
    def step(velocity: torch.Tensor, sigma: float, sigma_next: float, x: torch.Tensor) -> torch.Tensor:
        """One Euler step of ``dx/ds = v`` from level ``sigma`` to ``sigma_next``."""
        return x + (sigma_next - sigma) * velocity

    def to_diffusers(self) -> dict:
        return {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": self.num_train_timesteps,
                "shift": 1.0, "use_dynamic_shifting": False}

    def sample(self, model_fn, shape, *, seed: int, num_inference_steps: int | None = None, device="cpu",
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return flow_sample(model_fn, shape, seed=seed, schedule=self, num_inference_steps=num_inference_steps,
                           device=device, dtype=dtype)


# Sampling steps when none are asked for: DDPM's of 1000 (in 50 the tiny run's model skews every image green/yellow;
# in 250, ~12 s for 16 images on 2 cores, the backgrounds take the data's hues) and flow matching's Euler steps (50,
# as diffusers' default).
DDPM_SAMPLE_STEPS, FLOW_SAMPLE_STEPS = 250, 50


def default_sample_steps(objective: str | None) -> int:
    """Sampling steps when none are asked for: 50 Euler steps for flow matching, 250 DDPM steps otherwise."""
    return FLOW_SAMPLE_STEPS if objective == "flow" else DDPM_SAMPLE_STEPS


@torch.no_grad()
def flow_sample(model_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], shape: tuple[int, ...], *,
                seed: int, schedule: FlowMatchSchedule | None = None, num_inference_steps: int | None = None,
                device="cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Euler sampling of a flow-matching model: x ~ N(0, I) at level 1 (drawn from a CPU generator seeded with
    ``seed``), then ``x += (s_next - s) * model_fn(x, s * T [b] float32)`` down the levels of
    :meth:`FlowMatchSchedule.sigmas`. Deterministic in ``seed`` (no noise after the first draw); returns x_0
    ``shape``, clamped to [-1, 1]. Under TP or pipelines as :func:`ddpm_sample`."""
    schedule = schedule or FlowMatchSchedule()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=dtype).to(device)
    sigmas = schedule.sigmas(num_inference_steps or FLOW_SAMPLE_STEPS).tolist()
    for sigma, sigma_next in zip(sigmas[:-1], sigmas[1:]):
        t = torch.full((shape[0],), sigma * schedule.num_train_timesteps, dtype=torch.float32, device=device)
        x = schedule.step(model_fn(x, t).to(dtype), sigma, sigma_next, x)
    return x.clamp(-1.0, 1.0)


# ---------------------------------------------------------------------------------------------------------------
# The objective of a diffusion model: training config <-> schedule <-> diffusers scheduler config
# ---------------------------------------------------------------------------------------------------------------

OBJECTIVES = ("ddpm", "flow")
SCHEDULER_CONFIG = "scheduler_config.json"  # diffusers' file name; beside a model it says how to sample it


def schedule_for(objective: str | None):
    """The schedule of ``training.objective`` (None: DDPM)."""
    if objective in (None, "ddpm"):
        return DDPMSchedule()
    if objective == "flow":
        return FlowMatchSchedule()
    raise ValueError(f"unknown diffusion objective {objective!r}; choose one of {', '.join(OBJECTIVES)}")


def schedule_from_config(d: dict | None):
    """The schedule a diffusers scheduler config describes (None: DDPM with diffusers' defaults, what a model
    folder without a scheduler config was trained with). Raises ValueError naming what zoo cannot sample."""
    if d is None:
        return DDPMSchedule()
    name = d.get("_class_name")
    if name == "DDPMScheduler":
        unsupported = {k: d[k] for k, want in (("beta_schedule", "linear"), ("prediction_type", "epsilon"),
                                                ("variance_type", "fixed_small"), ("thresholding", False))
                       if k in d and d[k] != want}
        if d.get("trained_betas") is not None:
            unsupported["trained_betas"] = "..."
        if unsupported:
            raise ValueError(f"DDPMScheduler options zoo's sampler does not implement: {unsupported}")
        return DDPMSchedule(int(d.get("num_train_timesteps", 1000)), float(d.get("beta_start", 1e-4)),
                            float(d.get("beta_end", 0.02)), bool(d.get("clip_sample", True)))
    if name == "FlowMatchEulerDiscreteScheduler":
        unsupported = {k: d[k] for k, want in (("shift", 1.0), ("use_dynamic_shifting", False),
                                                ("invert_sigmas", False), ("use_karras_sigmas", False),
                                                ("use_exponential_sigmas", False), ("use_beta_sigmas", False),
                                                ("stochastic_sampling", False), ("shift_terminal", None))
                       if k in d and d[k] != want}
        if unsupported:
            raise ValueError(f"FlowMatchEulerDiscreteScheduler options zoo's sampler does not implement: "
                             f"{unsupported}")
        return FlowMatchSchedule(int(d.get("num_train_timesteps", 1000)))
    raise ValueError(f"scheduler {name!r}: zoo samples DDPMScheduler and FlowMatchEulerDiscreteScheduler models")


def objective_of(scheduler_config: dict | None) -> str:
    """``"flow"`` or ``"ddpm"``: the objective a model with this diffusers scheduler config (None: none) was trained
    with. Raises ValueError as :func:`schedule_from_config` does."""
    return "flow" if isinstance(schedule_from_config(scheduler_config), FlowMatchSchedule) else "ddpm"


FAMILIES = {SEG_FAMILY: SegUNetConfig, DIFFUSION_FAMILY: DiffusionUNetConfig}  # zoo.models.registry

"""The U-Net's layers from tensor-parallel layers, and the model as DeepSpeed layer specs (:func:`layer_specs`), one
per unit of the plan. Each layer takes and returns the pipeline tuple; helpers pack and unpack it."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec
from torch import nn

from zoo.models.gpt import ParallelOptions
from zoo.models.unet.config import DiffusionUNetConfig, UNetConfig
from zoo.models.unet.plan import units
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

CHECKPOINTABLE_LAYERS = ("UNetResBlock", "UNetAttnBlock")


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

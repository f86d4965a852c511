"""The plan of a U-Net: one :class:`Unit` per layer, from which the layer specs (:mod:`zoo.models.unet.network`),
the cost estimates (FLOPs per layer, the parameter count, below) and the checkpoint tables all derive."""

from __future__ import annotations

from dataclasses import dataclass

from zoo.models.unet.config import DiffusionUNetConfig, SegUNetConfig, UNetConfig


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
# Cost per layer
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

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

Also in this package: the two training objectives of the diffusion U-Net, each with its training batch and sampler
and the diffusers scheduler config that records it beside an exported model (:func:`schedule_from_config`): DDPM
(linear betas over 1000 steps, noise prediction, the ancestral sampler) and flow matching (straight paths from data
to noise, velocity prediction, Euler steps); the losses (pixel cross-entropy, the MSE of either target) and
segmentation metrics.

Notation: b batch, C channels (``_local``: this TP rank's share), H W spatial size, T time-embedding width,
N = H*W positions.

One module per job; every public name is re-exported here, so ``from zoo.models.unet import X`` reaches it:

- ``config``: the two configs, their presets, the family names and the layout checks;
- ``plan``: the :class:`Unit` list of a config and the cost estimates (FLOPs per layer, parameters);
- ``network``: the layers and :func:`layer_specs`;
- ``pipeline``: compute-balanced stages and :class:`UNetPipelineModule` / :func:`build_unet_pipeline`;
- ``losses`` and ``metrics``: the training losses; Dice and IoU;
- ``ddpm`` and ``flow``: the two diffusion objectives (schedule, training batch, sampler);
- ``schedules``: an objective's schedule and its diffusers scheduler config, both ways.
"""

from zoo.models.unet.config import (
    DIFFUSION_FAMILY,
    DIFFUSION_PRESETS,
    DOWN_BLOCK_TYPES,
    FAMILIES,
    SEG_FAMILY,
    SEG_PRESETS,
    UP_BLOCK_TYPES,
    DiffusionUNetConfig,
    SegUNetConfig,
    UNetConfig,
    attention_heads,
    config_from_dict,
    family_of,
)
from zoo.models.unet.ddpm import DDPM_SAMPLE_STEPS, DDPMSchedule, ddpm_sample
from zoo.models.unet.flow import FLOW_SAMPLE_STEPS, FlowMatchSchedule, flow_sample
from zoo.models.unet.losses import DiffusionLoss, SegmentationLoss, loss_for
from zoo.models.unet.metrics import confusion_counts, dice_from_counts, dice_score, iou_from_counts, iou_score
from zoo.models.unet.network import (
    CHECKPOINTABLE_LAYERS,
    UNetAttnBlock,
    UNetDownsample,
    UNetHead,
    UNetResBlock,
    UNetStem,
    UNetTimestepEmbedding,
    UNetUpsample,
    layer_specs,
    timestep_embedding,
)
from zoo.models.unet.pipeline import (
    UNetPipelineModule,
    build_unet_pipeline,
    flatten_activations,
    partition_balanced,
    pipeline_parts,
    unflatten_activations,
)
from zoo.models.unet.plan import Unit, flops_per_sample, layer_flops, num_parameters, units
from zoo.models.unet.schedules import (
    OBJECTIVES,
    SCHEDULER_CONFIG,
    default_sample_steps,
    objective_of,
    schedule_for,
    schedule_from_config,
)

__all__ = [
    # config
    "SEG_FAMILY", "DIFFUSION_FAMILY", "FAMILIES", "SegUNetConfig", "SEG_PRESETS", "DiffusionUNetConfig",
    "DIFFUSION_PRESETS", "DOWN_BLOCK_TYPES", "UP_BLOCK_TYPES", "UNetConfig", "config_from_dict", "family_of",
    "attention_heads",
    # plan
    "Unit", "units", "layer_flops", "flops_per_sample", "num_parameters",
    # network
    "CHECKPOINTABLE_LAYERS", "timestep_embedding", "UNetTimestepEmbedding", "UNetStem", "UNetResBlock",
    "UNetAttnBlock", "UNetDownsample", "UNetUpsample", "UNetHead", "layer_specs",
    # pipeline
    "partition_balanced", "pipeline_parts", "flatten_activations", "unflatten_activations", "UNetPipelineModule",
    "build_unet_pipeline",
    # losses and metrics
    "SegmentationLoss", "DiffusionLoss", "loss_for", "confusion_counts", "dice_from_counts", "iou_from_counts",
    "dice_score", "iou_score",
    # diffusion objectives
    "DDPMSchedule", "ddpm_sample", "DDPM_SAMPLE_STEPS", "FlowMatchSchedule", "flow_sample", "FLOW_SAMPLE_STEPS",
    "OBJECTIVES", "SCHEDULER_CONFIG", "schedule_for", "schedule_from_config", "objective_of", "default_sample_steps",
]

"""The U-Nets' training losses: per-pixel cross entropy (segmentation) and the mean squared error of the diffusion
objectives' targets."""

from __future__ import annotations

import torch.nn.functional as F

from zoo.models.unet.config import DiffusionUNetConfig, SegUNetConfig, UNetConfig


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

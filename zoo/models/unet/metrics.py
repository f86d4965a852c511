"""Segmentation metrics: per-class pixel counts, and the Dice and IoU scores from them (counts sum exactly over
data-parallel ranks, so the scores are computed once from the sums)."""

from __future__ import annotations

import torch


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

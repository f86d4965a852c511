"""A model folder in one plain process: :func:`load_model` (``from zoo import load_model``) gives the plain torch
module of any zoo folder, ``Pretrained<Family>`` in ``huggingface_hub``'s ``from_pretrained`` style, and the
family's use of it: text from a GPT (``gpt.py``, also ``launch/generate.py``), a BERT's outputs (``bert.py``),
segmentation or images from a diffusion U-Net (``unet.py``).

These read zoo folders (``zoo.convert.io``) and tokenizers or image grids (``zoo.data``), so they sit above both;
the decoding itself is model code (``zoo.models.generate``, ``zoo.models.unet.ddpm_sample``). ``launch/generate.py``
picks the module from the ``--ckpt`` folder's family (``zoo.dispatch``).
"""

from __future__ import annotations

import os

import torch


def load_model(folder: str | os.PathLike, *, device=None, dtype: torch.dtype = torch.float32):
    """The model in a zoo model folder (or a run folder holding one as ``model/``) as one plain torch module on
    ``device`` (default CPU), in eval mode: tp=1, no process group, no DeepSpeed engine.

    ``gpt``: :class:`~zoo.generate.gpt.PretrainedGPT` (``generate``, ``loss``, ``save_pretrained``); ``bert`` and
    ``bert-classifier``: :class:`~zoo.generate.bert.PretrainedBert`; ``unet-segmentation`` and ``unet-diffusion``:
    :class:`~zoo.generate.unet.PretrainedUNet` (``segment`` / ``sample``). Anything else is refused with one line
    (``zoo.convert.io.CheckpointError``); a HuggingFace folder is imported first with ``launch/convert.py hf-to-zoo``.
    """
    from zoo.convert import io

    folder = io.resolve_model_folder(folder)
    family, _ = io.read_config(folder)
    if family == "gpt":
        from zoo.generate.gpt import PretrainedGPT as cls
    elif family in ("bert", "bert-classifier"):
        from zoo.generate.bert import PretrainedBert as cls
    elif family in ("unet-segmentation", "unet-diffusion"):
        from zoo.generate.unet import PretrainedUNet as cls
    else:
        raise io.CheckpointError(f"{folder} holds a model of family {family!r}, which this zoo does not know; "
                                 f"families: gpt, bert, bert-classifier, unet-segmentation, unet-diffusion")
    return cls.from_pretrained(folder, device=device, dtype=dtype)

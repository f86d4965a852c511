"""A model folder in one plain process: :func:`load_model` (``from zoo import load_model``) gives the plain torch
module of any zoo folder, ``Pretrained<Family>`` in ``huggingface_hub``'s ``from_pretrained`` style, and the
family's use of it: text from a GPT (``gpt.py``, also ``launch/generate.py``), a BERT's outputs (``bert.py``),
segmentation or images from a diffusion U-Net (``unet.py``).

These read zoo folders (``zoo.convert.io``) and tokenizers or image grids (``zoo.data``), so they sit above both;
the decoding itself is model code (``zoo.models.generate``, ``zoo.models.unet.ddpm_sample``). ``launch/generate.py``
picks the module from the ``--ckpt`` folder's family (``zoo.dispatch``).

Two tables keyed by family name (``zoo.models.registry.Registry``), filled by the modules here: ``PRETRAINED``
(family -> the ``Pretrained*`` class :func:`load_model` returns) and ``COMMANDS`` (family -> the ``main`` of
``launch/generate.py`` for its folders, or None: the family has no command of its own).
"""

from __future__ import annotations

import os

import torch

from zoo.models.registry import Registry

MODULES = ("zoo.generate.gpt", "zoo.generate.bert", "zoo.generate.unet")  # one line per module declaring families
PRETRAINED = Registry("model family", MODULES, "PRETRAINED")
COMMANDS = Registry("generate command of family", MODULES, "COMMANDS")


def load_model(folder: str | os.PathLike, *, device=None, dtype: torch.dtype = torch.float32):
    """The model in a zoo model folder (or a run folder holding one as ``model/``) as one plain torch module on
    ``device`` (default CPU), in eval mode: tp=1, no process group, no DeepSpeed engine.

    The class is the family's in :data:`PRETRAINED`: ``gpt``, :class:`~zoo.generate.gpt.PretrainedGPT`
    (``generate``, ``loss``, ``save_pretrained``); ``bert`` and ``bert-classifier``,
    :class:`~zoo.generate.bert.PretrainedBert`; the U-Nets, :class:`~zoo.generate.unet.PretrainedUNet` (``segment`` /
    ``sample``). Anything else is refused with one line (``zoo.convert.io.CheckpointError``); a HuggingFace folder is
    imported first with ``launch/convert.py hf-to-zoo``.
    """
    from zoo.convert import io

    folder = io.resolve_model_folder(folder)
    family, _ = io.read_config(folder)
    cls = PRETRAINED.get(family)
    if cls is None:
        raise io.CheckpointError(f"{folder} holds a model of family {family!r}, which this zoo does not know; "
                                 f"families: {', '.join(PRETRAINED.names())}")
    return cls.from_pretrained(folder, device=device, dtype=dtype)


def command_of(family: str | None):
    """The ``main`` of ``launch/generate.py`` for a folder of ``family`` (None: not told): the family's own command,
    else the GPT's text generation, which refuses any other folder in one line."""
    from zoo.models.gpt import FAMILY as TEXT_FAMILY

    return COMMANDS.get(family) or COMMANDS[TEXT_FAMILY]

"""Generating from a model folder: text from a GPT (``gpt.py``), images from a diffusion U-Net (``unet.py``, which
also loads any zoo U-Net folder as one plain module, ``PretrainedUNet``).

These read zoo folders (``zoo.convert.io``) and tokenizers or image grids (``zoo.data``), so they sit above both;
the decoding itself is model code (``zoo.models.generate``, ``zoo.models.unet.ddpm_sample``). ``launch/generate.py``
picks the module from the ``--ckpt`` folder's family (``zoo.dispatch``).
"""

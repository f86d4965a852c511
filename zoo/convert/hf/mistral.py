"""MistralForCausalLM: Llama's keys, config and refusals (``llama.py``) under Mistral's class name.

Mistral's one difference, its sliding window, zoo does not implement: a window shorter than the context is refused
(llama's ``refuse_window``); without one the model is Llama's. zoo exports such a model as LlamaForCausalLM (the
same computation), so this class is read, never written.
"""

from __future__ import annotations

from functools import partial

from zoo.convert.hf import llama
from zoo.convert.registry import Architecture
from zoo.models.gpt import FAMILY

NAME = "MistralForCausalLM"


def _config_class():
    from transformers import MistralConfig  # imported on use: the registry imports every file

    return MistralConfig


ARCHITECTURES = {NAME: Architecture(NAME, FAMILY, _config_class, partial(llama.to_zoo, arch=NAME), llama.groups,
                                    model_type="mistral")}

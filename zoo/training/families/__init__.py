"""What the training run needs to know about a model family, behind one small interface.

``launch/train.py`` is the same loop for every family (GPT, BERT, U-Nets): it asks the family for the model's layer
specs, its loss, its data, its FLOP count and how DeepSpeed's universal checkpoint splits its parameters. Each
family lives in its own module here and is imported only when a run names it (``model.family`` in the config).

A batch is whatever the family's dataset returns per sample, stacked (``zoo.data.batches``): a tensor of
``seq_length + 1`` tokens (GPT: inputs and labels are its shifts), or a pair ``(inputs, labels)`` whose parts are
tensors or tuples of tensors (``(input_ids, token_type_ids, attention_mask)`` for BERT). The loss object may also keep
running sums of extra metrics (``stats()``: e.g. correct and total masked tokens), which the loop reduces over all ranks
and turns into ratios with ``derive_metrics``.

The families are found by name in :data:`REGISTRY` (``zoo.models.registry.Registry``): each module below declares
``FAMILIES = {family name: Family instance}``, the names being the model files' (``zoo.models.gpt.FAMILY``, ...).
What differs between families is a :class:`Family` attribute naming the feature (``context_parallel``,
``fused_cross_entropy``, ...), so the run config and the loop ask the family, never compare its name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zoo.models.registry import Registry

# family name -> Family, one line per module that declares families
REGISTRY = Registry("model family", ("zoo.training.families.gpt", "zoo.training.families.bert",
                                     "zoo.training.families.unet"), "FAMILIES")


@dataclass
class Data:
    train: Any
    valid: Any | None
    tokenizer_dir: str | None = None
    bytes_per_token: float | None = None  # UTF-8 bytes per label token of the evaluated samples (bits per byte)


class Family:
    """Base class: a family overrides what differs. ``config`` below is the family's model config dataclass."""

    name = "?"
    config_class: type = None
    checkpointable_layers: tuple[str, ...] = ()
    unit = "tokens"  # what throughput counts ("tokens" or "samples")
    init_overridable: tuple[str, ...] = ()  # config fields a run may change in a model it initializes from
    context_parallel = False  # whether parallel.cp > 1 splits its sequences (GPT only)
    fused_cross_entropy = False  # whether training.fused_cross_entropy applies (an LM head over a vocabulary)
    diffusion_objective = False  # whether training.objective (ddpm or flow) chooses what it learns
    embedded_shapes = False  # whether its embedded data are drawn shapes (data.shapes_per_image, shape_radius, ...)
    lora = False  # whether finetune.lora puts LoRA / DoRA adapters on its layers (add_adapters)

    def build_config(self, preset: str | None, overrides: dict):
        if preset is None:
            return self.config_class.from_dict(overrides)
        return self.config_class.from_preset(preset, **overrides)

    def config_from_dict(self, d: dict):
        return self.config_class.from_dict(d)

    def config_from_init(self, src: str, overrides: dict):
        """(model config, tokenizer folder or None) of a folder to initialize from that is not a zoo folder."""
        raise ValueError(f"{src} is not a zoo model folder; the {self.name} family imports only zoo folders here "
                         f"(convert it first with launch/convert.py hf-to-zoo)")

    def import_folder(self, src: str, out) -> None:
        """Convert ``src`` (accepted by ``config_from_init``) into the zoo model folder ``out``."""
        raise ValueError(f"the {self.name} family cannot import {src}")

    def layer_specs(self, config, par) -> list:
        """The model's DeepSpeed layer specs, laid out by ``par`` (``zoo.models.gpt.ParallelOptions``: the TP group,
        sequence parallelism, and where the family has them the EP and CP groups; the run builds one for every family,
        ``zoo.training.engine.parallel_options``)."""
        raise NotImplementedError

    def loss(self, config, par=None):
        """The loss object for ``layer_specs(config, par)``'s output (``par`` None: one process)."""
        raise NotImplementedError

    def build_pipeline(self, config, specs, grid, *, loss_fn, cfg):
        """The ``PipelineModule`` for pp > 1 (DeepSpeed's own, partitioned by ``parallel.partition_method``)."""
        from zoo.models.specs import build_pipeline

        par = cfg.parallel
        return build_pipeline(specs, grid, loss_fn=loss_fn, base_seed=cfg.training.seed,
                              partition_method=par.partition_method,
                              activation_checkpointing=par.activation_checkpointing,
                              checkpointable_layers=self.checkpointable_layers)

    def add_adapters(self, module, lora, seed: int) -> list[str]:
        """Freeze ``module`` (a built model or pipeline stage) and put ``lora``'s adapters on it (``lora`` True)."""
        raise NotImplementedError

    def validate(self, cfg, config) -> None:
        """Family-specific checks of the run config (sequence length, data, tokenizer); raise ValueError."""

    def build_data(self, cfg, config, grid) -> Data:
        raise NotImplementedError

    def units_per_sample(self, cfg) -> int:
        return cfg.training.seq_length

    def training_flops_per_sample(self, cfg, config) -> float | None:
        return None

    def universal_checkpoint_info(self, config) -> dict:
        raise NotImplementedError

    def derive_metrics(self, stats: dict) -> dict:
        return {}

    def loss_label(self, cfg) -> str:
        """What the loss is, for the loss plot's axis."""
        return "cross entropy (nats/token)"

    def export_files(self, cfg, config) -> dict[str, str]:
        """Files written into the exported model folder beside the weights (name -> text), e.g. a sampler's
        config; none by default."""
        return {}

    def after_evaluation(self, engine, cfg, grid, data, step: int) -> None:
        """Called on every rank after each evaluation (collective work allowed), e.g. to draw predictions."""

    def after_training(self, model_dir, log) -> dict | None:
        """Anything shown at the end from the exported model (a text sample, an image grid); global rank 0 alone.
        Returns the pictures it drew, ``{logger key: PNG path}``, for the loggers that show pictures (W&B)."""


def get_family(name: str) -> Family:
    try:
        known = REGISTRY.names()
    except ModuleNotFoundError as e:  # a family module or what it imports at module level is missing
        raise ValueError(f"model.family {name!r} is not available in this version ({e.name} missing)") from None
    if name not in known:
        raise ValueError(f"model.family {name!r} is not known; families: {known}")
    return REGISTRY[name]


def has_feature(name: str, feature: str) -> bool:
    """Whether family ``name`` has ``feature`` (a :class:`Family` attribute); False for a name not known, which
    :func:`get_family` reports on its own."""
    family = REGISTRY.get(name)
    return family is not None and bool(getattr(family, feature))


def families_with(feature: str) -> str:
    """The names of the families that have ``feature``, for a message (``"gpt"``, ``"bert or gpt"``)."""
    return " or ".join(name for name in REGISTRY.names() if getattr(REGISTRY[name], feature))


def prepare_once(prepare, cfg, model, grid, *args) -> dict:
    """``prepare(cache folder, vocabulary size, *args)`` of the embedded corpus (``data.cache_dir``; the vocabulary is
    ``data.tokenizer_vocab_size`` or the model's) on every rank: global rank 0 builds the files while the others wait,
    then every rank calls it again, which finds them finished and only reads their marker."""
    from zoo.parallel.shards import barrier

    cache = Path(os.path.expanduser(cfg.data.cache_dir))
    vocab = cfg.data.tokenizer_vocab_size or model.vocab_size
    if grid.rank == 0:
        prepare(cache, vocab, *args)
    barrier()
    return prepare(cache, vocab, *args)


def read_run_config(out: Path) -> dict:
    """The raw ``config.yaml`` a run wrote (train.py's ``RunConfig.to_dict``); empty when absent."""
    import yaml

    path = Path(out) / "config.yaml"
    return (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}

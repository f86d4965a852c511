"""Run configuration: YAML -> dataclasses, command-line overrides, validation, and the DeepSpeed JSON.

A run config has five sections (see ``configs/gpt/tiny.yaml``)::

    model:     {family: a name of zoo.models.registry (gpt, bert, ...), preset: tiny,
                <any field of the family's config>: value}
    parallel:  {tp, pp, ep, zero_stage, sequence_parallel, activation_checkpointing, partition_method, cp, cp_algorithm}
    training:  {seed, steps, micro_batch_size, global_batch_size, gradient_accumulation_steps, seq_length,
                lr, min_lr, warmup_steps, weight_decay, adam_beta1, adam_beta2, adam_eps, grad_clip, precision,
                loggers: [tensorboard, wandb], wandb_project, wandb_name, wandb_tags}
    data:      {source: synthetic}
    finetune:  {lora: {r, alpha, dropout, targets, dora, rslora}}    (optional: adapters, zoo.models.lora)

Everything is checked by :func:`validate` before any process group exists; each problem is one line naming the
numbers and the fix. The DeepSpeed config is generated from the run config (:func:`deepspeed_config`), never kept
by hand beside it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from zoo.parallel.topology import check_layout


class ConfigError(ValueError):
    """A bad run configuration; the message is one line saying what and how to fix it."""


def default_family() -> str:
    """The family a run config without ``model.family`` trains: the GPT's (imported here, when a config is built,
    so that importing this module stays light)."""
    from zoo.models.gpt import FAMILY

    return FAMILY


@dataclass
class ModelSection:
    family: str = field(default_factory=default_family)
    preset: str | None = "tiny"
    overrides: dict = field(default_factory=dict)  # model config fields given beside `preset`

    def build(self):
        """The family's model config from ``preset`` plus the fields given beside it."""
        from zoo.training.families import get_family

        try:
            return get_family(self.family).build_config(self.preset, self.overrides)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"model: {e}") from None


@dataclass
class ParallelSection:
    tp: int = 1
    pp: int = 1
    ep: int = 1  # expert parallel (mixture-of-experts models): experts split over groups of ep data-parallel ranks
    # the EP groups take in the TP ranks (Megatron-Core's "parallel folding"): ep = tp x (data-parallel ranks)
    ep_spans_tp: bool = False
    zero_stage: int = 0
    sequence_parallel: bool = False
    activation_checkpointing: bool = False
    partition_method: str = "parameters"  # DeepSpeed: "parameters" | "uniform" | "type:<regex>"
    cp: int = 1  # context parallelism: each sequence split over cp ranks (GPT family; zoo.parallel.context_parallel)
    cp_algorithm: str = "ulysses"  # "ulysses" (all-to-all over heads) | "ring" (key/value blocks around the ring)


@dataclass
class TrainingSection:
    seed: int = 1234
    steps: int = 20
    micro_batch_size: int = 4
    global_batch_size: int | None = None  # default: micro_batch_size x accumulation x dp
    gradient_accumulation_steps: int | None = None  # default: derived from global_batch_size, else 1
    seq_length: int = 64
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 0
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    max_skipped_steps: int = 3  # stop after this many non-finite steps in a row (each is skipped on every rank)
    collective_timeout_minutes: float = 10.0  # a collective waiting longer fails (a rank died or hangs), as Megatron's
    precision: str = "fp32"  # "fp32" | "bf16" | "fp16"
    compile: bool = False  # torch.compile each block (GPT/BERT block, U-Net unit); the rest stays eager
    compile_backend: str = "inductor"  # torch.compile's backend ("aot_eager": capture only, to debug)
    # GPT: the LM head and the cross entropy in one pass over chunks of tokens (no [tokens, vocab] logits held; on
    # 2 CPU cores 15% off the benchmark's step), as Megatron's --cross-entropy-loss-fusion. ZeRO 0-2.
    fused_cross_entropy: bool = False
    # An exponential moving average of the weights (zoo.training.ema), e.g. 0.999; 0: none. Checkpoints hold it
    # (resumed in any layout) and the exported model/ is the average.
    ema_decay: float = 0.0
    # unet-diffusion: what the U-Net learns. "ddpm" (default): the noise, sampled by DDPM's ancestral chain; "flow":
    # the velocity of straight paths from data to noise (flow matching, as Stable Diffusion 3), sampled in Euler
    # steps. The export records it as diffusers' scheduler_config.json.
    objective: str | None = None
    log_interval: int = 1
    # evaluate on the validation split every N steps (and before step 1, and at the end); 0: never
    eval_interval: int = 0
    eval_iters: int = 4  # global batches per evaluation (always the same held-out samples)
    save_interval: int = 0  # checkpoint every N steps; the end of the run is always saved; 0: only at the end
    keep_last: int = 0  # keep only the newest N checkpoints; 0: keep all
    save: bool = True  # false: no checkpoints and no exported model (quick experiments, tests)
    init_from: str | None = None  # start from these weights: a zoo model folder, or a HuggingFace folder / Hub id
    loggers: list = field(default_factory=lambda: ["tensorboard"])  # besides metrics.jsonl: tensorboard, wandb
    wandb_project: str | None = None  # W&B project (default "zoo"); WANDB_ENTITY picks the team
    wandb_name: str | None = None  # W&B run name (default: the name of the out folder)
    wandb_tags: list | None = None  # W&B run tags


@dataclass
class DataSection:
    source: str = "embedded"  # "embedded" (the pydoc corpus, nothing to download) | "indexed" | "synthetic"
    paths: list | None = None  # indexed: Megatron's --data-path, [prefix, ...] or [weight, prefix, weight, prefix, ...]
    valid_paths: list | None = None  # indexed: validation prefixes; default: valid_fraction of each dataset's documents
    valid_fraction: float = 0.05
    tokenizer: str | None = None  # HF tokenizer folder (for samples and the exported model); embedded: trained
    tokenizer_vocab_size: int | None = None  # embedded: BPE vocabulary to train; default model.vocab_size
    cache_dir: str = "~/.cache/zoo"  # where the embedded corpus is tokenized once
    # U-Net families, embedded shapes images: at most this many shapes per image (default 3), their radius as
    # [min, max] fractions of the image size (default [0.12, 0.3]), and their centres at most this fraction of the
    # image size from the image's centre (0: centred; default anywhere)
    shapes_per_image: int | None = None
    shape_radius: list | None = None
    shape_offset: float | None = None


@dataclass
class FinetuneSection:
    # LoRA / DoRA adapters (zoo.models.lora.LoraConfig: r, alpha, dropout, targets, dora, rslora): the base weights
    # (training.init_from) frozen, only the adapters train; null: every weight trains
    lora: dict | None = None
    # a trained adapter to go on training: a PEFT adapter folder (adapter_config.json + adapter_model.safetensors) or a
    # zoo model folder holding adapters, on the base training.init_from; its settings become finetune.lora
    adapter: str | None = None


@dataclass
class RunConfig:
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    data: DataSection = field(default_factory=DataSection)
    finetune: FinetuneSection = field(default_factory=FinetuneSection)
    out: str = "runs/gpt"

    # Filled by validate(): the derived numbers every rank agrees on.
    dp: int = 1  # true data parallelism (different samples): world / (tp x cp x pp)
    gradient_accumulation_steps: int = 1
    global_batch_size: int = 0

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["model"] = {"family": self.model.family, "preset": self.model.preset, **self.model.overrides}
        return d


_SECTIONS = {"model": ModelSection, "parallel": ParallelSection, "training": TrainingSection, "data": DataSection,
             "finetune": FinetuneSection}


def _coerce(value: str) -> Any:
    """A --set value as YAML would read it: numbers, booleans, null, lists, or a plain string."""
    return yaml.safe_load(value)


def _typed(section: str, f: dataclasses.Field, value: Any) -> Any:
    """Check a value against the field's annotation; numbers written as strings ('3e-4', which YAML reads as text)
    become numbers. Anything else that does not fit is a one-line error."""
    kind = str(f.type).replace(" | None", "")
    if value is None and "None" in str(f.type):
        return None
    try:
        if kind == "float" and isinstance(value, (int, float, str)) and not isinstance(value, bool):
            return float(value)
        if kind == "int" and not isinstance(value, bool):
            if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
                return int(value)
            if isinstance(value, str):
                return int(value)
        if kind == "bool" and isinstance(value, bool):
            return value
        if kind == "str" and isinstance(value, str):
            return value
        if kind == "list":
            if isinstance(value, (str, int, float)) and not isinstance(value, bool):
                return [value]  # --set data.paths=data/corpus: one prefix
            if isinstance(value, list):
                return value
        if kind == "dict" and isinstance(value, dict):
            return value
    except ValueError:
        pass
    else:
        if kind not in ("float", "int", "bool", "str", "list", "dict"):
            return value
    raise ConfigError(f"{section}.{f.name} must be {'an' if kind == 'int' else 'a'} {kind}, got {value!r}")


def from_dict(raw: dict) -> RunConfig:
    raw = dict(raw or {})
    cfg = RunConfig()
    unknown = sorted(set(raw) - set(_SECTIONS) - {"out"})
    if unknown:
        raise ConfigError(f"unknown top-level key(s) {unknown}; expected {sorted(_SECTIONS) + ['out']}")
    if "out" in raw:
        cfg.out = str(raw["out"])
    for name, cls in _SECTIONS.items():
        section = dict(raw.get(name) or {})
        if not isinstance(section, dict):
            raise ConfigError(f"section {name!r} must be a mapping, got {type(section).__name__}")
        if cls is ModelSection:
            family = section.pop("family") if "family" in section else default_family()
            preset = section.pop("preset", "tiny")
            setattr(cfg, name, ModelSection(family, preset, section))
            continue
        known = {f.name: f for f in fields(cls)}
        bad = sorted(set(section) - set(known))
        if bad:
            raise ConfigError(f"unknown key(s) {bad} in section {name!r}; known: {sorted(known)}")
        setattr(cfg, name, cls(**{k: _typed(name, known[k], v) for k, v in section.items()}))
    return cfg


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """``section.key=value`` pairs (``--set training.lr=3e-4 model.num_hidden_layers=8``) into a raw dict."""
    raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in (raw or {}).items()}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set expects section.key=value, got {item!r}")
        key, value = item.split("=", 1)
        parts = key.split(".")
        if len(parts) == 1 and parts[0] == "out":
            raw["out"] = value
            continue
        if len(parts) == 3 and parts[:2] == ["finetune", "lora"]:  # --set finetune.lora.r=16
            section = dict(raw.get("finetune") or {})
            lora = section.get("lora")
            section["lora"] = {**(lora if isinstance(lora, dict) else {}), parts[2]: _coerce(value)}
            raw["finetune"] = section
            continue
        if len(parts) != 2 or parts[0] not in _SECTIONS:
            raise ConfigError(f"--set key {key!r} must be <section>.<key> with section in {sorted(_SECTIONS)}, "
                              "finetune.lora.<key>, or 'out'")
        raw.setdefault(parts[0], {})
        raw[parts[0]] = dict(raw[parts[0]] or {})
        raw[parts[0]][parts[1]] = _coerce(value)
    return raw


def load(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    raw: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist; see configs/ for examples")
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {str(e).splitlines()[0]}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {str(p)!r} must hold a mapping of sections")
    return from_dict(apply_overrides(raw, list(overrides)))


def init_model_config(cfg: RunConfig):
    """The model config of ``training.init_from`` (zoo folder, or what the family imports: an HF folder or Hub id
    for GPT) and the tokenizer folder beside it, if any."""
    from zoo.convert import io
    from zoo.training.families import get_family

    src = cfg.training.init_from
    try:
        family = get_family(cfg.model.family)
    except ValueError as e:
        raise ConfigError(f"model: {e}") from None
    bad = sorted(set(cfg.model.overrides) - set(family.init_overridable))
    if bad:
        raise ConfigError(f"model fields {bad} cannot be set when initializing from {src}: the model comes from "
                          f"there (only {list(family.init_overridable)} may change)")
    try:
        if not io.is_model_folder(src):
            return family.config_from_init(src, cfg.model.overrides)
        name, config = io.read_config(src)
        if name != cfg.model.family:
            raise ConfigError(f"training.init_from {src} holds a {name!r} model, this run trains "
                              f"{cfg.model.family!r}; set model.family: {name}")
        model = family.config_from_dict({**config, **cfg.model.overrides})
    except ConfigError:
        raise
    except (ValueError, OSError) as e:
        raise ConfigError(f"training.init_from: {e}") from None
    has_tokenizer = any((Path(src) / name).is_file() for name in io.TOKENIZER_FILES[:2])
    return model, str(src) if has_tokenizer else None


def _validate_diffusion_options(cfg: RunConfig) -> None:
    """training.objective and the shapes options of data: where they apply and their values."""
    from zoo.training.families import families_with, has_feature

    tr, data, family = cfg.training, cfg.data, cfg.model.family
    if tr.objective is not None:
        if not has_feature(family, "diffusion_objective"):
            raise ConfigError(f"training.objective is for the {families_with('diffusion_objective')} family, not "
                              f"{family!r}; remove it")
        if tr.objective not in ("ddpm", "flow"):
            raise ConfigError(f"training.objective must be ddpm (noise prediction) or flow (flow matching), got "
                              f"{tr.objective!r}")
    for name in ("shapes_per_image", "shape_radius", "shape_offset"):
        if getattr(data, name) is None:
            continue
        if not has_feature(family, "embedded_shapes") or data.source == "folders":
            raise ConfigError(f"data.{name} shapes the embedded images of the U-Net families; it means nothing "
                              f"for {family!r} with data.source {data.source!r}: remove it")
    n = data.shapes_per_image
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ConfigError(f"data.shapes_per_image must be a positive integer, got {n!r}")
    r = data.shape_radius
    if r is not None and not (isinstance(r, (list, tuple)) and len(r) == 2
                              and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in r)
                              and 0 < r[0] <= r[1] <= 0.5):
        raise ConfigError(f"data.shape_radius must be [min, max] fractions of the image size with "
                          f"0 < min <= max <= 0.5, e.g. [0.25, 0.45]; got {r!r}")
    o = data.shape_offset
    if o is not None and (isinstance(o, bool) or not isinstance(o, (int, float)) or not 0 <= o <= 0.5):
        raise ConfigError(f"data.shape_offset must be a fraction of the image size in [0, 0.5] (0: shapes centred), "
                          f"got {o!r}; remove it to place shapes anywhere")


def validate(cfg: RunConfig, world_size: int, *, fp16_supported: bool | None = None,
             bf16_supported: bool | None = None):
    """Check the run for ``world_size`` processes; fill in dp, accumulation and global batch. Returns the model config.

    The checks run in this order (the first problem found is the one reported): the model, the layout, ZeRO and
    sequence parallelism, the training numbers, the batch, the training options, then the family's data."""
    model = _model_config(cfg)
    _validate_layout(cfg, model, world_size)
    _validate_zero_and_sequence_parallel(cfg, model)
    _validate_training_numbers(cfg.training)
    _fill_batch(cfg)
    _validate_training_options(cfg, fp16_supported, bf16_supported)
    _validate_finetune(cfg, model)
    validate_data(cfg, model)
    return model


def lora_config(cfg: RunConfig):
    """The run's adapters (``finetune.lora``, a ``zoo.models.lora.LoraConfig``), or None: every weight trains."""
    if cfg.finetune.lora is None:
        return None
    from zoo.models.lora import LoraConfig

    try:
        return LoraConfig.from_dict(cfg.finetune.lora)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"finetune.{e}") from None


def _validate_finetune(cfg: RunConfig, model) -> None:
    """``finetune.lora``: its fields, the family, the targets against the model and the training options, and an
    ``init_from`` folder that holds adapters of its own."""
    from zoo.training.families import families_with, has_feature

    src = cfg.training.init_from
    held = None
    if src is not None:
        from zoo.convert import io

        held = io.read_adapter(src) if io.is_model_folder(src) else None
    if cfg.finetune.adapter is not None:
        _adapter_settings(cfg, model, held)
    lora = lora_config(cfg)
    if lora is None:
        if held is not None:
            raise ConfigError(f"training.init_from {src} holds LoRA adapters (r {held.get('r')}); set finetune.lora "
                              f"to go on training them (--set finetune.lora.r={held.get('r')}), or merge them first "
                              f"(launch/convert.py merge-adapter)")
        return
    if not has_feature(cfg.model.family, "lora"):
        raise ConfigError(f"finetune.lora is for the {families_with('lora')} family, not {cfg.model.family!r}; "
                          f"remove it")
    from zoo.models.lora import check_model

    try:
        check_model(lora, model)
    except ValueError as e:
        raise ConfigError(f"finetune.{e}") from None
    if "lm_head" in lora.targets and cfg.training.fused_cross_entropy and lora.dropout:
        raise ConfigError(f"finetune.lora.dropout {lora.dropout} on the 'lm_head' target does not work with "
                          f"training.fused_cross_entropy (the loss reads the head's merged weight, W + s B A, which "
                          f"has no input to drop); set finetune.lora.dropout: 0, remove 'lm_head', or set "
                          f"training.fused_cross_entropy: false")
    if held is not None:
        mine = {k: getattr(lora, k) for k in ("r", "targets", "dora")}
        theirs = {k: held.get(k) for k in mine}
        if mine != theirs:
            raise ConfigError(f"training.init_from {src} holds adapters {theirs}, finetune.lora asks for {mine}; set "
                              f"finetune.lora to the folder's to go on training them")


def _adapter_settings(cfg: RunConfig, model, held) -> None:
    """``finetune.adapter``: read (its tensors are small) through the base's key table, refused in one line where it
    does not fit the base; its settings fill ``finetune.lora``, or must agree with it."""
    where, src = cfg.finetune.adapter, cfg.training.init_from
    if src is None:
        raise ConfigError(f"finetune.adapter {where} needs its base model: set training.init_from (--init BASE)")
    if held is not None:
        raise ConfigError(f"training.init_from {src} holds adapters already and finetune.adapter names {where}; "
                          f"give one of them")
    from zoo.convert.errors import ConvertError
    from zoo.convert.peft import adapter_for_init

    try:
        settings, _ = adapter_for_init(where, src, model)
    except (ConvertError, OSError, ValueError) as e:
        raise ConfigError(f"finetune.adapter: {e}") from None
    if cfg.finetune.lora is None:
        cfg.finetune.lora = settings.to_dict()  # go on training the adapter as it is
        return
    mine = {k: cfg.finetune.lora.get(k) for k in ("r", "targets", "dora")}
    theirs = {k: getattr(settings, k) for k in mine}
    theirs["targets"] = list(theirs["targets"])
    if {**mine, "targets": sorted(mine["targets"] or [])} != {**theirs, "targets": sorted(theirs["targets"])}:
        raise ConfigError(f"finetune.adapter {where} holds adapters {theirs}, finetune.lora asks for {mine}; drop "
                          f"finetune.lora (the adapter's settings are used) or make them agree")


def _model_config(cfg: RunConfig):
    """The model config: ``training.init_from``'s (its tokenizer too, unless ``data.tokenizer`` names one), else the
    ``model`` section's."""
    if cfg.training.init_from is None:
        return cfg.model.build()
    model, tokenizer = init_model_config(cfg)
    if cfg.data.tokenizer is None and tokenizer is not None:
        cfg.data.tokenizer = tokenizer
    return model


def _has_experts(model) -> bool:
    return getattr(model, "num_experts", 0) > 0


def _validate_layout(cfg: RunConfig, model, world_size: int) -> None:
    """tp, pp, ep (and ep_spans_tp) and cp against the world size and the model; sets ``cfg.dp``."""
    par = cfg.parallel
    for name in ("tp", "pp", "ep"):
        v = getattr(par, name)
        if not isinstance(v, int) or v < 1:
            raise ConfigError(f"parallel.{name} must be a positive integer, got {v!r}")
    if world_size % (par.tp * par.pp):
        raise ConfigError(f"world size {world_size} is not divisible by tp*pp = {par.tp * par.pp} "
                          f"(tp={par.tp}, pp={par.pp}); launch a multiple of {par.tp * par.pp} processes")
    cfg.dp = world_size // (par.tp * par.pp)
    moe = _has_experts(model)
    if par.ep > 1 and not moe:
        raise ConfigError(f"parallel.ep {par.ep} needs a mixture-of-experts model (model.num_experts > 0, e.g. "
                          f"model.preset: tiny-moe); use ep 1 for a dense model")
    if not isinstance(par.ep_spans_tp, bool):
        raise ConfigError(f"parallel.ep_spans_tp must be true or false, got {par.ep_spans_tp!r}")
    if par.ep_spans_tp and not moe:
        raise ConfigError("parallel.ep_spans_tp needs a mixture-of-experts model (model.num_experts > 0); leave it "
                          "false for a dense model")
    par.ep_spans_tp = par.ep_spans_tp and par.tp > 1 and par.ep > 1  # as ParallelGrid holds it (a no-op else)
    try:
        check_layout(world_size, par.tp, par.pp, par.ep, ep_spans_tp=par.ep_spans_tp)  # ep divides dp (x tp)
        model.check_layout(par.tp, par.pp, **({"ep": par.ep} if moe else {}))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    validate_context_parallel(cfg, model, world_size)
    if par.cp > 1 and par.ep > 1:
        try:
            check_layout(world_size, par.tp, par.pp, par.ep, par.cp, par.ep_spans_tp)  # the true dp: world/(tp cp pp)
        except ValueError as e:
            raise ConfigError(str(e)) from None


def _validate_zero_and_sequence_parallel(cfg: RunConfig, model) -> None:
    """The ZeRO stage against pipeline and expert parallelism; sequence parallelism against tp."""
    par, tr = cfg.parallel, cfg.training
    if par.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"parallel.zero_stage must be 0, 1, 2 or 3, got {par.zero_stage!r}")
    if _has_experts(model) and par.zero_stage == 3 and par.ep > 1:
        raise ConfigError(f"ZeRO stage 3 does not work with expert parallelism (ep={par.ep}; DeepSpeed refuses its MoE "
                          f"layers under ZeRO-3); use parallel.zero_stage 1 or 2, or ep 1 (ZeRO-3 then partitions "
                          f"the experts like any weight)")
    if par.pp > 1 and par.zero_stage > 1:
        raise ConfigError(f"ZeRO stage {par.zero_stage} does not work with pipeline parallelism (pp={par.pp}); "
                          f"use zero_stage 0 or 1 with pp > 1, or pp=1 for ZeRO-2/3")
    if par.sequence_parallel and par.tp == 1:
        raise ConfigError("parallel.sequence_parallel needs tp > 1 (it splits the sequence over the TP group)")
    if par.sequence_parallel and tr.seq_length % par.tp:
        raise ConfigError(f"training.seq_length {tr.seq_length} is not divisible by tp {par.tp}, "
                          f"which sequence parallelism needs")


def _validate_training_numbers(tr: TrainingSection) -> None:
    """The counts that must be positive integers, and the collective timeout."""
    for name in ("steps", "micro_batch_size", "seq_length", "log_interval", "max_skipped_steps"):
        v = getattr(tr, name)
        if not isinstance(v, int) or v < 1:
            raise ConfigError(f"training.{name} must be a positive integer, got {v!r}")
    if isinstance(tr.lr, bool) or not isinstance(tr.lr, (int, float)) or not tr.lr > 0:  # the schedule divides by it
        raise ConfigError(f"training.lr must be a positive number (the peak learning rate, e.g. 3e-4), got {tr.lr!r}")
    if isinstance(tr.collective_timeout_minutes, bool) or not isinstance(tr.collective_timeout_minutes, (int, float)) \
            or not tr.collective_timeout_minutes > 0:
        raise ConfigError(f"training.collective_timeout_minutes must be a positive number of minutes, got "
                          f"{tr.collective_timeout_minutes!r}")


def _fill_batch(cfg: RunConfig) -> None:
    """``cfg.gradient_accumulation_steps`` and ``cfg.global_batch_size`` (= micro batch x accumulation x dp) from
    whichever of ``global_batch_size`` and ``gradient_accumulation_steps`` the run sets."""
    tr = cfg.training
    per_step = tr.micro_batch_size * cfg.dp
    if tr.global_batch_size is None:
        cfg.gradient_accumulation_steps = tr.gradient_accumulation_steps or 1
    else:
        if tr.global_batch_size % per_step:
            raise ConfigError(f"global batch {tr.global_batch_size} is not divisible by micro batch "
                              f"{tr.micro_batch_size} x dp {cfg.dp} = {per_step}; global batch = micro batch x "
                              f"gradient accumulation x dp")
        cfg.gradient_accumulation_steps = tr.global_batch_size // per_step
        if tr.gradient_accumulation_steps not in (None, cfg.gradient_accumulation_steps):
            raise ConfigError(f"global batch {tr.global_batch_size} != micro batch {tr.micro_batch_size} x gradient "
                              f"accumulation {tr.gradient_accumulation_steps} x dp {cfg.dp}; set one of "
                              f"global_batch_size or gradient_accumulation_steps")
    cfg.global_batch_size = per_step * cfg.gradient_accumulation_steps


def _validate_training_options(cfg: RunConfig, fp16_supported: bool | None, bf16_supported: bool | None) -> None:
    """Precision (and whether the device has it), fused cross entropy, EMA, the diffusion and shapes options,
    torch.compile's backend, the evaluation and checkpoint intervals, the loggers."""
    tr = cfg.training
    if tr.precision not in ("fp32", "bf16", "fp16"):
        raise ConfigError(f"training.precision must be fp32, bf16 or fp16, got {tr.precision!r}")
    if tr.fused_cross_entropy:
        from zoo.training.families import families_with, has_feature

        if not has_feature(cfg.model.family, "fused_cross_entropy"):
            raise ConfigError(f"training.fused_cross_entropy is for the {families_with('fused_cross_entropy')} family "
                              f"(its LM head), not {cfg.model.family!r}; remove it")
    if isinstance(tr.ema_decay, bool) or not isinstance(tr.ema_decay, (int, float)) or not 0 <= tr.ema_decay < 1:
        raise ConfigError(f"training.ema_decay must be a number in [0, 1) (0: no average; e.g. 0.999), got "
                          f"{tr.ema_decay!r}")
    _validate_diffusion_options(cfg)
    if tr.compile:
        from zoo.compat.torch import compile_backends

        backends = compile_backends()
        if tr.compile_backend not in backends + ["inductor"]:
            raise ConfigError(f"training.compile_backend {tr.compile_backend!r} is not a torch.compile backend; "
                              f"use one of {sorted(set(backends + ['inductor']))}")
    if tr.precision in ("fp16", "bf16"):
        _check_precision_supported(tr.precision, fp16_supported, bf16_supported)
    if tr.eval_interval and tr.eval_iters < 1:
        raise ConfigError(f"training.eval_iters must be >= 1 when eval_interval is set, got {tr.eval_iters}")
    for name in ("eval_interval", "save_interval", "keep_last"):
        if getattr(tr, name) < 0:
            raise ConfigError(f"training.{name} must be >= 0, got {getattr(tr, name)}")
    from zoo.training.loggers import check_loggers

    try:
        check_loggers(tr)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_precision_supported(precision: str, fp16_supported: bool | None, bf16_supported: bool | None) -> None:
    """One line when this device lacks ``precision`` (fp16 or bf16); the flags stand in for the device in tests."""
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    supported = {"fp16": fp16_supported if fp16_supported is not None else accel.is_fp16_supported(),
                 "bf16": bf16_supported if bf16_supported is not None else accel.is_bf16_supported()}
    if not supported[precision]:
        raise ConfigError(f"{precision} is not supported on this device ({accel.device_name()}); "
                          f"use training.precision: {'bf16' if supported['bf16'] else 'fp32'}")


def validate_context_parallel(cfg: RunConfig, model, world_size: int) -> None:
    """``parallel.cp`` and ``parallel.cp_algorithm``: one line per problem. Sets ``cfg.dp`` to world / (tp x cp x pp).

    The sequence is split into cp parts (Ulysses) or 2 cp chunks (ring's causal load balance); Ulysses then splits
    each TP rank's query heads over CP; sequence parallelism splits each rank's s/cp positions over TP.
    """
    from zoo.parallel.context_parallel import ALGORITHMS, check_sequence_split, check_ulysses_heads
    from zoo.training.families import families_with, get_family

    par, tr = cfg.parallel, cfg.training
    if not isinstance(par.cp, int) or par.cp < 1:
        raise ConfigError(f"parallel.cp must be a positive integer, got {par.cp!r}")
    if par.cp_algorithm not in ALGORITHMS:
        raise ConfigError(f"parallel.cp_algorithm must be one of {list(ALGORITHMS)}, got {par.cp_algorithm!r}")
    if par.cp == 1:
        return
    if not get_family(cfg.model.family).context_parallel:
        raise ConfigError(f"context parallelism (cp={par.cp}) is for the {families_with('context_parallel')} family, "
                          f"not {cfg.model.family!r}; "
                          f"use cp=1 (tp, pp and dp work for every family)")
    n = par.tp * par.cp * par.pp
    if world_size % n:
        raise ConfigError(f"world size {world_size} is not divisible by tp*cp*pp = {n} (tp={par.tp}, cp={par.cp}, "
                          f"pp={par.pp}); launch a multiple of {n} processes")
    cfg.dp = world_size // n
    try:
        check_sequence_split(tr.seq_length, par.cp, par.cp_algorithm)
        if par.cp_algorithm == "ulysses":
            check_ulysses_heads(model.num_attention_heads // par.tp, par.cp)
    except ValueError as e:
        raise ConfigError(f"{e}") from None
    if par.sequence_parallel and (tr.seq_length // par.cp) % par.tp:
        raise ConfigError(f"training.seq_length {tr.seq_length} / cp {par.cp} = {tr.seq_length // par.cp} positions "
                          f"per CP rank are not divisible by tp {par.tp}, which sequence parallelism needs")
    if par.cp_algorithm == "ring" and model.attention_dropout > 0:
        raise ConfigError(f"ring attention has no attention dropout (attention_dropout={model.attention_dropout}); "
                          f"set model.attention_dropout=0 or parallel.cp_algorithm=ulysses")


def validate_data(cfg: RunConfig, model) -> None:
    """The family's own checks (data files, tokenizer, sequence length), as one-line ConfigErrors."""
    from zoo.training.families import get_family

    try:
        get_family(cfg.model.family).validate(cfg, model)
    except ConfigError:
        raise
    except (ValueError, OSError) as e:
        raise ConfigError(str(e)) from None


DEEPSPEED_BUCKET = 500_000_000  # elements: DeepSpeed's default reduce_bucket_size


def reduce_bucket_elements(rank_parameters: int) -> int:
    """ZeRO's reduction bucket (``reduce_bucket_size``, elements) for a rank that holds ``rank_parameters``.

    DeepSpeed's default, 5e8 elements, is allocated on every rank whatever the model's size (2 GB in fp32, 1 GB in
    bf16; two at pp > 1 under ZeRO-1/2): most of a small model's memory on a GPU. A bucket as large as the rank's
    parameters never fills before the default one would, so the same gradients are reduced in the same calls; at
    more than 5e8 parameters per rank the default stays."""
    return max(1, min(DEEPSPEED_BUCKET, int(rank_parameters)))


def deepspeed_config(cfg: RunConfig, rank_parameters: int | None = None) -> dict:
    """The DeepSpeed JSON for a validated run config; with ``rank_parameters`` (the parameters this rank's module
    holds before ZeRO partitions them), ZeRO's reduction bucket sized by :func:`reduce_bucket_elements`.

    The LR schedule is zoo's own (``zoo.training.engine.lr_factor``, handed to ``deepspeed.initialize``): DeepSpeed's
    WarmupCosineLR trains its first step at LR 0.
    """

    tr, par = cfg.training, cfg.parallel
    ds = {
        # DeepSpeed counts a sample on each of its data-parallel ranks, dp x cp: the cp ranks of a replica share one.
        "train_batch_size": cfg.global_batch_size * par.cp,
        "train_micro_batch_size_per_gpu": tr.micro_batch_size,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        "optimizer": {
            "type": "AdamW",
            # torch's AdamW with its fused kernel (accelerators and CPU; on 2 CPU cores 5x faster than the loop
            # over parameters torch picks by default there): no JIT build of DeepSpeed's FusedAdam needed.
            "params": {"lr": tr.lr, "betas": [tr.adam_beta1, tr.adam_beta2], "eps": tr.adam_eps,
                       "weight_decay": tr.weight_decay, "torch_adam": True, "fused": True},
        },
        "gradient_clipping": tr.grad_clip,
        "zero_optimization": {"stage": par.zero_stage},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if rank_parameters is not None and par.zero_stage >= 1:
        ds["zero_optimization"]["reduce_bucket_size"] = reduce_bucket_elements(rank_parameters)
    if par.ep > 1 and par.zero_stage in (1, 2):
        # DeepSpeed's MoE path in ZeRO-1/2 asserts both (its defaults today); say so rather than rely on them.
        ds["zero_optimization"].update(contiguous_gradients=True, reduce_scatter=True)
    if par.sequence_parallel and par.pp > 1:
        # DeepSpeed's partitioned p2p assumes activations replicated over TP; with SP each rank holds its own shard.
        ds["pipeline"] = {"pipe_partitioned": False, "grad_partitioned": False}
    if tr.precision == "bf16":
        ds["bf16"] = {"enabled": True}
    elif tr.precision == "fp16":
        ds["fp16"] = {"enabled": True, "initial_scale_power": 16}
    return ds

"""LoRA / DoRA adapters: zoo adapter tensors <-> unmerged PEFT adapter folders, and merging one into a full HF folder.

zoo's adapter on a weight ``<prefix>.weight`` (zoo layout, rows = outputs) is ``<prefix>.lora_A`` [r, in],
``<prefix>.lora_B`` [out, r] and, with DoRA, ``<prefix>.lora_magnitude`` [out], its rows in zoo's row order of the
weight; the model folder's config.json says ``"lora": {"r", "alpha", "dropout", "targets", "dora", "rslora"}``.
The weight becomes ``W + s B A`` with ``s = alpha / r`` (rslora: ``alpha / sqrt(r)``); DoRA's is
``m / ||W + s B A|| * (W + s B A)``, the norm per output row over the inputs: PEFT's math.

A PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``) holds, per HF module the base weight came
from, ``base_model.model.<HF module>.lora_A.weight`` [r, in], ``.lora_B.weight`` [out_k, r] (and DoRA's
``.lora_magnitude_vector`` [out_k]). The architecture's key table says which: a zoo weight's rows move to HF's by
the row's ``to_hf`` (pure row movement: the fused QKV de-interleaved per key-value group, gate/up split, Phi-3's
fused ``qkv_proj`` kept fused in HF's order, GPT-2's Conv1D transposed), so B and the magnitude go through the same
``to_hf`` unchanged and A, the input side, is shared by every HF projection the weight came from (written for each).
GPT-2's Conv1D is written as PEFT expects it (``fan_in_fan_out``: B and A as for a Linear, the weight transposed).
MoE experts ``[E, out, in]``: one adapter per expert, per expert under transformers 4's names where peft converts
those on load (``PER_EXPERT_PEFT``), else as peft's fused-parameter adapters (``target_parameters``).
The embedding (PEFT's ``lora_embedding_A`` [r, V], ``lora_embedding_B`` [h, r]) is zoo's ``W [V, h] + s B A`` with
B = PEFT's A transposed and A = PEFT's B transposed.

Import is the inverse. PEFT's adapters on q, k and v (or gate and up) with different A's have no zoo form (one A
per zoo weight): refused in one line, as are ``rank_pattern`` / ``alpha_pattern``, LoRA biases and
``modules_to_save``.

Entry points: :func:`zoo_to_peft` (``launch/convert.py zoo-to-peft``, ``zoo-to-hf --adapter-out``),
:func:`read_adapter` / :func:`adapter_for_init` (a PEFT or zoo folder -> zoo's settings and whole adapter tensors, for
``launch/finetune.py --init BASE --adapter DIR``), :func:`write_adapter_folder` (``peft-to-zoo``), :func:`merge_adapter`
(``merge-adapter``: merged in zoo's layout with PEFT's order of operations, exported through the key table).
Notation: r rank, h hidden, V vocabulary, E experts, I expert width.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from zoo.convert.errors import ConvertError
from zoo.convert.tables import Row
from zoo.models.gpt import FAMILY
from zoo.models.lora import DEFAULT_TARGETS  # the run config's default targets, one place

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# zoo target name -> how its weight's key ends in zoo's module tree
TARGETS = {"qkv": ".attention.qkv.weight", "dense": ".attention.dense.weight", "fc1": ".mlp.fc1.weight",
           "fc2": ".mlp.fc2.weight", "experts": (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"),
           "embedding": ".word_embeddings.weight", "lm_head": ".linear.weight"}
EXPERT_KEY = re.compile(r"\.experts\.(\d+)\.")


# ---------------------------------------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoraSettings:
    """What a model folder's ``"lora"`` records (the lora helper's ``LoraConfig.to_dict()``)."""

    r: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = DEFAULT_TARGETS
    dora: bool = False
    rslora: bool = False

    @property
    def scale(self) -> float:
        return self.alpha / math.sqrt(self.r) if self.rslora else self.alpha / self.r

    @classmethod
    def from_dict(cls, d: dict, where: str = "lora") -> LoraSettings:
        known = {"r", "alpha", "dropout", "targets", "dora", "rslora"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConvertError(f"{where}: unknown field(s) {unknown}; known: {sorted(known)}")
        if not isinstance(d.get("r"), int) or d["r"] < 1:
            raise ConvertError(f"{where}: r {d.get('r')!r} must be a positive integer")
        targets = tuple(d.get("targets") or DEFAULT_TARGETS)
        bad = sorted(set(targets) - set(TARGETS))
        if bad:
            raise ConvertError(f"{where}: targets {bad} are not zoo modules; choose from {sorted(TARGETS)}")
        return cls(r=d["r"], alpha=float(d.get("alpha", d["r"])), dropout=float(d.get("dropout", 0.0)),
                   targets=targets, dora=bool(d.get("dora", False)), rslora=bool(d.get("rslora", False)))

    def to_dict(self) -> dict:
        return {"r": self.r, "alpha": self.alpha, "dropout": self.dropout, "targets": list(self.targets),
                "dora": self.dora, "rslora": self.rslora}


def read_settings(folder) -> LoraSettings | None:
    """The ``"lora"`` settings of a zoo model folder's config.json (beside ``"config"``, or inside it); None
    without."""
    meta = json.loads((Path(folder) / "config.json").read_text())
    d = meta.get("lora", (meta.get("config") or {}).get("lora"))
    return None if d is None else LoraSettings.from_dict(d, f"{Path(folder) / 'config.json'}: lora")


def target_of(zoo_key: str) -> str | None:
    """The zoo target a base weight belongs to (``"qkv"``, ``"experts"``, ...), None for a weight no target names."""
    for name, ends in TARGETS.items():
        if zoo_key.endswith(ends):
            return name
    return None


def adapter_prefix(zoo_key: str) -> str:
    """``3.attention.qkv.weight`` -> ``3.attention.qkv``; an expert parameter keeps its name
    (``3.mlp.experts.gate_up_proj`` -> its ``_lora_A``)."""
    return zoo_key[: -len(".weight")] if zoo_key.endswith(".weight") else zoo_key


def adapter_keys(zoo_key: str) -> tuple[str, str, str]:
    """The zoo names of a base weight's A, B and magnitude."""
    p = adapter_prefix(zoo_key)
    sep = "." if zoo_key.endswith(".weight") else "_"
    return f"{p}{sep}lora_A", f"{p}{sep}lora_B", f"{p}{sep}lora_magnitude"


# ---------------------------------------------------------------------------------------------------------------
# One key-table row: how a zoo weight's rows land in its HF tensors
# ---------------------------------------------------------------------------------------------------------------


def _transposed(row: Row, lead: tuple[int, ...]) -> list[bool]:
    """Which of the row's HF tensors hold the weight transposed (GPT-2's Conv1D ``[in, out]``), found by running
    ``to_hf`` on a meta tensor of the weight's leading shape ``lead`` (``(out,)``, experts ``(E, out)``) and more
    columns than any HF tensor has rows; a transform that moves values between columns (not rows) has no
    per-projection B and A: refused."""
    wide = math.prod(lead) + 7
    shapes = [tuple(t.shape) for t in row.hf_tensors(torch.empty(*lead, wide, device="meta"))]
    flags = []
    for key, shape in zip(row.hf, shapes):
        if shape[-1] == wide:
            flags.append(False)
        elif len(shape) == 2 and shape[0] == wide:
            flags.append(True)
        else:
            raise ConvertError(f"{key}: its key-table transform does not keep the weight's columns; no LoRA form")
    marker = torch.arange(3.0).expand(*lead, 3)  # each column's index: a row move keeps every row [0, 1, 2]
    for key, t, flag in zip(row.hf, row.hf_tensors(marker.clone()), flags):
        t = t.t() if flag else t
        if not torch.equal(t, torch.arange(3.0).expand_as(t)):
            raise ConvertError(f"{key}: its key-table transform mixes the weight's columns; no LoRA form")
    return flags


def rows_to_hf(row: Row, t: torch.Tensor, flags: list[bool]) -> tuple[torch.Tensor, ...]:
    """A tensor with the weight's rows (B [out, r], the magnitude as [out, 1]) -> one per HF tensor [out_k, ...]."""
    return tuple((x.t() if flag else x).contiguous() for x, flag in zip(row.hf_tensors(t), flags))


def rows_to_zoo(row: Row, parts, flags: list[bool]) -> torch.Tensor:
    """The inverse of :func:`rows_to_hf`."""
    return row.to_zoo(*((x.t() if flag else x).contiguous() for x, flag in zip(parts, flags)))


def hf_module(key: str) -> str:
    return key[: -len(".weight")] if key.endswith(".weight") else key


def is_embedding(zoo_key: str) -> bool:
    return zoo_key.endswith(TARGETS["embedding"])


# ---------------------------------------------------------------------------------------------------------------
# zoo -> PEFT
# ---------------------------------------------------------------------------------------------------------------


def adapted_rows(rows: list[Row], names) -> list[Row]:
    """The rows whose zoo weight has an adapter among the tensor names ``names``."""
    return [r for r in rows if adapter_keys(r.zoo)[0] in names]


def expert_of(key: str) -> int | None:
    """The expert a per-expert HF key belongs to (``...experts.3.w1.weight`` -> 3), None for any other key."""
    m = EXPERT_KEY.search(key)
    return None if m is None else int(m.group(1))


# The classes whose per-expert adapters (transformers 4's names) peft 0.21.2 converts on load into transformers 5's
# fused experts; for the others (Qwen2-MoE: peft maps other classes to its pattern but not qwen2_moe itself) the
# experts go out fused, as peft's own target_parameters adapters are saved.
PER_EXPERT_PEFT = {"MixtralForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM"}
FUSED_PARAMS = ("gate_up_proj", "down_proj")
FUSED_EXPERTS = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")


def fused_expert_module(hf_key: str) -> str:
    """Where peft keeps the adapter of a fused expert parameter: its ParamWrappers nest on the experts module,
    gate_up_proj's inside (``experts.base_layer``), down_proj's outside (``experts``)."""
    module, param = hf_key.rsplit(".", 1)
    return f"{module}.base_layer" if param == "gate_up_proj" else module


def refuse_expert_variants(settings: LoraSettings, where: str) -> None:
    """What PEFT (0.21, transformers 5) cannot load on MoE experts, refused in one line."""
    if settings.dora:
        raise ConvertError(f"{where}: DoRA on MoE experts has no PEFT form (peft's expert adapters refuse LoRA "
                           f"variants): leave experts out of lora.targets or train without dora")
    if settings.rslora:
        raise ConvertError(f"{where}: rslora on MoE experts does not load in PEFT as trained (peft fuses gate and up "
                           f"into one adapter of rank 2r and alpha 2 alpha, which rslora scales by sqrt(2) more): "
                           f"leave experts out of lora.targets or train without rslora")


def to_peft(rows: list[Row], settings: LoraSettings, tensors: dict[str, torch.Tensor], where: str = "the adapter") \
        -> tuple[dict[str, torch.Tensor], list[str], bool]:
    """zoo adapter tensors (the contract's names) -> ``(PEFT tensors, HF module paths adapted, fan_in_fan_out)``.
    ``rows``: the architecture's key table (``{}`` filled in; MoE experts per expert). Every adapter tensor must
    belong to a row."""
    out: dict[str, torch.Tensor] = {}
    modules: list[str] = []
    conv1d = False
    used = set()
    for row in adapted_rows(rows, tensors):
        ka, kb, km = adapter_keys(row.zoo)
        if kb not in tensors:
            raise ConvertError(f"{where}: {ka} has no {kb}")
        if settings.dora and km not in tensors:
            raise ConvertError(f"{where}: lora.dora is set but {km} is missing")
        used.update(k for k in (ka, kb, km) if k in tensors)
        A, B = tensors[ka], tensors[kb]
        experts = A.dim() == 3
        if experts:
            refuse_expert_variants(settings, where)
        if A.shape[-2] != settings.r or B.shape[-1] != settings.r:
            raise ConvertError(f"{where}: {ka} {tuple(A.shape)} / {kb} {tuple(B.shape)} do not have rank r "
                               f"{settings.r} of config.json's lora")
        if is_embedding(row.zoo):
            if settings.dora:
                raise ConvertError(f"{where}: DoRA on the embedding is not written (PEFT's embedding magnitude is "
                                   f"per hidden unit, zoo's per output row): leave embedding out of lora.targets")
            (key,) = row.hf
            out[f"{PEFT_PREFIX}{hf_module(key)}.lora_embedding_A"] = B.t().contiguous()  # [r, V]
            out[f"{PEFT_PREFIX}{hf_module(key)}.lora_embedding_B"] = A.t().contiguous()  # [h, r]
            modules.append(hf_module(key))
            continue
        if experts and len(row.hf) == 1:  # transformers 5's fused experts, targeted as parameters (ParamWrapper)
            name = PEFT_PREFIX + fused_expert_module(row.hf[0])
            E, out_rows, r = B.shape
            out[f"{name}.lora_A.weight"] = A.reshape(E * r, A.shape[-1]).clone()  # [E r, in], expert-major
            out[f"{name}.lora_B.weight"] = B.permute(1, 2, 0).reshape(out_rows, r * E).contiguous()  # [out, r E]
            modules.append(row.hf[0])
            continue
        flags = _transposed(row, tuple(B.shape[:-1]))
        conv1d |= any(flags)
        bs = rows_to_hf(row, B, flags)
        ms = (tuple(m[:, 0] for m in rows_to_hf(row, tensors[km][:, None], flags)) if km in tensors
              else (None,) * len(row.hf))
        for key, b, m in zip(row.hf, bs, ms):
            name = PEFT_PREFIX + hf_module(key)
            # A is shared by every projection of a fused weight (per expert for experts)
            out[f"{name}.lora_A.weight"] = (A[expert_of(key)] if experts else A).clone()
            out[f"{name}.lora_B.weight"] = b
            if m is not None:
                out[f"{name}.lora_magnitude_vector"] = m.contiguous()
            modules.append(hf_module(key))
    stray = sorted(k for k in tensors if k not in used)
    if stray:
        raise ConvertError(f"{where}: adapter tensor(s) {stray[:3]} belong to no weight of the architecture's key "
                           f"table")
    return out, modules, conv1d


def target_modules(modules: list[str], rows: list[Row]) -> list[str]:
    """The shortest module-name suffixes that PEFT's matching (``name == t`` or ``name.endswith("." + t)``) finds in
    exactly ``modules`` among the table's HF modules (GPT-2's ``attn.c_proj`` where ``c_proj`` would take the MLP's
    too)."""
    every = {hf_module(k) for r in rows for k in r.hf}
    wanted = set(modules)
    chosen = set()
    for m in modules:
        parts = m.split(".")
        for n in range(1, len(parts) + 1):
            suffix = ".".join(parts[-n:])
            if suffix[0].isdigit():
                continue
            hits = {x for x in every if x == suffix or x.endswith("." + suffix)}
            if hits <= wanted:
                chosen.add(suffix)
                break
        else:
            chosen.add(m)
    return sorted(chosen)


def peft_config(settings: LoraSettings, targets: list[str], fan_in_fan_out: bool, base: str | None) -> dict:
    """adapter_config.json: the fields PEFT's ``LoraConfig`` reads, the rest at its defaults."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": settings.r,
            "lora_alpha": settings.alpha, "lora_dropout": settings.dropout, "use_rslora": settings.rslora,
            "use_dora": settings.dora, "target_modules": targets, "fan_in_fan_out": fan_in_fan_out, "bias": "none",
            "inference_mode": True, "init_lora_weights": True, "modules_to_save": None, "rank_pattern": {},
            "alpha_pattern": {}, "layers_to_transform": None, "layers_pattern": None, "target_parameters": None}


def write_peft_folder(out, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    """``adapter_model.safetensors`` + ``adapter_config.json`` (+ a README), published whole."""
    from safetensors.torch import save_file

    from zoo.convert import io

    final = Path(out)
    staging = io.staging_folder(final)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, staging / ADAPTER_WEIGHTS,
              metadata={"format": "pt"})
    (staging / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    (staging / "README.md").write_text(
        "---\nlibrary_name: peft\n---\n\nA LoRA adapter exported by zoo (`launch/convert.py zoo-to-peft`). Load it "
        "with `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), this_folder)`.\n")
    io.publish(staging, final)
    return final


def zoo_adapter_tensors(src: Path, files: dict[str, str]) -> dict[str, torch.Tensor]:
    """Every adapter tensor (``lora_`` in the name) of a zoo model folder."""
    from zoo.convert.reader import read_safetensors

    names = [k for k in files if ".lora_" in k or "_lora_" in k]
    by_file: dict[str, list[str]] = {}
    for k in names:
        by_file.setdefault(files[k], []).append(k)
    out = {}
    for fname, keys in by_file.items():
        out.update(read_safetensors(src / fname, keys))
    return out


def zoo_to_peft(src, out, *, base: str | None = None, dtype: torch.dtype | None = None) -> Path:
    """Write the adapter of the zoo model folder ``src`` (base + adapter tensors, ``"lora"`` in config.json) as an
    unmerged PEFT folder ``out`` for the HF architecture zoo-to-hf exports the base as. ``base``: written as
    ``base_model_name_or_path`` (the HF folder or Hub id the base is loaded from)."""
    from zoo.convert.gpt import export_architecture, read_zoo_gpt
    from zoo.convert.reader import zoo_weights

    src = Path(src)
    cfg = read_zoo_gpt(src, "PEFT adapters are written for the gpt family")
    settings = read_settings(src)
    if settings is None:
        raise ConvertError(f"{src / 'config.json'} has no \"lora\" settings: the folder holds no LoRA adapter (export "
                           f"one from a LoRA run, finetune.lora)")
    arch = export_architecture(cfg)
    rows = arch.rows(cfg, layout=peft_layout(arch))
    files, _ = zoo_weights(src)
    tensors = zoo_adapter_tensors(src, files)
    if not tensors:
        raise ConvertError(f"{src} has \"lora\" settings but no adapter tensors (<weight>.lora_A / .lora_B)")
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    return write_peft_folder(out, *peft_contents(rows, settings, tensors, base, str(src)))


def peft_layout(arch) -> str:
    """The expert layout of the key table whose HF names a PEFT folder of ``arch`` uses (``PER_EXPERT_PEFT``)."""
    from zoo.convert.hf.moe import FUSED, PER_EXPERT

    return PER_EXPERT if arch.name in PER_EXPERT_PEFT or not arch.extra.get("moe") else FUSED


def peft_contents(rows: list[Row], settings: LoraSettings, tensors: dict[str, torch.Tensor], base: str | None,
                  where: str) -> tuple[dict[str, torch.Tensor], dict]:
    """``(adapter_model tensors, adapter_config)`` of a zoo adapter. MoE experts go out one adapter per expert under
    the per-expert names transformers 4 had (``experts.{j}.w1`` / ``gate_proj`` ...), which peft (0.21) converts on
    load into transformers 5's fused experts (A's concatenated, B's block-diagonal: the same delta); peft finds
    those projections by their leaf names, so a dense module of the same leaf name (Qwen-MoE's dense layers, the
    shared expert) cannot be adapted beside them: refused."""
    peft_tensors, modules, conv1d = to_peft(rows, settings, tensors, where)
    fused = [m for m in modules if FUSED_EXPERTS.search(m)]
    expert_modules = [m for m in modules if expert_of(m + ".") is not None]
    targets = target_modules([m for m in modules if m not in expert_modules + fused], rows)
    dropout = settings.dropout
    parameters = None
    if fused:
        params = {m.rsplit(".", 1)[-1] for m in fused}
        if params != set(FUSED_PARAMS):
            raise ConvertError(f"{where}: only {sorted(params)} of the experts have adapters; zoo's experts target "
                               f"adapts both gate_up_proj and down_proj")
        parameters = [f"mlp.experts.{p}" for p in FUSED_PARAMS]
        dropout = 0.0  # peft's expert adapters refuse dropout; it only acts in training
    if expert_modules:
        leaves = {m.rsplit(".", 1)[1] for m in expert_modules}
        clash = sorted(m for m in modules if m not in expert_modules and m.rsplit(".", 1)[1] in leaves)
        if clash:
            raise ConvertError(f"{where}: {clash[0]} has an adapter and the same name as the experts' projections, "
                               f"which peft maps to the fused experts on load: adapt either the experts or the "
                               f"dense MLPs (lora.targets)")
        targets = sorted(set(targets) | leaves)
        dropout = 0.0  # peft's expert adapters refuse dropout; it only acts in training
    settings = LoraSettings(settings.r, settings.alpha, dropout, settings.targets, settings.dora, settings.rslora)
    config = peft_config(settings, targets, conv1d, base)
    config["target_parameters"] = parameters
    return peft_tensors, config


# ---------------------------------------------------------------------------------------------------------------
# PEFT -> zoo
# ---------------------------------------------------------------------------------------------------------------


def read_peft_folder(folder) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(adapter_config.json, tensors)`` of a PEFT folder (safetensors only: a pickled adapter_model.bin is
    refused)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / ADAPTER_CONFIG).is_file():
        raise ConvertError(f"{folder} has no {ADAPTER_CONFIG}: pass a PEFT adapter folder")
    if not (folder / ADAPTER_WEIGHTS).is_file():
        raise ConvertError(f"{folder} has no {ADAPTER_WEIGHTS} (an adapter_model.bin is a pickle zoo does not load: "
                           f"re-save it with safetensors)")
    tensors = load_file(folder / ADAPTER_WEIGHTS)
    if not any(k.startswith(PEFT_PREFIX) for k in tensors):  # saved by transformers' own adapter API: no prefix
        tensors = {PEFT_PREFIX + k: v for k, v in tensors.items()}
    return json.loads((folder / ADAPTER_CONFIG).read_text()), tensors


def settings_of_peft(config: dict, where: str) -> LoraSettings:
    """zoo's settings for a PEFT LoRA config; what zoo's adapters cannot hold is refused in one line."""
    def need(ok, message):
        if not ok:
            raise ConvertError(f"{where}: {message}")

    need(config.get("peft_type", "LORA") == "LORA", f"peft_type {config.get('peft_type')!r}: zoo reads LoRA only")
    need(not config.get("rank_pattern") and not config.get("alpha_pattern"),
         "rank_pattern / alpha_pattern give modules other ranks or alphas; zoo's adapters have one r and alpha")
    need(config.get("bias", "none") == "none" and not config.get("lora_bias"),
         f"bias {config.get('bias')!r} / lora_bias: zoo's adapters train no biases")
    need(not config.get("modules_to_save"), f"modules_to_save {config.get('modules_to_save')} (fully trained "
                                            f"modules) is not an adapter zoo holds")
    need(config.get("layers_to_transform") is None, "layers_to_transform: zoo adapts every layer of a target")
    return LoraSettings(r=int(config["r"]), alpha=float(config.get("lora_alpha", 8)),
                        dropout=float(config.get("lora_dropout", 0.0)), dora=bool(config.get("use_dora")),
                        rslora=bool(config.get("use_rslora")))


def from_peft(rows: list[Row], config: dict, tensors: dict[str, torch.Tensor], where: str = "the adapter") \
        -> tuple[LoraSettings, dict[str, torch.Tensor]]:
    """A PEFT adapter (its config and tensors) -> ``(zoo settings, zoo adapter tensors)``, the inverse of
    :func:`to_peft`."""
    settings = settings_of_peft(config, where)
    out: dict[str, torch.Tensor] = {}
    used = set()
    targets = []
    for row in rows:
        names = [PEFT_PREFIX + hf_module(k) for k in row.hf]
        ka, kb, km = adapter_keys(row.zoo)
        if is_embedding(row.zoo):
            (name,) = names
            if f"{name}.lora_embedding_A" not in tensors:
                continue
            pa, pb = tensors[f"{name}.lora_embedding_A"], tensors[f"{name}.lora_embedding_B"]
            used.update((f"{name}.lora_embedding_A", f"{name}.lora_embedding_B"))
            out[ka], out[kb] = pb.t().contiguous(), pa.t().contiguous()
            targets.append("embedding")
            continue
        if len(row.hf) == 1 and FUSED_EXPERTS.search(row.hf[0]):  # fused experts (ParamWrapper)
            name = PEFT_PREFIX + fused_expert_module(row.hf[0])
            if f"{name}.lora_A.weight" not in tensors:
                continue
            refuse_expert_variants(settings, where)
            pa, pb = tensors[f"{name}.lora_A.weight"], tensors[f"{name}.lora_B.weight"]
            r, E = settings.r, pa.shape[0] // settings.r
            out[ka] = pa.reshape(E, r, pa.shape[1]).clone()
            out[kb] = pb.reshape(pb.shape[0], r, E).permute(2, 0, 1).contiguous()  # [E, out, r]
            used.update((f"{name}.lora_A.weight", f"{name}.lora_B.weight"))
            targets.append("experts")
            continue
        present = [f"{n}.lora_A.weight" in tensors for n in names]
        if not any(present):
            continue
        if not all(present):
            missing = [n[len(PEFT_PREFIX):] for n, p in zip(names, present) if not p]
            raise ConvertError(f"{where}: {', '.join(missing[:4])} have no adapter while the other projections of "
                               f"zoo's {row.zoo} do; zoo adapts the fused weight whole: adapt all of them or none")
        groups: dict = {}  # the projections sharing zoo's one A: all of a dense weight's, one expert's
        for n in names:
            groups.setdefault(expert_of(n + "."), []).append(n)
        for group in groups.values():
            As = [tensors[f"{n}.lora_A.weight"] for n in group]
            if any(not torch.equal(a, As[0]) for a in As[1:]):
                raise ConvertError(f"{where}: {', '.join(n[len(PEFT_PREFIX):] for n in group)} have different "
                                   f"lora_A weights; zoo's {row.zoo} has one A for all of them (an adapter trained "
                                   f"by zoo shares it), so this adapter has no zoo form")
        experts = None not in groups
        if experts:
            refuse_expert_variants(settings, where)
        heads = [tensors[f"{g[0]}.lora_A.weight"] for g in groups.values()]
        Bs = [tensors[f"{n}.lora_B.weight"] for n in names]
        if any(a.shape[0] != settings.r for a in heads) or any(b.shape[1] != settings.r for b in Bs):
            raise ConvertError(f"{where}: {names[0][len(PEFT_PREFIX):]} has rank {heads[0].shape[0]}, "
                               f"adapter_config.json's r is {settings.r}")
        per_group = sum(tensors[f"{n}.lora_B.weight"].shape[0] for n in next(iter(groups.values())))
        flags = _transposed(row, (len(groups), per_group) if experts else (per_group,))
        out[ka] = torch.stack(heads) if experts else heads[0].clone()
        out[kb] = rows_to_zoo(row, Bs, flags)
        mags = [f"{n}.lora_magnitude_vector" for n in names]
        if settings.dora:
            if not all(m in tensors for m in mags):
                raise ConvertError(f"{where}: use_dora is set but {mags[0]} is missing")
            out[km] = rows_to_zoo(row, [tensors[m][:, None] for m in mags], flags)[:, 0].contiguous()
        used.update(f"{n}.lora_{x}.weight" for n in names for x in "AB")
        used.update(m for m in mags if m in tensors)
        targets.append(target_of(row.zoo))
    # peft saves an adapted embedding's base weight too (save_embedding_layers): the base's, not the adapter's
    stray = sorted(k for k in tensors if k not in used and not k.endswith(".base_layer.weight"))
    if stray:
        raise ConvertError(f"{where}: tensor(s) {stray[:3]} name no module zoo's table for this architecture has an "
                           f"adapter form for")
    if not out:
        raise ConvertError(f"{where}: no adapter tensor matches the base model's modules")
    ordered = tuple(t for t in TARGETS if t in targets)
    return LoraSettings(settings.r, settings.alpha, settings.dropout, ordered, settings.dora, settings.rslora), out


def read_adapter(adapter, cfg, arch=None) -> tuple[LoraSettings, dict[str, torch.Tensor]]:
    """The zoo adapter (settings, tensors in the contract's names, whole) of ``adapter`` for the zoo GPT ``cfg``:
    a PEFT folder (read through ``arch``'s key table, default the class zoo-to-hf exports ``cfg`` as) or a zoo model
    folder with adapter tensors. What ``launch/finetune.py --adapter DIR`` loads before training continues."""
    from zoo.convert import io
    from zoo.convert.gpt import export_architecture
    from zoo.convert.reader import zoo_weights
    from zoo.convert.registry import ARCHITECTURES

    adapter = Path(adapter)
    if io.is_model_folder(adapter):
        settings = read_settings(adapter)
        if settings is None:
            raise ConvertError(f"{adapter / 'config.json'} has no \"lora\" settings: the folder holds no adapter")
        files, _ = zoo_weights(adapter)
        return settings, zoo_adapter_tensors(adapter, files)
    config, tensors = read_peft_folder(adapter)
    arch = export_architecture(cfg) if arch is None else (ARCHITECTURES[arch] if isinstance(arch, str) else arch)
    return from_peft(arch.rows(cfg, layout=peft_layout(arch)), config, tensors, str(adapter))


# ---------------------------------------------------------------------------------------------------------------
# Merging
# ---------------------------------------------------------------------------------------------------------------


def merged_weight(W: torch.Tensor, A: torch.Tensor, B: torch.Tensor, settings: LoraSettings,
                  magnitude: torch.Tensor | None = None) -> torch.Tensor:
    """``W + s B A`` (DoRA: ``m / ||W + s B A|| * (W + s B A)``, the norm per row), in PEFT's order of operations:
    the delta computed in fp32 and cast to W's dtype, then added."""
    delta = ((B.float() @ A.float()) * settings.scale).to(W.dtype)
    merged = W + delta
    if magnitude is not None:
        norm = torch.linalg.norm(merged, dim=1).to(merged.dtype)
        merged = (magnitude.to(merged.dtype) / norm).view(-1, 1) * merged
    return merged


def merged_tensors(src: Path, settings: LoraSettings, adapter: dict[str, torch.Tensor]):
    """Every base tensor of the zoo folder ``src`` (its own adapter tensors left out), with ``adapter`` merged into
    the weights it adapts; one tensor in memory at a time besides the adapter."""
    from zoo.convert import io

    done = set()
    for name, t in io.iter_tensors(src):
        if ".lora_" in name or "_lora_" in name:
            continue
        ka, kb, km = adapter_keys(name)
        if ka in adapter:
            m = adapter.get(km) if settings.dora else None
            if t.dim() == 3:  # MoE experts [E, out, in]: one adapter per expert
                t = torch.stack([merged_weight(t[e], adapter[ka][e], adapter[kb][e], settings,
                                               None if m is None else m[e]) for e in range(t.shape[0])])
            else:
                t = merged_weight(t, adapter[ka], adapter[kb], settings, m)
            done.add(ka)
        yield name, t
    missing = sorted(k for k in adapter if k.endswith("lora_A") and k not in done)
    if missing:
        raise ConvertError(f"adapter tensor(s) {missing[:3]} adapt no weight of the base model")


def _base_with_adapter(base, adapter, tmp_base: Path, what: str, allow_pickle: bool):
    """``(zoo base folder, its GPTConfig, adapter settings, adapter tensors)``: ``base`` itself when it is a zoo
    folder, else its import into ``tmp_base`` (the caller removes it); the adapter read through the base's HF class
    where the base is an HF folder (``what``: the refusal's words for a base of another family)."""
    from zoo.convert import io
    from zoo.convert.gpt import hf_to_zoo, read_zoo_gpt
    from zoo.convert.hub import resolve_hf_folder
    from zoo.convert.registry import architecture_of_folder

    arch = None
    if io.is_model_folder(base):
        zoo_base = Path(base)
    else:
        folder = resolve_hf_folder(base, allow_pickle=allow_pickle)
        arch = architecture_of_folder(folder)
        zoo_base = hf_to_zoo(folder, tmp_base, allow_pickle=allow_pickle)
    cfg = read_zoo_gpt(zoo_base, what)
    return (zoo_base, cfg, *read_adapter(adapter, cfg, arch))


def merge_adapter(base, adapter, out, *, dtype: torch.dtype | None = None, allow_pickle: bool = False) -> Path:
    """A full HF folder ``out`` (weights, config, tokenizer, generation config) of the base model (an HF folder or
    Hub id, or a zoo folder) with the adapter (a PEFT folder, or a zoo folder holding adapter tensors) merged in:
    ``W + s B A`` (DoRA: scaled by ``m / ||W + s B A||``), computed in zoo's layout and exported through the key
    table. An HF base is imported to a temporary zoo folder beside ``out`` first (and removed)."""
    from zoo.convert import io
    from zoo.convert.gpt import zoo_to_hf
    from zoo.convert.writer import GENERATION_CONFIG

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_base, tmp_merged = out.parent / f".{out.name}.base-zoo", out.parent / f".{out.name}.merged-zoo"
    try:
        zoo_base, cfg, settings, tensors = _base_with_adapter(base, adapter, tmp_base,
                                                              "merge-adapter merges into gpt models", allow_pickle)
        gen = zoo_base / GENERATION_CONFIG
        io.write_model_folder(tmp_merged, FAMILY, cfg.to_dict(), merged_tensors(zoo_base, settings, tensors),
                              tokenizer_dir=zoo_base,
                              extra_files={GENERATION_CONFIG: gen.read_bytes()} if gen.is_file() else None)
        return zoo_to_hf(tmp_merged, out, dtype=dtype)
    finally:
        shutil.rmtree(tmp_base, ignore_errors=True)
        shutil.rmtree(tmp_merged, ignore_errors=True)


def adapter_for_init(adapter, init, cfg) -> tuple[LoraSettings, dict[str, torch.Tensor]]:
    """:func:`read_adapter` for ``launch/finetune.py --init INIT --adapter ADAPTER``: a PEFT folder is read through
    the key table of INIT's HF class when INIT is an HF folder (else the class zoo-to-hf exports ``cfg`` as)."""
    from zoo.convert import io
    from zoo.convert.registry import hf_architecture

    arch = None if io.is_model_folder(init) or not Path(init).is_dir() else hf_architecture(init)
    return read_adapter(adapter, cfg, arch)


def write_adapter_folder(base, adapter, out, *, allow_pickle: bool = False) -> Path:
    """A zoo model folder ``out``: the base (zoo folder, or HF folder / Hub id imported) with the adapter's tensors
    (a PEFT folder's, read back into zoo's names) beside its weights and ``"lora"`` in config.json."""
    from zoo.convert import io
    from zoo.convert.writer import GENERATION_CONFIG

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_base = out.parent / f".{out.name}.base-zoo"
    try:
        zoo_base, cfg, settings, tensors = _base_with_adapter(base, adapter, tmp_base,
                                                              "adapters are read for gpt models", allow_pickle)
        base_tensors = ((k, t) for k, t in io.iter_tensors(zoo_base) if ".lora_" not in k and "_lora_" not in k)
        gen = zoo_base / GENERATION_CONFIG
        staging = io.write_model_folder(
            out.parent / f".{out.name}.staged", FAMILY, cfg.to_dict(), (*base_tensors, *tensors.items()),
            tokenizer_dir=zoo_base, extra_files={GENERATION_CONFIG: gen.read_bytes()} if gen.is_file() else None)
        meta = json.loads((staging / "config.json").read_text())
        meta["lora"] = settings.to_dict()
        (staging / "config.json").write_text(json.dumps(meta, indent=2))
        io.publish(staging, out)
        return out
    finally:
        shutil.rmtree(tmp_base, ignore_errors=True)

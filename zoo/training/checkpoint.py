"""Training checkpoints: DeepSpeed's files, written so a crash never damages the last good one, resumed exactly.

Layout of ``<out>/checkpoints``::

    latest                      the tag of the newest complete checkpoint (DeepSpeed's own convention)
    step_00000010/              DeepSpeed's files (model, optimizer, LR schedule) + zoo.json (step, layout, config)
    step_00000010/ema/          with training.ema_decay: the weight average as a layout-free model folder
    step_00000010_universal/    made on demand when a run resumes in another layout (DeepSpeed universal checkpoint)

Atomic saves: DeepSpeed writes into ``<tag>.partial``; once every rank has finished, rank 0 adds ``zoo.json``,
renames the folder to ``<tag>`` and only then replaces ``latest`` (write to a temporary file, ``os.replace``). A kill
at any moment leaves ``latest`` naming a complete checkpoint. A save that fails (disk full, a file size limit,
permissions) on any rank removes its partial folder and stops the run on every rank with one line (``SaveError``);
the previous checkpoints are untouched.

Integrity: before ``latest`` moves, every checkpoint gets ``manifest.json``, each file's size and BLAKE2b-128 hash
(the ranks hash the files between them). ``--load`` and auto-resume check it before any process group starts and
refuse a damaged checkpoint in one line naming the file; auto-resume then takes the newest intact one and says so.
A checkpoint without a manifest (an older zoo, or another tool) loads only with ``--allow-no-manifest``:
DeepSpeed's files are pickles, so ``--load`` is for checkpoints of your own runs.

Exact resume: besides what DeepSpeed stores, each model-parallel rank stores its RNG states (Python, NumPy, torch
CPU and accelerator, and the tensor-parallel dropout tracker) in ``client_state``; the data order is a pure function
of the step (``zoo.data``), so the step number is the data position. Loaded into the same layout, the remaining
steps repeat the uninterrupted run bit for bit. DeepSpeed writes the client state once per data-parallel group
(dp x cp), and the CP ranks of a replica draw from other streams (``zoo.parallel.random``), so with context
parallelism the states of all CP ranks are stored (``rng_by_cp_rank``) and each rank restores its own.

Another layout (tp, pp or, with ZeRO, dp x cp changed): the checkpoint is converted once with DeepSpeed's
``ds_to_universal`` (rank 0, cached beside it) and loaded with ``checkpoint.load_universal``. DeepSpeed needs to
know how each parameter is split; :func:`universal_checkpoint_info` gives that as name patterns. RNG states are
per-rank and cannot be carried to a different set of ranks; they are re-seeded from the step instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from zoo.parallel.shards import barrier, gather_objects, global_rank

CHECKPOINTS = "checkpoints"
LATEST = "latest"
META = "zoo.json"
MANIFEST = "manifest.json"
UNIVERSAL_SUFFIX = "_universal"
EMA_FOLDER = "ema"  # the weight average (zoo.training.ema): a model folder, read in any layout
HASH_CHUNK_BYTES = 16 * 1024**2


class ResumeError(ValueError):
    """A checkpoint that cannot be resumed here; the message names the folder and what to do."""


class SaveError(RuntimeError):
    """A checkpoint that could not be written (every rank raises it); the message is one line."""


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def checkpoint_root(path: str | os.PathLike) -> Path:
    """``--load`` accepts a run folder (``<out>``) or its ``checkpoints`` folder."""
    path = Path(path)
    return path / CHECKPOINTS if (path / CHECKPOINTS).is_dir() else path


def read_latest(root: Path) -> str | None:
    try:
        tag = (root / LATEST).read_text().strip()
    except OSError:
        return None
    return tag or None


@dataclass
class Found:
    root: Path
    tag: str
    meta: dict

    @property
    def step(self) -> int:
        return self.meta["step"]


def file_digest(path: Path) -> str:
    import hashlib

    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(folder: Path) -> None:
    """Collective: every rank hashes its share of ``folder``'s files; global rank 0 writes the manifest."""
    import torch.distributed as dist

    files = _files(folder) if global_rank() == 0 else None
    if dist.is_initialized():
        box = [files]
        dist.broadcast_object_list(box, src=0)
        files = box[0]
    world = dist.get_world_size() if dist.is_initialized() else 1
    mine = {f: {"bytes": (folder / f).stat().st_size, "blake2b": file_digest(folder / f)}
            for f in files[global_rank()::world]}
    entries = {}
    for part in gather_objects(mine):
        entries.update(part)
    if global_rank() == 0:
        _write_atomic(folder / MANIFEST, json.dumps({"hash": "blake2b-128", "files": dict(sorted(entries.items()))},
                                                     indent=1))


def damage(folder: Path, hashes: bool = True) -> str | None:
    """What is wrong with the checkpoint ``folder`` against its manifest (None: intact, or no manifest); with
    ``hashes`` false, only the files' presence and sizes are checked."""
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return None
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError):
        return f"its {MANIFEST} is unreadable"
    for name, want in files.items():  # sizes first: a truncated file is found without reading anything
        path = folder / name
        if not path.is_file():
            return f"file {name} is missing"
        if path.stat().st_size != want["bytes"]:
            return f"file {name} has {path.stat().st_size} bytes, the manifest says {want['bytes']} (truncated?)"
    for name, want in files.items() if hashes else ():
        if file_digest(folder / name) != want["blake2b"]:
            return f"file {name} does not match its hash in {MANIFEST} (damaged)"
    return None


def find_checkpoint(load: str | os.PathLike, step: int | None = None, *, verify: bool = True,
                    allow_no_manifest: bool = False) -> Found:
    """The checkpoint ``--load DIR [--load-step N]`` names, with its metadata; one-line errors otherwise (also when
    ``verify`` finds it damaged or, unless ``allow_no_manifest``, without a manifest)."""
    load = Path(load)
    if not load.exists():
        raise ResumeError(f"--load {load}: the folder does not exist")
    root = checkpoint_root(load)
    if step is None:
        tag = read_latest(root)
        if tag is None:
            raise ResumeError(f"--load {load}: no checkpoint there (no {root / LATEST}); pass the --out folder of a "
                              f"run that saved one (--save-interval), or drop --load to start fresh")
    else:
        tag = tag_for(step)
    meta_path = root / tag / META
    if not meta_path.is_file():
        have = sorted(p.name for p in root.glob("step_*") if (p / META).is_file())
        what = f"step {step}" if step is not None else f"'{tag}' (named by {root / LATEST})"
        raise ResumeError(f"--load {load}: checkpoint {what} is missing or incomplete; complete ones: "
                          f"{', '.join(have) if have else 'none'}")
    if verify:
        if not allow_no_manifest and not (root / tag / MANIFEST).is_file():
            raise ResumeError(f"--load {load}: checkpoint {root / tag} has no {MANIFEST}, so its files cannot be "
                              f"checked (DeepSpeed's files are pickles: load only checkpoints of your own runs); "
                              f"add --allow-no-manifest to load it anyway")
        problem = damage(root / tag)
        if problem:
            raise ResumeError(f"--load {load}: checkpoint {root / tag} is damaged: {problem}; load another step "
                              f"(--load-step) or re-copy it")
    return Found(root, tag, json.loads(meta_path.read_text()))


def find_intact(out: str | os.PathLike, warn=None) -> Found | None:
    """Auto-resume: the newest complete checkpoint of ``out`` that its manifest finds intact (None: none saved);
    ``warn(line)`` hears about each damaged one passed over. All damaged: a ResumeError."""
    root = checkpoint_root(out)
    steps = sorted((p.name for p in root.glob("step_????????") if (p / META).is_file()), reverse=True)
    latest = read_latest(root)
    order = ([latest] if latest in steps else []) + [t for t in steps if t != latest]
    passed = []
    for tag in order:
        problem = damage(root / tag) if (root / tag / MANIFEST).is_file() else f"it has no {MANIFEST}"
        if problem is None:
            if passed and warn is not None:
                warn(f"warning: resuming from {root / tag}; passed over {'; '.join(passed)}")
            return Found(root, tag, json.loads((root / tag / META).read_text()))
        passed.append(f"{tag} ({problem})")
    if passed:
        raise ResumeError(f"no intact checkpoint in {root}: {'; '.join(passed)}; pass --load with "
                          f"--allow-no-manifest to use one anyway, or another --out to start fresh")
    return None


def universal_checkpoint_info(model_cfg) -> dict:
    """How each GPT parameter is split over TP, as the patterns DeepSpeed's universal checkpoint needs.

    Names are ``<layer_idx>.<param>`` (DeepSpeed matches with ``re.match``; every pattern must match something, so
    a pattern is listed only where the model has such a parameter). Column-parallel weights (QKV per key-value
    group, fc1, the untied head, OLMoE's q/k norm over the projection) are joined on dim 0 (the default),
    row-parallel weights on dim 1; SwiGLU's fc1 holds [gate; up] halves on every rank (two sub-parameters). An MoE
    layer's router, experts and shared experts are whole on every TP rank (replicated).
    """
    L = model_cfg.num_hidden_layers
    dense = any(not model_cfg.is_moe_layer(i) for i in range(L))
    moe = model_cfg.num_experts > 0
    placement = model_cfg.norm_placement  # "post": output norms only; "sandwich": both
    replicated = [rf"{L + 1}\.weight"]
    if placement != "post":
        replicated += [r"\d+\.input_norm\.", r"\d+\.post_attention_norm\."]
    if placement != "pre":
        replicated += [r"\d+\.attention_output_norm\.", r"\d+\.mlp_output_norm\."]
    if model_cfg.normalization == "layernorm":
        replicated.append(rf"{L + 1}\.bias")
    if model_cfg.add_bias:
        replicated.append(r"\d+\.attention\.dense\.bias")
    if model_cfg.use_mlp_bias and dense:
        replicated.append(r"\d+\.mlp\.fc2\.bias")
    if model_cfg.qk_norm == "head":
        replicated.append(r"\d+\.attention\.[qk]_norm\.weight")
    if moe:
        replicated += [r"\d+\.mlp\.router\.", r"\d+\.mlp\.experts\."]
        if model_cfg.num_shared_experts:
            replicated.append(r"\d+\.mlp\.shared_expert")  # the shared MLP and its gate
    if model_cfg.position_embedding_type == "learned":
        replicated.append(r"(tied_modules\.embed|0)\.position_embeddings\.weight")
    vocab = [r"(tied_modules\.embed|0)\.word_embeddings\.weight"]
    if not model_cfg.tie_word_embeddings:
        vocab.append(rf"{L + 2}\.linear\.weight")
    info = {
        "tp_replicated_parameter_patterns": replicated,
        "parameter_with_row_parallelism_patterns": [r"\d+\.attention\.dense\.weight"] +
                                                    ([r"\d+\.mlp\.fc2\.weight"] if dense else []),
        "vocabulary_parameter_patterns": vocab,
        "original_vocab_size": model_cfg.vocab_size,
    }
    if model_cfg.gated_mlp and dense:
        info["parameter_with_2_sub_params_cat_dim_0"] = [r"\d+\.mlp\.fc1\.weight"] + \
            ([r"\d+\.mlp\.fc1\.bias"] if model_cfg.use_mlp_bias else [])
    if model_cfg.tie_word_embeddings:
        info["pipeline_replicated_parameter_patterns"] = [r"tied_modules\.embed\."]
    return info


# ---------------------------------------------------------------------------------------------------------------
# RNG
# ---------------------------------------------------------------------------------------------------------------


def rng_state() -> dict:
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.activation_checkpointing.checkpointing import get_cuda_rng_tracker

    acc = get_accelerator()
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "accelerator": acc.get_rng_state() if acc.device_name() != "cpu" else None,
            "tracker": get_cuda_rng_tracker().get_states()}


def set_rng_state(state: dict) -> None:
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.activation_checkpointing.checkpointing import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("accelerator") is not None:
        get_accelerator().set_rng_state(state["accelerator"])
    get_cuda_rng_tracker().set_states(state["tracker"])


# ---------------------------------------------------------------------------------------------------------------
# Save and load
# ---------------------------------------------------------------------------------------------------------------


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _stop_if_any_failed(failure: BaseException | None, root: Path, partial: str, step: int) -> None:
    """Collective: if a write failed on any rank, every rank removes the partial folder (rank 0) and raises
    SaveError; the previous checkpoints stay as they are."""
    failures = [f for f in gather_objects(None if failure is None else f"{type(failure).__name__}: {failure}") if f]
    if not failures:
        return
    if global_rank() == 0:
        shutil.rmtree(root / partial, ignore_errors=True)
    barrier()
    last = read_latest(root)
    raise SaveError(f"the checkpoint of step {step} could not be written ({failures[0][:300]}): is the disk full, a "
                    f"file size limit set, {root} not writable? Nothing of it is left; the previous checkpoints are "
                    f"intact (newest: {root / last if last else 'none'}); fix that and the same command resumes"
                    + (f" from {last}" if last else ""))


def save_checkpoint(engine, root: Path, step: int, meta: dict, client_state: dict, keep_last: int | None = None,
                    cp_group=None, grid=None, ema=None) -> Path:
    """Collective: every rank calls it. Returns the checkpoint folder. ``cp_group``: the grid's CP group (or None);
    ``grid``: the run's grid, needed at ep > 1 (zoo writes the experts, :mod:`zoo.training.moe`); ``ema``: a
    collective ``ema(folder)`` that writes the run's weight average there (:mod:`zoo.training.ema`)."""
    from zoo.training import moe

    expert_parallel = grid is not None and grid.ep > 1
    tag = tag_for(step)
    rng = {"rng": rng_state()}
    if cp_group is not None:  # one file for the CP group: every CP rank's streams, in CP rank order
        rng["rng_by_cp_rank"] = gather_objects(rng["rng"], cp_group)
    partial = f"{tag}.partial"
    if global_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(root / partial, ignore_errors=True)  # left by a run killed while saving
    barrier()
    failure = None
    try:
        with moe.checkpoint_as_dense(engine) if expert_parallel else contextlib.nullcontext():
            engine.save_checkpoint(str(root), tag=partial, client_state={**client_state, **rng}, save_latest=False)
    except (OSError, RuntimeError) as e:  # disk full, a size limit, permissions (torch.save's writer raises
        failure = e  # RuntimeError); the ranks that wrote are in DeepSpeed's closing barrier
        barrier()
    _stop_if_any_failed(failure, root, partial, step)  # before the expert save's collectives: all ranks or none
    if expert_parallel:
        try:
            moe.save_expert_states(engine, grid, root / partial)  # its collectives come before its one write
        except OSError as e:
            failure = e
        _stop_if_any_failed(failure, root, partial, step)
    if ema is not None:
        try:
            ema(root / partial / EMA_FOLDER)
        except OSError as e:  # io.save_model raises on every rank alike when a write failed on one
            failure = e
        _stop_if_any_failed(failure, root, partial, step)
    barrier()
    if global_rank() == 0:
        try:
            _write_atomic(root / partial / META, json.dumps({**meta, "step": step}, indent=2))
        except OSError as e:
            failure = e
    _stop_if_any_failed(failure, root, partial, step)
    write_manifest(root / partial)
    if global_rank() == 0:
        final = root / tag
        if final.exists():  # saving the same step again (e.g. a resumed run): keep the old one until the swap
            old = root / f"{tag}.old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(root / partial, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(root / partial, final)
        shutil.rmtree(root / f"{tag}{UNIVERSAL_SUFFIX}", ignore_errors=True)  # stale if this step was re-saved
        _write_atomic(root / LATEST, tag)
        if keep_last and damage(final, hashes=False) is None:  # prune only behind a newer one that checks out
            steps = sorted(p for p in root.glob("step_????????") if (p / META).is_file())
            for old in steps[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
                shutil.rmtree(old.with_name(old.name + UNIVERSAL_SUFFIX), ignore_errors=True)
    barrier()
    return root / tag


def _converted(found: Found, out: Path) -> bool:
    """Whether ``out`` is a finished conversion of ``found`` (one of an earlier zoo could lack the experts of later
    pipeline stages: it is made again)."""
    from zoo.training import moe

    experts = [name for name in moe.expert_files(found.root / found.tag) if "/" not in name]
    return (out / META).is_file() and all((out / "zero" / name / "fp32.pt").is_file() for name in experts)


def to_universal(found: Found) -> str:
    """Convert ``found`` to a DeepSpeed universal checkpoint once (global rank 0; others wait); returns its tag."""
    tag = found.tag + UNIVERSAL_SUFFIX
    out = found.root / tag
    if global_rank() == 0 and not _converted(found, out):
        from zoo.compat.deepspeed import convert_to_universal
        from zoo.training import moe

        tmp = found.root / f"{tag}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        with moe.universal_without_experts(found.root / found.tag):
            convert_to_universal(found.root / found.tag, tmp)
        moe.patch_universal(found.root / found.tag, tmp)  # experts: whole (from zoo's files at ep > 1), cut by ep
        shutil.copy2(found.root / found.tag / META, tmp / META)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    barrier()
    return tag


def fit_padded_vectors(module, universal_folder: Path, grid) -> int:
    """Collective: give the 1-D vocabulary-padded parameters of a universal checkpoint (BERT's MLM decoder bias)
    this layout's padded length; returns how many this rank rewrote.

    DeepSpeed strips and re-adds vocabulary padding only for 2-D tensors (rows), so a bias padded to 1152 at tp 1
    cannot load at tp 2 (1280): its entries (``zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt``) are cut to the true
    vocabulary (the parameter's ``unpadded_size``) and padded with zeros to this layout's size. The padded columns
    take no part in the loss (``vocab_parallel_cross_entropy`` masks them), so the resumed run is the same. One rank
    per stage (tp, dp and cp rank 0) writes; the others wait."""
    import torch.nn.functional as F

    count = 0
    if grid.tp_rank == 0 and grid.dp_rank == 0 and grid.cp_rank == 0:
        for name, param in module.named_parameters():
            true_size = getattr(param, "unpadded_size", None)
            if true_size is None or param.dim() != 1:
                continue
            size = param.shape[0] * (grid.tp if getattr(param, "tensor_model_parallel", False) else 1)
            for key in ("fp32", "exp_avg", "exp_avg_sq"):
                path = universal_folder / "zero" / name / f"{key}.pt"
                entry = torch.load(path, weights_only=False)  # written by ds_to_universal from this run's files
                if entry["param"].shape[0] != size:
                    entry["param"] = F.pad(entry["param"][:true_size], (0, size - true_size))
                    torch.save(entry, path)
                    count += 1
    barrier()
    return count


def load_checkpoint(engine, found: Found, *, universal: bool, cp_rank: int = 0, grid=None) -> dict:
    """Load into the engine; restores RNG states when the layout is the same. Returns DeepSpeed's client state.

    ``cp_rank``: this rank's CP rank; it restores that rank's streams (none saved for it, e.g. a cp=1 checkpoint
    resumed at cp=2: it keeps the streams ``model_parallel_seed`` gave it). ``grid``: the run's grid, needed when
    the checkpoint or this run is expert-parallel."""
    from zoo.training import moe

    expert_parallel = grid is not None and grid.ep > 1
    tag = to_universal(found) if universal else found.tag
    if universal and grid is not None:
        fit_padded_vectors(engine.module, found.root / tag, grid)
    # No autograd: a pipeline's layer files end in DeepSpeed's in-place broadcast of the tied weights, which torch
    # would record and warn about at the next backward (zoo.models.specs.building_pipeline says why it is harmless).
    with moe.checkpoint_as_dense(engine) if expert_parallel else contextlib.nullcontext(), torch.no_grad():
        path, client_state = engine.load_checkpoint(str(found.root), tag=tag, load_optimizer_states=True,
                                                    load_lr_scheduler_states=True)
    if path is None:
        raise ResumeError(f"DeepSpeed found no checkpoint files in {found.root / tag}")
    if grid is not None and not universal:  # universal: the experts came whole with the rest
        moe.load_expert_states(engine, grid, found.root / found.tag)
    if not universal and client_state and "rng" in client_state:
        by_cp_rank = client_state.get("rng_by_cp_rank", [client_state["rng"]])
        if cp_rank < len(by_cp_rank):
            set_rng_state(by_cp_rank[cp_rank])
    return client_state or {}

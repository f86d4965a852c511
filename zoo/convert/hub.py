"""Finding an HF model folder and reading what it says it is, before any converter is chosen.

A local folder is used as is (the network is never touched); anything else that looks like a Hub id goes through
huggingface_hub's cache (``snapshot_download``; cache only when HF_HUB_OFFLINE is set). Only safetensors are
fetched unless pickles are allowed, and remote code is never run. ``config.json`` is read as plain JSON: which
class it names (transformers' ``architectures``, diffusers' ``_class_name``) picks the converter
(``zoo.convert.registry``).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from zoo.convert.errors import ConvertError

SAFE_INDEX, SAFE_SINGLE = "model.safetensors.index.json", "model.safetensors"
PICKLE_INDEX, PICKLE_SINGLE = "pytorch_model.bin.index.json", "pytorch_model.bin"
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def _offline() -> bool:
    from huggingface_hub import constants

    return constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def resolve_hf_folder(src: str | os.PathLike, *, allow_pickle: bool = False, cache_dir=None) -> Path:
    """A local HF model folder as is (the network is never touched); otherwise a Hub id through huggingface_hub's
    cache (``snapshot_download``; cache only when HF_HUB_OFFLINE is set)."""
    path = Path(src).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ConvertError(f"{src} is a file; pass the HuggingFace model folder (or a Hub id)")
    text = str(src)
    if not REPO_ID.fullmatch(text) or text.count("/") > 1:
        raise ConvertError(f"HF model folder {src} does not exist")
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"] + (["*.bin"] if allow_pickle else [])
    offline = _offline()
    try:
        return Path(snapshot_download(text, allow_patterns=patterns, local_files_only=offline, cache_dir=cache_dir))
    except Exception as e:  # huggingface_hub raises many kinds; the message is what matters
        if offline:
            raise ConvertError(f"HF model folder {src} does not exist, nor is it a model id in the local HF cache "
                               f"(HF_HUB_OFFLINE is set)") from None
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConvertError(f"HF model folder {src} does not exist, nor could it be fetched from the Hub: {reason}") \
            from None


def refuse_pickle_only(folder: Path) -> None:
    """``--init`` reads safetensors only (it has no --allow-pickle): a folder with nothing but a pickle checkpoint is
    refused in one line, naming the one-off conversion that can read it."""
    safe = any((folder / name).is_file() for name in (SAFE_INDEX, SAFE_SINGLE))
    if not safe and any((folder / name).is_file() for name in (PICKLE_INDEX, PICKLE_SINGLE)):
        raise ConvertError(f"{folder} holds only a pickle checkpoint ({PICKLE_SINGLE}), which can run code when "
                           f"loaded; --init reads safetensors only: convert it once with launch/convert.py hf-to-zoo "
                           f"--src {folder} --out DIR --allow-pickle (if you trust it) and pass --init DIR")


def read_hf_meta(folder: Path) -> dict:
    """The parsed ``config.json`` of a HF model folder; a missing or broken file, or a zoo folder, refused."""
    path = folder / "config.json"
    if not path.is_file():
        raise ConvertError(f"{folder} has no config.json; pass a HuggingFace model folder")
    try:
        meta = json.loads(path.read_text())
    except ValueError as e:
        raise ConvertError(f"{path} is not valid JSON ({e})") from None
    if "zoo_format" in meta:
        raise ConvertError(f"{folder} is a zoo model folder, not a HuggingFace one (use zoo-to-hf)")
    return meta


def json_dict(path) -> dict | None:
    """The JSON object in ``path``, or None where there is none (missing, unreadable, not an object)."""
    try:
        meta = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def transformers_folder(folder: Path) -> Path:
    """The folder holding config.json: ``folder`` itself, or the Transformer module of an old sentence-transformers
    folder (``modules.json`` naming e.g. ``0_Transformer/``)."""
    if (folder / "config.json").is_file() or not (folder / "modules.json").is_file():
        return folder
    try:
        modules = json.loads((folder / "modules.json").read_text())
    except ValueError as e:
        raise ConvertError(f"{folder / 'modules.json'} is not valid JSON ({e})") from None
    for m in modules:
        if str(m.get("type", "")).endswith(".Transformer") and (folder / m.get("path", "") / "config.json").is_file():
            return folder / m["path"]
    return folder


def class_name(meta: dict, model_types: dict[str, str]) -> str | None:
    """The HF class a transformers config.json names: ``architectures[0]``, else the class ``model_types`` gives its
    ``model_type``, else the model_type itself; None where it names neither."""
    archs = meta.get("architectures") or []
    if archs:
        return archs[0]
    kind = meta.get("model_type")
    return model_types.get(kind, kind) if kind else None


def diffusers_model(folder, default: str) -> tuple[str, Path] | None:
    """``(class name, config path)`` when ``folder`` is a diffusers model folder (its config.json names a
    ``_class_name``, which transformers' configs never do) or a diffusers pipeline folder (``model_index.json``, or
    no config.json but ``unet/config.json``): then the class of its ``unet/`` model, or, without one, the pipeline's
    own class (``default`` where ``unet/config.json`` names none, as diffusers' own reader takes the class asked for).
    None for anything else (a transformers folder, a zoo folder)."""
    folder = Path(folder)
    meta = json_dict(folder / "config.json")
    if meta is not None:
        if "_class_name" in meta and "zoo_format" not in meta:
            return str(meta["_class_name"]), folder / "config.json"
        return None
    unet = json_dict(folder / "unet" / "config.json")
    if unet is not None:
        return str(unet.get("_class_name", default)), folder / "unet" / "config.json"
    index = json_dict(folder / "model_index.json")
    if index is not None and "_class_name" in index:
        return str(index["_class_name"]), folder / "model_index.json"
    return None

"""Writing an HF folder from a zoo folder, streaming: the tensors of a key table (:func:`export_rows`, one
conversion group at a time through ``io.ShardedWriter``), and the files that travel beside them (the tokenizer,
``io.TOKENIZER_FILES``; the generation config). The caller adds its config.json and model card, then
``io.publish``-es the staging folder, so a crash never leaves a half-written folder under the final name.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open

from zoo.convert import io
from zoo.convert.reader import read_safetensors
from zoo.convert.tables import Row

GENERATION_CONFIG = "generation_config.json"
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def stored_dtype(src: Path, files: dict[str, str], key: str) -> torch.dtype:
    """The dtype ``key`` is stored in (fp32 for a dtype config.json has no name for)."""
    with safe_open(src / files[key], "pt") as f:
        name = f.get_slice(key).get_dtype()
    return {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}.get(name, torch.float32)


def export_rows(src: Path, out, groups: list[list[Row]], files: dict[str, str], dtype: torch.dtype | None, *,
                max_shard_bytes: int = io.DEFAULT_SHARD_BYTES) -> tuple[Path, torch.dtype]:
    """The HF tensors of ``groups`` (read from the zoo folder ``src``, one group at a time, each file mapped only
    while it is read) written by ``io.ShardedWriter`` into a fresh staging folder for ``out``, with the index.

    Returns ``(staging folder, dtype for config.json)``: ``dtype``, or when None (tensors kept as stored) that of
    the first row's tensor, the word embedding. The caller adds the config files and ``io.publish``-es it."""
    out_dtype = stored_dtype(src, files, groups[0][0].zoo) if dtype is None else dtype
    staging = io.staging_folder(Path(out))
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    writer = io.ShardedWriter(staging, prefix="model", max_shard_bytes=max_shard_bytes)
    for group in groups:
        by_file: dict[str, list[str]] = {}
        for row in group:
            by_file.setdefault(files[row.zoo], []).append(row.zoo)
        values = {}
        for fname, names in by_file.items():
            values.update(read_safetensors(src / fname, names))
        for row in group:
            for key, t in zip(row.hf, row.hf_tensors(values.pop(row.zoo))):
                writer.add(key, t if dtype is None else t.to(dtype))
    io.write_index(staging, writer.close(), writer.total_bytes)
    return staging, out_dtype


def generation_config_of(folder: Path, hf_cfg) -> str | bytes:
    """The special token ids and generation defaults to keep beside a zoo folder (zoo's config has no place for
    them): the HF folder's generation_config.json as is, or one derived from its config (as save_pretrained
    writes it)."""
    if (folder / GENERATION_CONFIG).is_file():
        return (folder / GENERATION_CONFIG).read_bytes()
    from transformers import GenerationConfig

    return GenerationConfig.from_model_config(hf_cfg).to_json_string(use_diff=True, keys_to_pop=["compile_config"])


def special_ids(zoo_folder: Path) -> dict:
    """The bos / eos / pad ids of the generation config kept beside a zoo folder (none without one)."""
    path = zoo_folder / GENERATION_CONFIG
    if not path.is_file():
        return {}
    meta = json.loads(path.read_text())
    return {k: meta.get(k) for k in SPECIAL_IDS}


def write_generation_config(src: Path, staging: Path, hf_cfg) -> None:
    """The zoo folder's generation config beside the exported weights, or one derived from the HF config."""
    if (src / GENERATION_CONFIG).is_file():
        shutil.copy2(src / GENERATION_CONFIG, staging / GENERATION_CONFIG)
    else:
        from transformers import GenerationConfig

        GenerationConfig.from_model_config(hf_cfg).save_pretrained(staging)


def finish(src: Path, staging: Path, final: Path, hf_cfg, card: str) -> Path:
    """Save ``hf_cfg`` (config.json) into ``staging``, copy the tokenizer, write the model card, publish."""
    hf_cfg.save_pretrained(staging)
    io.copy_tokenizer(src, staging)
    (staging / "README.md").write_text(card)
    io.publish(staging, final)
    return final

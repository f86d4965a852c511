"""Model conversion commands (``launch/convert.py``).

    python launch/convert.py hf-to-zoo --src openai-community/gpt2 --out models/gpt2 [--dtype bf16] [--allow-pickle]
    python launch/convert.py zoo-to-hf --src models/gpt2 --out hf/gpt2 [--dtype fp32]
    python launch/convert.py verify --hf openai-community/gpt2 --zoo models/gpt2
    python launch/convert.py verify --hf HF_FOLDER --zoo models/NAME --max-memory 2GB    # neither model whole in RAM
    torchrun --nproc_per_node 4 launch/convert.py verify --hf HF --zoo models/gpt2 --tp 2 --pp 2
    python launch/convert.py zoo-to-hf --src models/mixtral --out hf/mixtral [--fused-experts]
    torchrun --nproc_per_node 4 launch/convert.py verify --hf HF_MIXTRAL --zoo models/mixtral --tp 2 --ep 2
    python launch/convert.py hf-to-zoo --src DDPM_PIPELINE_FOLDER --out models/ddpm   # diffusers: its unet/
    python launch/convert.py zoo-to-peft --src models/llama-lora --out hf/llama-lora-adapter [--base HF_BASE]
    python launch/convert.py zoo-to-hf --src models/llama-lora --out hf/llama --adapter-out hf/llama-lora-adapter
    python launch/convert.py merge-adapter --base HF_OR_ZOO_BASE --adapter PEFT_OR_ZOO_FOLDER --out hf/llama-merged
    python launch/convert.py peft-to-zoo --base HF_OR_ZOO_BASE --adapter PEFT_FOLDER --out models/llama-lora

hf-to-zoo picks the adapter by the architecture in config.json (``zoo.convert.registry.ARCHITECTURES``, one file
each in ``zoo/convert/hf/``): GPT2LMHeadModel, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM and the
mixture-of-experts MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM, OlmoeForCausalLM (family gpt,
experts stored one tensor per expert or fused; zoo-to-hf writes one per expert unless ``--fused-experts``);
BertModel, BertForMaskedLM, BertForPreTraining, BertForSequenceClassification (families bert and bert-classifier);
a diffusers folder (config.json with ``_class_name``, or a pipeline folder with the model in ``unet/``) by that
class: UNet2DModel (family unet-diffusion). zoo-to-hf and verify pick the family's converter by the zoo folder's
family (``zoo.convert.registry.FAMILIES``). A zoo GPT folder holding a LoRA / DoRA adapter (``"lora"`` in config.json,
``<weight>.lora_A`` / ``.lora_B`` tensors) goes out as an unmerged PEFT folder (zoo-to-peft, or zoo-to-hf's
``--adapter-out`` beside the base), or merged into a full HF folder (merge-adapter, which also takes a PEFT folder and
an HF base): ``zoo.convert.peft``. verify compares logits (GPT; BERT's heads), for a BERT without head the
last hidden state, for a UNet2DModel the predicted noise.

``--src``/``--hf`` take a local HuggingFace folder (the network is never touched) or a Hub id, resolved through
huggingface_hub's cache (cache only when HF_HUB_OFFLINE=1). Only safetensors are read unless ``--allow-pickle``
(diffusers folders: safetensors only); remote code is never run. Bad input prints one line ``error: ...`` and exits
2; verify prints ``max_abs_diff=<float>`` as its last line (for MoE GPTs after ``router_topk_agreement=<float>``, the
fraction of the routers' top-k choices zoo and transformers share) and exits 1 when that exceeds ``--tol``.
``--max-memory SIZE`` (GPT, BERT; pp 1) checks without either model whole in memory: zoo's side runs one layer at a
time, transformers' side loads through accelerate's big-model path (``zoo.convert.verify.hf_loading``), and the
embedding and LM head read their rows from disk as they need them; a line before the verdict says where accelerate
put the HF modules.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys

import torch

from zoo.convert import io
from zoo.convert.errors import ConvertError
from zoo.flags import Parser

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMG]?)I?B?", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'2GB', '500MB', '1.5G', '123456' -> bytes (powers of 1024)."""
    m = _SIZE.fullmatch(text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GB, 500MB)")
    return int(float(m.group(1)) * 1024 ** " KMG".index(m.group(2).upper() or " "))


def size_text(n: int) -> str:
    """Bytes as :func:`parse_size` reads them: 1024 -> '1KB', 2**31 -> '2GB'."""
    for power, unit in ((3, "GB"), (2, "MB"), (1, "KB")):
        if n >= 1024**power:
            return f"{n / 1024**power:.4g}{unit}"
    return f"{n}B"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="launch/convert.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("hf-to-zoo", help="HuggingFace (transformers or diffusers) folder or Hub id -> zoo model folder")
    p.add_argument("--src", required=True, help="HF model folder or Hub id")
    p.add_argument("--out", required=True, help="zoo model folder to write (replaced when complete)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast the weights (default: keep)")
    p.add_argument("--allow-pickle", action="store_true",
                   help="read pytorch_model.bin (torch.load weights_only) when there are no safetensors")
    p.add_argument("--max-shard-size", type=parse_size, default=io.DEFAULT_SHARD_BYTES, help="e.g. 2GB (default)")

    p = sub.add_parser("zoo-to-hf", help="zoo model folder -> HuggingFace folder")
    p.add_argument("--src", required=True, help="zoo model folder")
    p.add_argument("--out", required=True, help="HF model folder to write (replaced when complete)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast the weights (default: keep)")
    p.add_argument("--max-shard-size", type=parse_size, default=io.DEFAULT_SHARD_BYTES, help="e.g. 2GB (default)")
    p.add_argument("--fused-experts", action="store_true",
                   help="mixture-of-experts models: write each layer's experts as two fused tensors "
                        "(mlp.experts.gate_up_proj [E, 2I, h], down_proj [E, h, I]; transformers 5's "
                        "save_original_format=False) instead of one tensor per expert (its default)")

    p.add_argument("--adapter-out", default=None, metavar="DIR",
                   help="a folder with a LoRA adapter: also write it, unmerged, as a PEFT adapter folder DIR")

    p = sub.add_parser("zoo-to-peft", help="the LoRA / DoRA adapter of a zoo GPT folder -> unmerged PEFT folder")
    p.add_argument("--src", required=True, help="zoo model folder with adapter tensors and \"lora\" in config.json")
    p.add_argument("--out", required=True, help="PEFT adapter folder to write (replaced when complete)")
    p.add_argument("--base", default=None, help="HF folder or Hub id of the base, written as base_model_name_or_path")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast the adapter (default: keep)")

    p = sub.add_parser("peft-to-zoo", help="base + PEFT adapter folder -> zoo model folder with the adapter tensors")
    p.add_argument("--base", required=True, help="zoo model folder, or HF model folder or Hub id")
    p.add_argument("--adapter", required=True, help="PEFT adapter folder")
    p.add_argument("--out", required=True, help="zoo model folder to write (replaced when complete)")
    p.add_argument("--allow-pickle", action="store_true", help="an HF base with only pytorch_model.bin")

    p = sub.add_parser("merge-adapter", help="base + LoRA / DoRA adapter -> full HF folder with the adapter merged")
    p.add_argument("--base", required=True, help="HF model folder or Hub id, or zoo model folder")
    p.add_argument("--adapter", required=True, help="PEFT adapter folder, or zoo model folder with adapter tensors")
    p.add_argument("--out", required=True, help="HF model folder to write (replaced when complete)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast the weights (default: keep)")
    p.add_argument("--allow-pickle", action="store_true", help="an HF base with only pytorch_model.bin")

    p = sub.add_parser("verify", help="compare zoo's outputs at (tp, pp, ep) with transformers' (or diffusers')")
    p.add_argument("--hf", required=True, help="HF model folder or Hub id")
    p.add_argument("--zoo", required=True, help="zoo model folder")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1, help="expert parallelism (MoE GPTs): must divide the expert count "
                                                     "and world size / (tp x pp)")
    p.add_argument("--ep-spans-tp", action="store_true",
                   help="EP groups take in the TP ranks, as training's --ep-spans-tp: ep = tp x a divisor of "
                        "world size / (tp x pp)")
    p.add_argument("--tol", type=float, default=1e-4, help="largest accepted |difference|")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=16, help="sequence length (GPT, BERT; a U-Net's size is its config's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--allow-pickle", action="store_true")
    p.add_argument("--max-memory", type=parse_size, metavar="SIZE",
                   help="e.g. 2GB: check without either model whole in memory (GPT, BERT; pp 1): zoo's side runs one "
                        "layer at a time, transformers' side loads through accelerate (device_map, at most SIZE of "
                        "weights on the CPU, the rest offloaded to disk)")
    return parser


def _is_rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def error(message: str) -> int:
    if _is_rank0():
        print(f"error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    return 2


def _verify(args) -> int:
    from zoo.convert.verify import verify_report
    from zoo.parallel.topology import LayoutError, destroy_model_parallel

    try:
        report = verify_report(args.hf, args.zoo, args.tp, args.pp, ep=args.ep, batch=args.batch, seq=args.seq,
                               seed=args.seed, allow_pickle=args.allow_pickle, max_memory=args.max_memory,
                               ep_spans_tp=args.ep_spans_tp)
    except (ConvertError, LayoutError, io.CheckpointError) as e:
        return error(str(e))
    finally:
        destroy_model_parallel()
    diff = report.max_abs_diff
    if _is_rank0():
        ep = f" ep={args.ep}" + (" (spans tp)" if args.ep_spans_tp and args.tp > 1 else "") if args.ep != 1 else ""
        if report.hf_device_map is not None:
            print(f"hf modules (accelerate device_map, cpu <= {size_text(args.max_memory)}): "
                  f"{placement(report.hf_device_map)}; zoo: one layer at a time", flush=True)
        print(f"tp={args.tp} pp={args.pp}{ep} tol={args.tol:g} {'ok' if diff <= args.tol else 'FAILED'}", flush=True)
        if report.router_topk_agreement is not None:
            print(f"router_topk_agreement={report.router_topk_agreement:.4f}", flush=True)
        print(f"max_abs_diff={diff:.3e}", flush=True)
    return 0 if diff <= args.tol else 1


def placement(device_map: dict) -> str:
    """``"cpu 3, disk 14"``: how many of accelerate's device-map entries went where."""
    counts: dict = {}
    for device in device_map.values():
        counts[str(device)] = counts.get(str(device), 0) + 1
    return ", ".join(f"{device} {n}" for device, n in sorted(counts.items())) or "none"


class _Stdout(logging.Handler):
    """The converters' log lines (what was dropped or ignored) on stdout, beside "wrote ..."; errors stay alone on
    stderr. ``print`` finds the current stdout at each call."""

    def emit(self, record):
        print(self.format(record), flush=True)


def _log_to_stdout() -> None:
    logger = logging.getLogger("zoo.convert")
    if not any(isinstance(h, _Stdout) for h in logger.handlers):
        logger.addHandler(_Stdout())
    logger.setLevel(logging.INFO)


def hf_to_zoo(src, out, *, dtype=None, allow_pickle: bool = False, max_shard_bytes: int = io.DEFAULT_SHARD_BYTES):
    """The converter of the family that ``src``'s architecture (config.json's ``architectures`` or ``model_type``;
    diffusers' ``_class_name``, also a pipeline folder's ``unet/``) imports into converts it."""
    from zoo.convert.hub import resolve_hf_folder
    from zoo.convert.registry import FAMILIES, architecture_of_folder

    folder = resolve_hf_folder(src, allow_pickle=allow_pickle)
    arch = architecture_of_folder(folder)
    return FAMILIES[arch.family].import_hf(folder, out, dtype=dtype, allow_pickle=allow_pickle,
                                           max_shard_bytes=max_shard_bytes)


def zoo_to_hf(src, out, *, dtype=None, max_shard_bytes: int = io.DEFAULT_SHARD_BYTES, fused_experts: bool = False,
              adapter_out=None):
    """The converter of the zoo folder's family exports it (``fused_experts``: MoE GPTs only); ``adapter_out``: the
    folder's LoRA adapter written there too, as a PEFT folder whose ``base_model_name_or_path`` is ``out``."""
    from zoo.convert.registry import FAMILIES, convertible

    family = io.read_config(src)[0]
    converter = FAMILIES.get(family)
    if fused_experts and not getattr(converter, "expert_parallel", False):
        raise ConvertError(f"{src} holds a {family!r} model; --fused-experts is for mixture-of-experts GPTs")
    if converter is None:
        raise ConvertError(f"{src} holds a {family!r} model; zoo-to-hf exports the families "
                           f"{', '.join(convertible())}")
    from zoo.convert.peft import read_settings

    if adapter_out is not None and read_settings(src) is None:
        raise ConvertError(f"{src} holds no LoRA adapter (no \"lora\" in config.json); leave out --adapter-out")
    written = converter.export(src, out, dtype=dtype, max_shard_bytes=max_shard_bytes, fused_experts=fused_experts)
    if adapter_out is not None:
        from zoo.convert.peft import zoo_to_peft

        print(f"wrote {zoo_to_peft(src, adapter_out, base=str(out), dtype=dtype)}")
    elif read_settings(src) is not None:
        logging.getLogger("zoo.convert").info(
            "%s holds a LoRA adapter, not in this export (the base alone): add --adapter-out DIR for a PEFT folder, "
            "or use merge-adapter for merged weights", src)
    return written


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)  # an unknown flag: one line, exit status 2 (zoo.flags)
    dtype = DTYPES[args.dtype] if getattr(args, "dtype", None) else None
    _log_to_stdout()
    try:
        if args.command == "hf-to-zoo":
            out = hf_to_zoo(args.src, args.out, dtype=dtype, allow_pickle=args.allow_pickle,
                            max_shard_bytes=args.max_shard_size)
        elif args.command == "zoo-to-hf":
            out = zoo_to_hf(args.src, args.out, dtype=dtype, max_shard_bytes=args.max_shard_size,
                            fused_experts=args.fused_experts, adapter_out=args.adapter_out)
        elif args.command == "zoo-to-peft":
            from zoo.convert.peft import zoo_to_peft

            out = zoo_to_peft(args.src, args.out, base=args.base, dtype=dtype)
        elif args.command == "peft-to-zoo":
            from zoo.convert.peft import write_adapter_folder

            out = write_adapter_folder(args.base, args.adapter, args.out, allow_pickle=args.allow_pickle)
        elif args.command == "merge-adapter":
            from zoo.convert.peft import merge_adapter

            out = merge_adapter(args.base, args.adapter, args.out, dtype=dtype, allow_pickle=args.allow_pickle)
        else:
            return _verify(args)
    except (ConvertError, io.CheckpointError) as e:
        return error(str(e))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

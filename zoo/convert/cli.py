"""Model conversion commands (``launch/convert.py``).

    python launch/convert.py hf-to-zoo --src openai-community/gpt2 --out models/gpt2 [--dtype bf16] [--allow-pickle]
    python launch/convert.py zoo-to-hf --src models/gpt2 --out hf/gpt2 [--dtype fp32]
    python launch/convert.py verify --hf openai-community/gpt2 --zoo models/gpt2
    torchrun --nproc_per_node 4 launch/convert.py verify --hf HF --zoo models/gpt2 --tp 2 --pp 2

``--src``/``--hf`` take a local HuggingFace folder (the network is never touched) or a Hub id, resolved through
huggingface_hub's cache (cache only when HF_HUB_OFFLINE=1). Only safetensors are read unless ``--allow-pickle``;
remote code is never run. Bad input prints one line ``error: ...`` and exits 2; verify prints
``max_abs_diff=<float>`` as its last line and exits 1 when that exceeds ``--tol``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from zoo.convert import io
from zoo.convert.hf_gpt import DTYPES, ConvertError

_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMG]?)I?B?", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'2GB', '500MB', '1.5G', '123456' -> bytes (powers of 1024)."""
    m = _SIZE.fullmatch(text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GB, 500MB)")
    return int(float(m.group(1)) * 1024 ** " KMG".index(m.group(2).upper() or " "))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="launch/convert.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("hf-to-zoo", help="HuggingFace folder or Hub id -> zoo model folder")
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

    p = sub.add_parser("verify", help="compare zoo's logits at (tp, pp) with transformers'")
    p.add_argument("--hf", required=True, help="HF model folder or Hub id")
    p.add_argument("--zoo", required=True, help="zoo model folder")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--tol", type=float, default=1e-4, help="largest accepted |logit difference|")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--allow-pickle", action="store_true")
    return parser


def _is_rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def error(message: str) -> int:
    if _is_rank0():
        print(f"error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    return 2


def _verify(args) -> int:
    from zoo.convert.verify import verify
    from zoo.parallel.topology import LayoutError, destroy_model_parallel

    try:
        diff = verify(args.hf, args.zoo, args.tp, args.pp, batch=args.batch, seq=args.seq, seed=args.seed,
                      allow_pickle=args.allow_pickle)
    except (ConvertError, LayoutError, io.CheckpointError) as e:
        return error(str(e))
    finally:
        destroy_model_parallel()
    if _is_rank0():
        print(f"tp={args.tp} pp={args.pp} tol={args.tol:g} {'ok' if diff <= args.tol else 'FAILED'}", flush=True)
        print(f"max_abs_diff={diff:.3e}", flush=True)
    return 0 if diff <= args.tol else 1


def main(argv=None) -> int:
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:
        return error(f"unrecognized arguments: {' '.join(unknown)}")
    dtype = DTYPES[args.dtype] if getattr(args, "dtype", None) else None
    try:
        if args.command == "hf-to-zoo":
            from zoo.convert.hf_gpt import hf_to_zoo

            out = hf_to_zoo(args.src, args.out, dtype=dtype, allow_pickle=args.allow_pickle,
                            max_shard_bytes=args.max_shard_size)
        elif args.command == "zoo-to-hf":
            from zoo.convert.hf_gpt import zoo_to_hf

            out = zoo_to_hf(args.src, args.out, dtype=dtype, max_shard_bytes=args.max_shard_size)
        else:
            return _verify(args)
    except (ConvertError, io.CheckpointError) as e:
        return error(str(e))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

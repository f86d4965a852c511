"""Text generation from a zoo GPT folder on the command line: one process, or tp processes under torchrun.

    python launch/generate.py --ckpt runs/tiny/model --prompt "Once upon a time" --max-new-tokens 64
    torchrun --nproc_per_node 2 launch/generate.py --tp 2 --ckpt DIR --prompt "..." --temperature 0.8 --top-p 0.9

Everything about the input (folder, family, layout, tokenizer, prompts) is checked before any process group
exists; the folder is loaded at pp=1 into the plain model and decoded by ``zoo.models.generate.Generator`` (KV cache,
greedy or sampled, any tensor-parallel size). Global rank 0 prints the continuations, and the speed on stderr.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from zoo.models.generate import Generator, SamplingOptions
from zoo.models.specs import SpecSequential

DESCRIPTION = ("Text generation from a zoo GPT: a KV cache per block, greedy or sampled decoding, at any "
               "tensor-parallel size.")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="launch/generate.py", description=DESCRIPTION)
    p.add_argument("--ckpt", required=True,
                   help="a zoo model folder with tokenizer files, or a training run folder holding one as model/")
    p.add_argument("--prompt", action="append", required=True,
                   help="the text to continue; repeat for a batch (left-padded to the longest)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--greedy", action="store_true",
                   help="argmax decoding (the default when no sampling option is given)")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling: the smallest set reaching this mass")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (launch tp processes with torchrun)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    return p


def _say(rank: int, *args, **kwargs) -> None:
    if rank == 0:
        print(*args, **kwargs, flush=True)


def main(argv: list[str] | None = None) -> int:
    from zoo.convert.io import load_model, read_config, resolve_model_folder
    from zoo.data.tokenizer import load_tokenizer
    from zoo.models.gpt import GPTConfig, ParallelOptions, layer_specs
    from zoo.parallel.topology import destroy_model_parallel, initialize_model_parallel

    args = _parser().parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))

    # Everything that can be wrong with the input is checked before any process group or model exists.
    try:
        sampled = any(v is not None for v in (args.temperature, args.top_k, args.top_p))
        if args.greedy and sampled:
            raise ValueError("--greedy cannot be combined with --temperature/--top-k/--top-p")
        sampling = SamplingOptions(greedy=not sampled,
                                   temperature=1.0 if args.temperature is None else args.temperature,
                                   top_k=args.top_k or 0, top_p=1.0 if args.top_p is None else args.top_p,
                                   seed=args.seed)
        if args.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
        folder = resolve_model_folder(args.ckpt)
        family, config_dict = read_config(folder)
        if family != "gpt":
            raise ValueError(f"{folder} holds a {family!r} model; generation is for the 'gpt' family")
        config = GPTConfig.from_dict(config_dict)
        config.check_layout(args.tp)
        tokenizer = load_tokenizer(folder)
        prompts = [tokenizer(p)["input_ids"] for p in args.prompt]
        for text, ids in zip(args.prompt, prompts):
            if not ids:
                raise ValueError(f"prompt {text!r} encodes to no tokens")
            if len(ids) > config.max_position_embeddings:
                raise ValueError(f"prompt of {len(ids)} tokens is longer than the model's max_position_embeddings "
                                 f"({config.max_position_embeddings})")
            if max(ids) >= config.vocab_size:
                raise ValueError(f"the tokenizer in {folder} produced id {max(ids)}, outside the model's "
                                 f"vocab_size {config.vocab_size}")
    except (ValueError, OSError) as e:  # CheckpointError and LayoutError are ValueErrors
        _say(rank, f"error: {e}", file=sys.stderr)
        return 2

    eos = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos if eos is not None else 0)
    longest = max(len(ids) for ids in prompts)
    room = config.max_position_embeddings - longest + 1
    if args.max_new_tokens > room:
        _say(rank, f"note: at most {room} new tokens fit in max_position_embeddings {config.max_position_embeddings} "
                   f"after a prompt of {longest} tokens", file=sys.stderr)
    ids = torch.tensor([[pad_id] * (longest - len(x)) + x for x in prompts])  # [b, s], left-padded
    mask = torch.tensor([[0] * (longest - len(x)) + [1] * len(x) for x in prompts])

    own_dist = not torch.distributed.is_initialized()
    try:
        grid = None
        if args.tp > 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1:
            grid = initialize_model_parallel(args.tp, 1)
            rank = grid.rank
        from deepspeed.accelerator import get_accelerator

        device = get_accelerator().device_name(int(os.environ.get("LOCAL_RANK", "0")))
        model = SpecSequential(layer_specs(config, ParallelOptions()))
        load_model(folder, model, None if grid is None else grid.tp_group)
        model = model.to(device=device, dtype=getattr(torch, args.dtype)).eval()
        out = Generator(model).generate(ids, max_new_tokens=args.max_new_tokens, sampling=sampling,
                                        eos_token_id=eos, pad_token_id=pad_id, attention_mask=mask)
    except ValueError as e:
        _say(rank, f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if own_dist and torch.distributed.is_initialized():
            destroy_model_parallel()

    for row, text in enumerate(args.prompt):
        new = out.new_tokens[row].tolist()
        if eos is not None and eos in new:
            new = new[: new.index(eos)]
        _say(rank, text + tokenizer.decode(new))
    n = out.new_tokens.shape[1]
    decode_rate = (n - 1) / out.decode_seconds if n > 1 and out.decode_seconds > 0 else float("nan")
    seconds = out.prompt_seconds + out.decode_seconds
    _say(rank, f"[generate] {n} new tokens x {len(prompts)} prompt(s) in {seconds:.2f} s: "
               f"{out.tokens_per_second:.1f} tokens/s (prompt of {longest} tokens + first token "
               f"{out.prompt_seconds * 1e3:.0f} ms, then {decode_rate:.1f} tokens/s), tp={args.tp}",
         file=sys.stderr)
    return 0

"""Text generation from a zoo GPT: a KV cache per block, greedy or sampled decoding, at any tensor-parallel size.

The model is the plain one, ``SpecSequential(layer_specs(config))``, run layer by layer: the embedding with the
positions that follow the cached ones, each ``GPTBlock`` with a :class:`~zoo.models.gpt.KVCache` attached to its
attention, then the final norm and the LM head on the last position only. The prompt is one forward; each new
token one more forward of a single position (Pope et al. 2022, "Efficiently Scaling Transformer Inference").

Sampling (Holtzman et al. 2019 for top-p) runs on the full-vocabulary logits: the vocab-sharded logits
``[b, V_pad/tp]`` are all-gathered and cut to ``vocab_size``, so padded columns are never drawn. Every TP rank
draws with a generator seeded alike, and the token of TP rank 0 is then taken by all, so ranks can never diverge.
Pipeline parallelism is not supported: a model folder is layout-free, load it at pp=1.

Command line (``launch/generate.py``)::

    python launch/generate.py --ckpt runs/tiny/model --prompt "Once upon a time" --max-new-tokens 64
    torchrun --nproc_per_node 2 launch/generate.py --tp 2 --ckpt DIR --prompt "..." --temperature 0.8 --top-p 0.9
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from deepspeed.pipe import PipelineModule

from zoo.models.gpt import GPTBlock, GPTEmbedding, GPTFinalNorm, KVCache
from zoo.models.specs import SpecSequential
from zoo.parallel.mappings import gather_from_tensor_model_parallel_region


@dataclass
class SamplingOptions:
    """Greedy (argmax), or a draw from softmax(logits / temperature) restricted to the top-k tokens and to the
    smallest set of top tokens whose probability reaches top_p. ``top_k=0`` and ``top_p=1`` switch those off."""

    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature} (use greedy decoding for 0)")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def sample_next(logits: torch.Tensor, opts: SamplingOptions, generator: torch.Generator | None) -> torch.Tensor:
    """Full-vocabulary logits ``[b, V]`` -> next tokens ``[b]``."""
    if opts.greedy:
        return logits.argmax(dim=-1)
    logits = logits.float() / opts.temperature
    if 0 < opts.top_k < logits.shape[-1]:
        kth = torch.topk(logits, opts.top_k, dim=-1).values[:, -1:]  # [b, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if opts.top_p < 1.0:
        # Stable sort: among equal logits the lowest id comes first, as argmax picks it.
        sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # [b, V]
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token once the tokens before it already hold top_p; the most likely one always stays.
        drop = probs.cumsum(dim=-1) - probs >= opts.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@dataclass
class Generation:
    """``tokens``: ``[b, s + n]``, the prompt (as given, padding included) then n new tokens; after a row's eos,
    ``pad_token_id``. ``prompt_seconds`` covers the prompt forward and the first token, ``decode_seconds`` the rest."""

    tokens: torch.Tensor
    prompt_length: int
    prompt_seconds: float
    decode_seconds: float

    @property
    def new_tokens(self) -> torch.Tensor:  # [b, n]
        return self.tokens[:, self.prompt_length:]

    @property
    def tokens_per_second(self) -> float:
        """New tokens (per row) per second of generation, prompt included."""
        return self.new_tokens.shape[1] / max(self.prompt_seconds + self.decode_seconds, 1e-9)


@contextmanager
def _attached(blocks: list, caches: list):
    for block, cache in zip(blocks, caches):
        block.attention.kv_cache = cache
    try:
        yield
    finally:
        for block in blocks:
            block.attention.kv_cache = None


class Generator:
    """Generation from a built plain model (``SpecSequential`` of :func:`zoo.models.gpt.layer_specs`), any tp.

    Collective over the model's TP group: every rank calls :meth:`generate` with the same prompt ids and gets the
    same tokens back.
    """

    def __init__(self, model: SpecSequential):
        if isinstance(model, PipelineModule):
            raise ValueError("generation needs the whole model in each process (pp=1), not one pipeline stage: "
                             "load the model folder at pp=1 (zoo.convert.io.load_model into SpecSequential, or "
                             "launch/generate.py --ckpt DIR --tp T)")
        if not isinstance(model, SpecSequential):
            raise ValueError(f"Generator takes a SpecSequential GPT, got {type(model).__name__}")
        funcs = model._funcs
        embedding, blocks, norm, head = funcs[0], funcs[1:-2], funcs[-2], funcs[-1]
        if not (isinstance(embedding, GPTEmbedding) and isinstance(norm, GPTFinalNorm) and blocks
                and all(isinstance(b, GPTBlock) for b in blocks)):
            raise ValueError("Generator takes a GPT built from zoo.models.gpt.layer_specs "
                             "(GPTEmbedding, GPTBlock x L, GPTFinalNorm, LM head)")
        if embedding.par.sequence_parallel:
            raise ValueError("generation runs without sequence parallelism; build the model with "
                             "ParallelOptions(sequence_parallel=False) (a model folder loads into either)")
        self.model, self.embedding, self.blocks, self.norm, self.head = model, embedding, list(blocks), norm, head
        self.config = embedding.config
        self.tp_group = embedding.par.tp_group

    def logits(self, ids: torch.Tensor, caches: list[KVCache]) -> torch.Tensor:
        """Run the s new positions of ``ids`` ``[b, s]`` through the cached model; full-vocab logits of the last
        position ``[b, vocab_size]`` (float32), identical on every TP rank."""
        x = self.embedding(ids, position_ids=caches[0].positions(ids.shape[1], ids.device))  # [b, s, h]
        with _attached(self.blocks, caches):
            for block in self.blocks:
                x = block(x)
        logits = self.head(self.norm(x[:, -1:]))  # [b, 1, V_pad/tp]
        logits = gather_from_tensor_model_parallel_region(logits, self.tp_group)  # [b, 1, V_pad]
        return logits[:, 0, : self.config.vocab_size].float()  # padded columns are never candidates

    def new_caches(self, batch: int, max_len: int, pad: torch.Tensor | None = None) -> list[KVCache]:
        w = self.embedding.word_embeddings.weight
        return [KVCache(batch, b.attention.num_groups_local, max_len, b.attention.head_dim, dtype=w.dtype,
                        device=w.device, pad=pad) for b in self.blocks]

    def _same_on_all_ranks(self, tokens: torch.Tensor) -> torch.Tensor:
        """TP rank 0's tokens, on every rank (the draws agree already; this makes it a guarantee)."""
        return gather_from_tensor_model_parallel_region(tokens[:, None], self.tp_group)[:, 0]  # [b, tp] -> [b]

    @torch.inference_mode()
    def generate(self, ids: torch.Tensor, *, max_new_tokens: int, sampling: SamplingOptions | None = None,
                 eos_token_id: int | None = None, pad_token_id: int | None = None,
                 attention_mask: torch.Tensor | None = None, use_cache: bool = True) -> Generation:
        """Continue ``ids`` ``[b, s]`` by up to ``max_new_tokens`` tokens (fewer if every row reached eos, or the
        model's ``max_position_embeddings`` is reached).

        ``attention_mask`` ``[b, s]`` (1 real, 0 padding) marks left padding. ``use_cache=False`` recomputes every
        position at every step (for comparison; same tokens).
        """
        sampling = sampling or SamplingOptions()
        cfg = self.config
        device = self.embedding.word_embeddings.weight.device
        ids = ids.to(device)
        b, s = ids.shape
        if s == 0:
            raise ValueError("empty prompt: give at least one token")
        if s > cfg.max_position_embeddings:
            raise ValueError(f"prompt of {s} tokens is longer than max_position_embeddings "
                             f"{cfg.max_position_embeddings}")
        # The last new token is never fed back, so s + n - 1 positions must fit.
        max_new_tokens = max(0, min(max_new_tokens, cfg.max_position_embeddings - s + 1))
        pad = None
        if attention_mask is not None:
            attention_mask = attention_mask.to(device)
            pad = (attention_mask == 0).sum(dim=1)  # [b]
            left = torch.arange(s, device=device)[None] >= pad[:, None]
            if not torch.equal(attention_mask.bool(), left):
                raise ValueError("attention_mask must be left padding: zeros then ones in every row")
            if bool((pad == s).any()):
                raise ValueError("a row of the batch is all padding")
            if not bool(pad.any()):
                pad = None
        pad_id = eos_token_id if pad_token_id is None else pad_token_id
        generator = None
        if not sampling.greedy:
            generator = torch.Generator(device=device).manual_seed(sampling.seed)
        was_training = self.model.training
        self.model.eval()
        try:
            tokens = ids
            finished = torch.zeros(b, dtype=torch.bool, device=device)
            start = time.perf_counter()
            prompt_seconds = 0.0
            caches = self.new_caches(b, s + max_new_tokens - 1, pad) if use_cache else None
            step_ids = ids
            for step in range(max_new_tokens):
                if not use_cache:  # everything again, in a fresh cache as long as the sequence
                    caches, step_ids = self.new_caches(b, tokens.shape[1], pad), tokens
                logits = self.logits(step_ids, caches)
                nxt = self._same_on_all_ranks(sample_next(logits, sampling, generator))
                if eos_token_id is not None:
                    nxt = torch.where(finished, torch.full_like(nxt, pad_id), nxt)
                    finished |= nxt == eos_token_id
                tokens = torch.cat([tokens, nxt[:, None]], dim=1)
                step_ids = nxt[:, None]
                if step == 0:
                    prompt_seconds = time.perf_counter() - start
                if eos_token_id is not None and bool(finished.all()):
                    break
            total = time.perf_counter() - start
        finally:
            self.model.train(was_training)
        return Generation(tokens, s, prompt_seconds, total - prompt_seconds)


# ---------------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="launch/generate.py", description=__doc__.split("\n\n")[0])
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


def resolve_model_folder(path: str | os.PathLike) -> Path:
    """The model folder itself, or a training run folder's ``model/``."""
    from zoo.convert.io import CheckpointError, is_model_folder

    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"model folder {path} does not exist")
    if is_model_folder(path):
        return path
    if is_model_folder(path / "model"):
        return path / "model"
    raise CheckpointError(f"{path} is neither a zoo model folder (config.json with zoo_format) nor a run folder "
                          f"with one in model/")


def _say(rank: int, *args, **kwargs) -> None:
    if rank == 0:
        print(*args, **kwargs, flush=True)


def main(argv: list[str] | None = None) -> int:
    from zoo.convert.io import load_model, read_config
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

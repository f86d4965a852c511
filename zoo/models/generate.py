"""Text generation from a zoo GPT: a KV cache per block, greedy or sampled decoding, at any tensor-parallel size.

The model is the plain one, ``SpecSequential(layer_specs(config))``, run layer by layer: the embedding with the
positions that follow the cached ones, each ``GPTBlock`` with a :class:`~zoo.models.gpt.KVCache` attached to its
attention, then the final norm and the LM head on the last position only. The prompt is one forward; each new
token one more forward of a single position (Pope et al. 2022, "Efficiently Scaling Transformer Inference").

Sampling (Holtzman et al. 2019 for top-p) runs on the full-vocabulary logits: the vocab-sharded logits
``[b, V_pad/tp]`` are all-gathered and cut to ``vocab_size``, so padded columns are never drawn. Every TP rank
draws with a generator seeded alike, and the token of TP rank 0 is then taken by all, so ranks can never diverge.
Pipeline parallelism is not supported: a model folder is layout-free, load it at pp=1. The command line that
loads a folder and generates from it (``launch/generate.py``) is ``zoo.generate.gpt``.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from deepspeed.pipe import PipelineModule

from zoo.models.gpt import GPTBlock, GPTEmbedding, GPTFinalNorm, KVCache
from zoo.models.rope import switch_length
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
            switch = switch_length(cfg)
            switch = cfg.max_position_embeddings + 1 if switch is None else switch  # None: never re-encode
            for step in range(max_new_tokens):
                if not use_cache:  # everything again, in a fresh cache as long as the sequence
                    caches, step_ids = self.new_caches(b, tokens.shape[1], pad), tokens
                elif 0 < caches[0].length <= switch < tokens.shape[1]:  # longrope's long factors from here on:
                    caches, step_ids = self.new_caches(b, s + max_new_tokens - 1, pad), tokens  # re-encode (as HF)
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

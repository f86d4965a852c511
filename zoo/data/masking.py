"""BERT pretraining inputs: sentence pairs and masked-LM corruption (Devlin et al. 2018, Sec. 3.1 and A.1).

- :func:`build_sentence_pair` lays out ``[CLS] A [SEP] B [SEP]``, padded to ``seq_length``, with token types
  (0 for ``[CLS] A [SEP]``, 1 for ``B [SEP]``), the attention mask (1 token, 0 padding) and the pair's label.
  Labels follow HF and Megatron: next-sentence prediction 0 = B is A's true continuation, 1 = B is a random
  segment; sentence-order prediction (ALBERT, Lan et al. 2019) 0 = in order, 1 = swapped.
- :func:`mask_tokens` chooses 15% of the ordinary tokens of each sequence (never special tokens or padding) as
  prediction targets, as the original code and Megatron do (a fixed count per sequence, ``round(0.15 n)`` and at
  least one); of those 80% become ``[MASK]``, 10% a random ordinary token, 10% stay unchanged. Labels hold the
  original id at chosen positions and -100 elsewhere.

Everything is a pure function of its arguments: randomness comes from a ``torch.Generator`` seeded with ``seed``,
so a sample corrupts the same way in every run and every data-parallel layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

IGNORE_INDEX = -100


@dataclass(frozen=True)
class SpecialTokens:
    """Ids of BERT's special tokens (the uncased WordPiece vocabulary's by default). ``extra`` lists any other id
    that must never be masked nor drawn as a random replacement (e.g. ``[UNK]`` or unused slots)."""

    cls: int = 101
    sep: int = 102
    mask: int = 103
    pad: int = 0
    extra: tuple[int, ...] = ()

    @property
    def ids(self) -> tuple[int, ...]:
        return tuple(sorted({self.cls, self.sep, self.mask, self.pad, *self.extra}))


def truncate_pair(tokens_a: Sequence[int], tokens_b: Sequence[int], max_tokens: int) -> tuple[list[int], list[int]]:
    """Drop tokens from the end of the longer segment (A on a tie) until both fit in ``max_tokens`` together."""
    a, b = list(tokens_a), list(tokens_b)
    while len(a) + len(b) > max_tokens:
        (a if len(a) >= len(b) else b).pop()
    return a, b


def build_sentence_pair(tokens_a: Sequence[int], tokens_b: Sequence[int], *, seq_length: int, label: int = 0,
                        special: SpecialTokens = SpecialTokens()) -> dict[str, torch.Tensor]:
    """``[CLS] A [SEP] B [SEP] [PAD]...`` of exactly ``seq_length`` tokens; the longer segment is truncated first.

    Returns ``input_ids``, ``token_type_ids``, ``attention_mask`` (each ``[seq_length]``, long) and ``label`` (a
    0-d long tensor: the NSP/SOP label passed in).
    """
    if seq_length < 3:
        raise ValueError(f"seq_length {seq_length} leaves no room for [CLS] A [SEP] B [SEP]; use seq_length >= 3")
    a, b = truncate_pair(tokens_a, tokens_b, seq_length - 3)
    ids = [special.cls, *a, special.sep, *b, special.sep]
    types = [0] * (len(a) + 2) + [1] * (len(b) + 1)
    n = len(ids)
    pad = seq_length - n
    return {
        "input_ids": torch.tensor(ids + [special.pad] * pad, dtype=torch.long),
        "token_type_ids": torch.tensor(types + [0] * pad, dtype=torch.long),
        "attention_mask": torch.tensor([1] * n + [0] * pad, dtype=torch.long),
        "label": torch.tensor(label, dtype=torch.long),
    }


def next_sentence_pair(tokens_a, next_tokens, random_tokens, *, use_random: bool, seq_length: int,
                       special: SpecialTokens = SpecialTokens()) -> dict[str, torch.Tensor]:
    """NSP: A followed by its true continuation (label 0) or, with ``use_random``, by a random segment (label 1)."""
    b = random_tokens if use_random else next_tokens
    return build_sentence_pair(tokens_a, b, seq_length=seq_length, label=int(use_random), special=special)


def sentence_order_pair(first, second, *, swap: bool, seq_length: int,
                        special: SpecialTokens = SpecialTokens()) -> dict[str, torch.Tensor]:
    """SOP: two consecutive segments in order (label 0) or, with ``swap``, the other way round (label 1)."""
    a, b = (second, first) if swap else (first, second)
    return build_sentence_pair(a, b, seq_length=seq_length, label=int(swap), special=special)


def mask_tokens(tokens: torch.Tensor, seed: int, *, vocab_size: int, special: SpecialTokens = SpecialTokens(),
                mask_prob: float = 0.15, replace_prob: float = 0.8, random_prob: float = 0.1,
                max_predictions: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Corrupt ``tokens`` (``[s]`` or ``[b, s]`` ids) for masked-LM training; returns ``(input_ids, labels)``.

    Per sequence, ``k = max(1, round(mask_prob * n))`` of its ``n`` ordinary tokens (not in ``special.ids``) are
    chosen uniformly without replacement (``k = 0`` when ``n = 0``; at most ``max_predictions`` when given). Each
    chosen token becomes ``[MASK]`` with probability ``replace_prob``, a uniformly drawn ordinary token of
    ``[0, vocab_size)`` with probability ``random_prob``, and stays itself otherwise. ``labels`` is the original id at
    the chosen positions and -100 elsewhere. A pure function of ``(tokens, seed)`` and the arguments.
    """
    if not (0.0 <= mask_prob <= 1.0 and min(replace_prob, random_prob) >= 0.0 and replace_prob + random_prob <= 1.0):
        raise ValueError(f"need 0 <= mask_prob <= 1 and replace_prob + random_prob <= 1, got mask_prob={mask_prob}, "
                         f"replace_prob={replace_prob}, random_prob={random_prob}")
    squeeze = tokens.dim() == 1
    tokens = tokens.unsqueeze(0) if squeeze else tokens
    g = torch.Generator().manual_seed(seed)
    specials = torch.tensor(special.ids, dtype=tokens.dtype, device=tokens.device)
    ordinary = ~torch.isin(tokens, specials)  # [b, s]

    # Choose k positions per row: rank random scores, with every non-candidate scored past all candidates.
    n = ordinary.sum(dim=1)
    k = torch.where(n > 0, torch.round(n * mask_prob).long().clamp(min=1), torch.zeros_like(n))
    if max_predictions is not None:
        k = k.clamp(max=max_predictions)
    scores = torch.rand(tokens.shape, generator=g).to(tokens.device).masked_fill(~ordinary, 2.0)
    rank = scores.argsort(dim=1).argsort(dim=1)  # rank of each position's score within its row
    chosen = rank < k.unsqueeze(1)

    # Of the chosen: [MASK], a random ordinary token, or unchanged.
    u = torch.rand(tokens.shape, generator=g).to(tokens.device)
    to_mask = chosen & (u < replace_prob)
    to_random = chosen & (u >= replace_prob) & (u < replace_prob + random_prob)
    allowed = torch.ones(vocab_size, dtype=torch.bool)
    allowed[[i for i in special.ids if i < vocab_size]] = False
    pool = allowed.nonzero().squeeze(1).to(tokens.device)
    random_ids = pool[torch.randint(len(pool), tokens.shape, generator=g).to(tokens.device)].to(tokens.dtype)

    input_ids = torch.where(to_mask, torch.full_like(tokens, special.mask), tokens)
    input_ids = torch.where(to_random, random_ids, input_ids)
    labels = torch.where(chosen, tokens, torch.full_like(tokens, IGNORE_INDEX))
    if squeeze:
        return input_ids[0], labels[0]
    return input_ids, labels

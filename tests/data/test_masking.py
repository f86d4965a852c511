"""BERT masking and sentence pairs: layout, proportions on a large sample, specials untouched, determinism."""

import math

import pytest
import torch

from zoo.data.masking import (
    IGNORE_INDEX,
    SpecialTokens,
    build_sentence_pair,
    mask_tokens,
    next_sentence_pair,
    sentence_order_pair,
)

SPECIAL = SpecialTokens(cls=1, sep=2, mask=3, pad=0, extra=(4,))
VOCAB = 50


def _pairs(batch: int, seq_length: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Sentence pairs of random lengths (some padded, some truncated) over the ordinary ids 5..VOCAB-1."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        la, lb = torch.randint(1, seq_length, (2,), generator=g).tolist()
        a = torch.randint(5, VOCAB, (la,), generator=g).tolist()
        b = torch.randint(5, VOCAB, (lb,), generator=g).tolist()
        rows.append(build_sentence_pair(a, b, seq_length=seq_length, special=SPECIAL))
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def test_sentence_pair_layout():
    out = build_sentence_pair([10, 11, 12], [20, 21], seq_length=10, label=1, special=SPECIAL)
    assert out["input_ids"].tolist() == [1, 10, 11, 12, 2, 20, 21, 2, 0, 0]
    assert out["token_type_ids"].tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 0, 0]
    assert out["attention_mask"].tolist() == [1, 1, 1, 1, 1, 1, 1, 1, 0, 0]
    assert out["label"].item() == 1
    assert all(v.dtype == torch.long for v in out.values())


def test_sentence_pair_truncates_the_longer_segment_first():
    a, b = list(range(10, 20)), [30, 31, 32]
    out = build_sentence_pair(a, b, seq_length=10, special=SPECIAL)  # room for 7 segment tokens
    assert out["input_ids"].tolist() == [1, 10, 11, 12, 13, 2, 30, 31, 32, 2]
    assert out["attention_mask"].sum().item() == 10
    out = build_sentence_pair([10, 11], list(range(30, 40)), seq_length=8, special=SPECIAL)  # room for 5
    assert out["input_ids"].tolist() == [1, 10, 11, 2, 30, 31, 32, 2]
    with pytest.raises(ValueError, match="seq_length 2"):
        build_sentence_pair([5], [6], seq_length=2, special=SPECIAL)


def test_nsp_and_sop_labels():
    a, nxt, rnd = [10, 11], [12, 13], [40, 41]
    assert next_sentence_pair(a, nxt, rnd, use_random=False, seq_length=8, special=SPECIAL)["label"].item() == 0
    out = next_sentence_pair(a, nxt, rnd, use_random=True, seq_length=8, special=SPECIAL)
    assert out["label"].item() == 1 and out["input_ids"][4:6].tolist() == rnd
    assert sentence_order_pair(a, nxt, swap=False, seq_length=8, special=SPECIAL)["input_ids"][1:3].tolist() == a
    out = sentence_order_pair(a, nxt, swap=True, seq_length=8, special=SPECIAL)
    assert out["label"].item() == 1 and out["input_ids"][1:3].tolist() == nxt and out["input_ids"][4:6].tolist() == a


def test_masking_proportions_and_specials():
    pairs = _pairs(2000, 32)
    tokens = pairs["input_ids"]
    inputs, labels = mask_tokens(tokens, seed=3, vocab_size=VOCAB, special=SPECIAL)
    ordinary = ~torch.isin(tokens, torch.tensor(SPECIAL.ids))
    chosen = labels != IGNORE_INDEX

    # Specials and padding are never chosen nor changed; labels are the original ids; nothing else changes.
    assert not (chosen & ~ordinary).any()
    assert torch.equal(inputs[~chosen], tokens[~chosen])
    assert torch.equal(labels[chosen], tokens[chosen])

    # Exactly round(15% of the ordinary tokens) per row (at least one).
    n = ordinary.sum(1)
    assert torch.equal(chosen.sum(1), torch.round(n * 0.15).long().clamp(min=1))

    # 80 / 10 / 10 among the chosen: each share within 4 standard deviations of a binomial.
    total = chosen.sum().item()
    assert total > 5000
    masked = (inputs[chosen] == SPECIAL.mask).sum().item()
    kept = (inputs[chosen] == tokens[chosen]).sum().item()
    replaced = total - masked - kept
    # A random replacement equal to the original counts as "kept": probability 0.1 / (number of ordinary ids).
    normal = VOCAB - len(SPECIAL.ids)
    for count, p in ((masked, 0.8), (replaced, 0.1 * (1 - 1 / normal)), (kept, 0.1 + 0.1 / normal)):
        assert abs(count - p * total) < 4 * math.sqrt(total * p * (1 - p)), (count, p, total)

    # Random replacements come from the ordinary vocabulary, uniformly enough to cover it.
    swapped = chosen & (inputs != tokens) & (inputs != SPECIAL.mask)
    drawn = inputs[swapped]
    assert not torch.isin(drawn, torch.tensor(SPECIAL.ids)).any()
    assert drawn.min() >= 0 and drawn.max() < VOCAB
    assert set(drawn.tolist()) == set(range(VOCAB)) - set(SPECIAL.ids)


def test_masking_is_a_pure_function_of_tokens_and_seed():
    tokens = _pairs(16, 24)["input_ids"]
    first = mask_tokens(tokens, seed=11, vocab_size=VOCAB, special=SPECIAL)
    torch.rand(5)  # the global generator plays no part
    again = mask_tokens(tokens.clone(), seed=11, vocab_size=VOCAB, special=SPECIAL)
    other = mask_tokens(tokens, seed=12, vocab_size=VOCAB, special=SPECIAL)
    assert all(torch.equal(x, y) for x, y in zip(first, again))
    assert not torch.equal(first[1], other[1])
    one_row = mask_tokens(tokens[0], seed=11, vocab_size=VOCAB, special=SPECIAL)
    assert one_row[0].shape == tokens[0].shape and (one_row[1] != IGNORE_INDEX).sum() >= 1


def test_masking_edge_cases():
    only_specials = torch.tensor([[1, 2, 2, 0, 0]])
    inputs, labels = mask_tokens(only_specials, seed=0, vocab_size=VOCAB, special=SPECIAL)
    assert torch.equal(inputs, only_specials) and (labels == IGNORE_INDEX).all()
    tokens = _pairs(4, 32)["input_ids"]
    _, labels = mask_tokens(tokens, seed=0, vocab_size=VOCAB, special=SPECIAL, max_predictions=2)
    assert ((labels != IGNORE_INDEX).sum(1) <= 2).all()
    with pytest.raises(ValueError, match="replace_prob"):
        mask_tokens(tokens, seed=0, vocab_size=VOCAB, replace_prob=0.9, random_prob=0.2)

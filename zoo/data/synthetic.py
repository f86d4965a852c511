"""A synthetic token dataset that needs no file: sample ``i`` is a pure function of ``(seed, i)``.

Each sample is ``seq_length + 1`` tokens: a first half drawn from a Zipf distribution over the vocabulary (token k
with probability proportional to 1/(k+1)), then the first half again. A model learns the unigram statistics in a
few steps and the copy with attention later, so the loss falls from ln(V) right away and keeps falling. Being
index-addressable, any rank can read any sample, every layout sees the same global batch (``zoo.data.batches``), and
a resumed run continues from its step number alone.
"""

import torch


class SyntheticTokens:
    def __init__(self, vocab_size: int, seq_length: int, seed: int = 0):
        self.vocab_size, self.seq_length, self.seed = vocab_size, seq_length, seed
        self.probs = 1.0 / torch.arange(1, vocab_size + 1, dtype=torch.float64)

    def __getitem__(self, index: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        n = self.seq_length + 1
        first = torch.multinomial(self.probs, (n + 1) // 2, replacement=True, generator=g)
        return torch.cat([first, first])[:n]


"""A synthetic token dataset that needs no file: sample ``i`` is a pure function of ``(seed, i)``.

Each sample is ``seq_length + 1`` tokens: a first half drawn from a Zipf distribution over the vocabulary (token k
with probability proportional to 1/(k+1)), then the first half again. A model learns the unigram statistics in a
few steps and the copy with attention later, so the loss falls from ln(V) right away and keeps falling. Being index-addressable, any rank can read any sample, every layout sees the same global
batch, and a resumed run continues from its step number alone.
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


def micro_batch(dataset, step: int, micro: int, *, micro_batch_size: int, accumulation: int, dp_rank: int, dp: int):
    """Inputs and next-token labels ``[b, s]`` of micro-batch ``micro`` of step ``step`` (0-based) on ``dp_rank``.

    Step t uses samples ``[t*G, (t+1)*G)`` (G = micro_batch_size x accumulation x dp), cut into micro-batches, so
    the global batch, and hence the training, is the same in every (tp, pp, dp) layout.
    A sample is ``seq_length + 1`` tokens (inputs and labels are its two shifts), or already a pair
    ``(inputs, labels)`` whose parts are tensors or tuples of tensors (instruction data with -100 labels where no
    loss is taken; BERT's ``(input_ids, token_type_ids, attention_mask)``), stacked part by part.
    """
    per_micro = micro_batch_size * dp
    start = (step * accumulation + micro) * per_micro + dp_rank * micro_batch_size
    samples = [dataset[start + i] for i in range(micro_batch_size)]
    if isinstance(samples[0], tuple):
        return _stack(samples)
    tokens = torch.stack(samples)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _stack(samples: list):
    if isinstance(samples[0], (tuple, list)):
        return tuple(_stack([s[i] for s in samples]) for i in range(len(samples[0])))
    return torch.stack(samples)

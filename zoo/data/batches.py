"""Which samples form a micro-batch, and how they are stacked: the data order every family and layout shares.

Step t of a run with global batch G uses samples ``[t*G, (t+1)*G)`` of the (index-addressable) dataset, cut into
micro-batches per data-parallel rank (Megatron's pretraining sampler, without the shuffle: the datasets shuffle
themselves), so a step's global batch is the same in every (tp, pp, dp) layout and a resumed run continues from its
step number alone. With context parallelism the cp ranks of a replica read the same micro-batch (the true dp rank
and size pick it) and each keeps its share of every sequence (:func:`context_parallel_share`).
"""

import torch

from zoo.parallel.context_parallel import split_sequence


def micro_batch(dataset, step: int, micro: int, *, micro_batch_size: int, accumulation: int, dp_rank: int, dp: int):
    """Inputs and labels of micro-batch ``micro`` of step ``step`` (0-based) on ``dp_rank``.

    Step t uses samples ``[t*G, (t+1)*G)`` (G = micro_batch_size x accumulation x dp), cut into micro-batches, so
    the global batch, and hence the training, is the same in every (tp, pp, dp) layout.
    A sample is ``seq_length + 1`` tokens (inputs and labels ``[b, s]`` are its two shifts), or already a pair
    ``(inputs, labels)`` whose parts are tensors or tuples of tensors (instruction data with -100 labels where no
    loss is taken; BERT's ``(input_ids, token_type_ids, attention_mask)``), stacked part by part.
    """
    per_micro = micro_batch_size * dp
    start = (step * accumulation + micro) * per_micro + dp_rank * micro_batch_size
    samples = [dataset[start + i] for i in range(micro_batch_size)]
    if isinstance(samples[0], tuple):
        return collate(samples)
    tokens = torch.stack(samples)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def collate(samples: list):
    """Stack samples that are tensors, or (nested) tuples of tensors, element by element."""
    first = samples[0]
    if isinstance(first, (tuple, list)):
        return tuple(collate([s[i] for s in samples]) for i in range(len(first)))
    return torch.stack(samples)


def to_device(batch, device):
    if isinstance(batch, (tuple, list)):
        return tuple(to_device(b, device) for b in batch)
    return batch.to(device)


def context_parallel_share(batch, cp_rank: int, cp: int, algorithm: str):
    """CP rank ``cp_rank``'s share of a micro-batch: each tensor ``[b, s]`` (inputs, and labels already shifted, so
    every rank's labels are its own positions' next tokens) split along the sequence, ``[b, s/cp]``, by
    ``zoo.parallel.context_parallel.split_sequence`` (contiguous for Ulysses, the balanced chunks for ring)."""
    if cp == 1:
        return batch
    if isinstance(batch, (tuple, list)):
        return tuple(context_parallel_share(b, cp_rank, cp, algorithm) for b in batch)
    return split_sequence(batch, 1, cp_rank, cp, algorithm)

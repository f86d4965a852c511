"""Tensor, sequence and pipeline parallel building blocks on DeepSpeed's process topology.

This package is the only one in zoo that talks to torch.distributed directly.
"""

import zoo.compat  # noqa: F401  first: checks the DeepSpeed and torch versions once, before zoo imports DeepSpeed
from zoo.parallel.cross_entropy import vocab_parallel_cross_entropy
from zoo.parallel.layers import (
    ColumnParallelConv2d,
    ColumnParallelLinear,
    ParallelConvAttention,
    ParallelGroupNorm,
    RowParallelConv2d,
    RowParallelLinear,
    VocabParallelEmbedding,
    init_method_normal,
    init_method_torch_default,
    scaled_init_method_normal,
)
from zoo.parallel.mappings import (
    all_reduce_tensor_model_parallel_region,
    all_to_all,
    all_to_all_scatter_gather,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from zoo.parallel.topology import (
    LayoutError,
    ParallelGrid,
    check_layout,
    destroy_model_parallel,
    get_grid,
    init_distributed,
    initialize_model_parallel,
)

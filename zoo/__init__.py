"""zoo: Megatron-style tensor/pipeline/data-parallel model zoo on DeepSpeed."""

__version__ = "0.1.0"

"""zoo: Megatron-style tensor/pipeline/data-parallel model zoo on DeepSpeed.

``from zoo import load_model``: any zoo model folder as one plain torch module (``zoo.generate.load_model``).
"""

__version__ = "0.1.0"
__all__ = ["load_model"]


def __getattr__(name):  # imported on first use, so that ``import zoo.<module>`` stays as cheap as that module
    if name == "load_model":
        from zoo.generate import load_model

        return load_model
    raise AttributeError(f"module 'zoo' has no attribute {name!r}")

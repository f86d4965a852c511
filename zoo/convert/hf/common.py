"""Small pieces every architecture file uses: one-line refusals naming the field, and zoo configs built from a dict
with their validation errors as refusals."""

from __future__ import annotations

from collections.abc import Callable

from zoo.convert.errors import ConvertError


def refusal(arch: str) -> Callable[[bool, str], None]:
    """``need(ok, message)``: a ConvertError ``"<arch>: <message>"`` unless ``ok``."""

    def need(ok, message: str) -> None:
        if not ok:
            raise ConvertError(f"{arch}: {message}")

    return need


def zoo_config(cls, fields: dict):
    """``cls.from_dict(fields)``, its validation errors as ConvertError (one line for the command line)."""
    try:
        return cls.from_dict(fields)
    except (TypeError, ValueError) as e:
        raise ConvertError(str(e)) from None


def hf_special(special: dict) -> dict:
    """The bos / eos / pad ids for an HF config (None where the zoo folder kept none)."""
    return {k: special.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}


def plain_block(cfg) -> bool:
    """A zoo GPT without the block features only OLMo 2 (post-norm), GPT-NeoX (parallel residual, exact GELU, MLP
    biases apart from the attention's), Granite (the multipliers) and Gemma 4 (``GEMMA4_FIELDS``) have: what the
    other classes' ``exports`` need."""
    return (cfg.norm_placement != "post" and not cfg.use_parallel_residual and cfg.activation != "gelu_exact"
            and cfg.use_mlp_bias == cfg.add_bias and cfg.residual_multiplier is None
            and cfg.attention_multiplier is None and cfg.logits_scaling is None and fields_off(cfg))
GEMMA4_FIELDS = ("global_head_dim", "num_global_key_value_heads", "attention_k_eq_v", "v_norm", "layer_scalar")


def fields_off(cfg, names=GEMMA4_FIELDS) -> bool:
    """Whether the GPT config fields ``names`` are all off (None / False): an architecture without those features
    must not export a model that has them."""
    return not any(getattr(cfg, name) for name in names)

"""What the model configs share: reading a config dataclass from a dict of its fields (:func:`from_fields`) or from
a named preset (:func:`preset_config`), every config; and for the Transformers (``GPTConfig``, ``BertConfig``,
:class:`TransformerConfig`) Megatron's vocabulary padding and the check that a (tp, pp) layout can hold the model.

A Transformer config inherits :class:`TransformerConfig` and names in ``tp_split_heads`` the head counts tensor
parallelism splits (GPT: query and key-value heads; BERT: the attention heads).
"""

from __future__ import annotations

from dataclasses import fields


def from_fields(cls, d: dict):
    """``cls(**d)`` for a config dataclass; unknown keys are refused in one line that lists the known fields."""
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown field(s) {unknown}; known fields: {sorted(names)}")
    return cls(**d)


def preset_config(cls, presets: dict[str, dict], what: str, name: str, overrides: dict):
    """``cls.from_dict`` of preset ``name`` with ``overrides`` on top (every config's ``from_preset``); an unknown name
    is refused in one line naming the model (``what``: "GPT", "BERT", ...) and its presets."""
    if name not in presets:
        raise ValueError(f"unknown {what} preset {name!r}; presets: {sorted(presets)}")
    return cls.from_dict({**presets[name], **overrides})


class ModelConfig:
    """Base of every config dataclass: :meth:`from_dict` reads one from a dict of its fields (a model folder's
    ``config.json``, a run config's ``model`` section)."""

    @classmethod
    def from_dict(cls, d: dict):
        return from_fields(cls, d)


class TransformerConfig(ModelConfig):
    tp_split_heads: tuple[str, ...] = ("num_attention_heads",)

    def padded_vocab_size(self, tp: int = 1) -> int:
        """Megatron's padded vocabulary: the next multiple of ``make_vocab_size_divisible_by x tp``."""
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple

    def has_dense_mlp(self) -> bool:
        """Whether some layer has the dense (TP-split) MLP of width ``intermediate_size``; an MoE model may not."""
        return True

    def check_layout(self, tp: int, pp: int = 1) -> None:
        """One line per problem, before anything is built: which number does not divide which."""
        for name in self.tp_split_heads:
            if getattr(self, name) % tp:
                raise ValueError(f"{name} {getattr(self, name)} is not divisible by tp {tp}; use a tp that divides it")
        if self.has_dense_mlp() and self.intermediate_size % tp:
            raise ValueError(f"intermediate_size {self.intermediate_size} is not divisible by tp {tp}")
        if self.num_hidden_layers < pp:
            raise ValueError(f"num_hidden_layers {self.num_hidden_layers} is smaller than pp {pp}; "
                             f"every pipeline stage needs at least one layer")

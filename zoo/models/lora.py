"""LoRA and DoRA adapters on zoo's tensor-parallel layers, computed as PEFT computes them.

LoRA (Hu et al. 2021, arXiv 2106.09685) on a linear weight ``W`` ``[out, in]`` (zoo's layout, rows = outputs)::

    y = W x + b + s B A x',        A [r, in], B [out, r], s = alpha / r (rslora: alpha / sqrt(r)), x' = dropout(x)

A starts as ``nn.Linear``'s weight (kaiming-uniform, a = sqrt(5)), B at zero, so the adapted model starts as the base.
DoRA (Liu et al. 2024, arXiv 2402.09353, as PEFT's ``use_dora``): a magnitude ``m`` ``[out]`` per output row, and
the norm ``n = ||W + s sg(B A)||`` of each row over the input dimension, detached (the paper's Sec. 4.3)::

    y = W x + b + (m / n - 1) W x' + (m / n) s B A x'            (m starts as n: the base model)

Names (what a zoo model folder stores and what the PEFT exporter reads): beside ``<prefix>.weight``,
``<prefix>.lora_A`` ``[r, in]``, ``<prefix>.lora_B`` ``[out, r]`` and ``<prefix>.lora_magnitude`` ``[out]``, with
B's and m's rows in W's row order (the per-kv-group fused QKV rows, gated fc1's [gate; up]). MoE experts, one adapter
per expert: ``experts.<param>_lora_A`` ``[E, r, in]`` and ``experts.<param>_lora_B`` ``[E, out, r]``.

Sharding (the PEFT / torchtitan rule), each replicated factor's gradient summed over the ranks that share it:

- column-parallel (``qkv``, ``fc1``, the untied ``lm_head``, whose ``merged_weight`` the fused LM head + loss
  reads): B and m sharded exactly as W's rows (fc1's stride-2 [gate; up] split,
  :class:`zoo.parallel.layers.GroupedQKVLinear`'s query rows sharded and k/v rows replicated over the kv group, their
  gradients summed over it, as ``kv_weight``'s); A replicated, its gradient summed over TP (each rank's B sees its
  own rows). x' is the replicated (SP: gathered) input, so dropout draws one mask for all.
- row-parallel (``dense``, ``fc2``): A sharded on the input like W's columns, B and m replicated. ``s B (A_i x_i)``
  is added to ``W_i x_i`` before the TP reduction (one collective; the reduction sums the partial ``A_i x_i``), so
  B's gradient is summed over TP. DoRA: n^2 summed over TP; m's gradient summed over TP under SP (it then sees a
  sequence shard, as the row bias). Dropout on the sharded input draws per rank (the TP stream).
- experts (``experts``, both matrices): this EP rank's experts' adapters; where the layer splits tokens over TP, every
  adapter's gradient is summed over TP, as the experts' own (not where EP spans TP: those experts differ per rank).

A layer takes its adapter in place (:func:`apply_lora`): its class becomes the LoRA subclass below and the adapter
tensors are registered on it, so every base name is unchanged (checkpoints, model folders, the key tables). The base
is frozen (``requires_grad=False``: no gradients, no optimizer state). Initialization draws each adapter's full
master tensor from a generator seeded by the run's seed and the module's name, then keeps this rank's slice: every
layout starts from the same adapters.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from zoo.models.gpt import GPTMLP, GPTEmbedding, GPTLMHead
from zoo.models.moe import GPTMoE, GroupedExperts
from zoo.parallel.layers import (
    ColumnParallelLinear,
    GroupedQKVLinear,
    RowParallelLinear,
    set_tensor_model_parallel_attributes,
    shard_master_weight,
)
from zoo.parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from zoo.parallel.random import tensor_parallel_rng

TARGETS = ("qkv", "dense", "fc1", "fc2", "experts", "embedding", "lm_head")
DEFAULT_TARGETS = ("qkv", "dense", "fc1", "fc2")
ADAPTER_SUFFIXES = ("lora_A", "lora_B", "lora_magnitude")  # a parameter name ending in one of them is an adapter's


@dataclass
class LoraConfig:
    """The adapters of a run (``finetune.lora`` of the run config; ``"lora"`` of a zoo folder's config)."""

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0  # on the adapter's input, as PEFT's lora_dropout
    targets: list = field(default_factory=lambda: list(DEFAULT_TARGETS))  # zoo module names (TARGETS)
    dora: bool = False  # PEFT's use_dora
    rslora: bool = False  # PEFT's use_rslora: s = alpha / sqrt(r)

    def __post_init__(self):
        if isinstance(self.targets, str):
            self.targets = [self.targets]
        self.targets = list(self.targets) if isinstance(self.targets, (list, tuple)) else self.targets
        if isinstance(self.alpha, int) and not isinstance(self.alpha, bool):
            self.alpha = float(self.alpha)
        self.validate()

    def validate(self) -> None:
        def need(ok, msg):
            if not ok:
                raise ValueError(f"lora.{msg}")

        need(isinstance(self.r, int) and not isinstance(self.r, bool) and self.r >= 1,
             f"r must be a positive integer (the adapters' rank, e.g. 16), got {self.r!r}")
        need(isinstance(self.alpha, (int, float)) and not isinstance(self.alpha, bool) and self.alpha > 0,
             f"alpha must be a positive number (the scale is alpha / r), got {self.alpha!r}")
        need(isinstance(self.dropout, (int, float)) and not isinstance(self.dropout, bool) and 0 <= self.dropout < 1,
             f"dropout must be a number in [0, 1), got {self.dropout!r}")
        need(isinstance(self.targets, list) and self.targets and all(isinstance(t, str) for t in self.targets),
             f"targets must be a non-empty list of module names from {list(TARGETS)}, got {self.targets!r}")
        bad = [t for t in self.targets if t not in TARGETS]
        need(not bad, f"targets {bad} are not zoo module names; use some of {list(TARGETS)}")
        need(len(set(self.targets)) == len(self.targets), f"targets lists a module twice: {self.targets}")
        for name in ("dora", "rslora"):
            need(isinstance(getattr(self, name), bool), f"{name} must be true or false, got {getattr(self, name)!r}")
        need(not (self.dora and "experts" in self.targets),
             "dora is not supported on MoE experts (PEFT has no DoRA for expert parameters); remove 'experts' from "
             "lora.targets or set lora.dora: false")

    @property
    def scale(self) -> float:
        return self.alpha / math.sqrt(self.r) if self.rslora else self.alpha / self.r

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> LoraConfig:
        if not isinstance(d, dict):
            raise ValueError(f"lora must be a mapping of {[f for f in cls.__dataclass_fields__]}, got {d!r}")
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"lora: unknown key(s) {unknown}; known: {list(cls.__dataclass_fields__)}")
        return cls(**d)


def check_model(config: LoraConfig, model_cfg) -> None:
    """The targets against the model (a ``GPTConfig``): one line for a target the model has not."""
    if "experts" in config.targets and not getattr(model_cfg, "num_experts", 0):
        raise ValueError("lora.targets 'experts' needs a mixture-of-experts model (num_experts > 0); remove it")
    if "lm_head" in config.targets and getattr(model_cfg, "tie_word_embeddings", False):
        raise ValueError("lora.targets 'lm_head': this model's LM head is its embedding (tie_word_embeddings), which "
                         "has no adapter here; remove 'lm_head'")


def adapter_tensors(config: LoraConfig, model_cfg, blocks, head: bool, tp: int = 1, ep: int = 1) -> tuple[list, list]:
    """``(dense, expert)`` element counts of the adapter tensors one rank holds (its share at tp / ep) of blocks
    ``blocks`` of ``model_cfg`` (a ``GPTConfig``) and, with ``head``, of the untied LM head: for the planner."""
    c, r, t = model_cfg, config.r, set(config.targets)
    h, d, nq, nkv = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads
    dense, expert = [], []

    def column(rows_local: int, inputs: int):  # A replicated, B (and m) this rank's rows
        dense.extend([r * inputs, rows_local * r] + [rows_local] * config.dora)

    def row(inputs_local: int, outputs: int):  # A this rank's columns, B (and m) replicated
        dense.extend([r * inputs_local, outputs * r] + [outputs] * config.dora)

    for i in blocks:
        if "qkv" in t:  # tp > kv heads: the query rows and one group's k/v rows
            column(nq * d // tp + 2 * d if tp > nkv else (nq + 2 * nkv) * d // tp, h)
        if "dense" in t:
            row(nq * d // tp, h)
        if c.is_moe_layer(i):
            if "experts" in t:
                fe, w1 = c.expert_intermediate_size, (2 if c.gated_mlp else 1) * c.expert_intermediate_size
                expert.extend([c.num_experts // ep * r * (h + w1), c.num_experts // ep * r * (fe + h)])
        else:
            f = c.intermediate_size
            if "fc1" in t:
                column((2 * f if c.gated_mlp else f) // tp, h)
            if "fc2" in t:
                row(f // tp, h)
    if head and "lm_head" in t:
        column(c.padded_vocab_size(tp) // tp, h)
    return dense, expert


def merged(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, config: LoraConfig,
           magnitude: torch.Tensor | None = None) -> torch.Tensor:
    """The weight an adapter stands for, as PEFT's ``merge_and_unload``: ``W + s B A`` (per expert for ``[E, out,
    in]``), and with DoRA ``(m / ||W + s B A||) (W + s B A)`` row by row. Full tensors, computed in fp32, returned in
    W's dtype."""
    w = weight.float() + config.scale * (lora_B.float() @ lora_A.float())
    if magnitude is not None:
        w = w * (magnitude.float() / w.norm(dim=-1)).unsqueeze(-1)
    return w.to(weight.dtype)


def adapter_keys(name: str) -> tuple[str, str, str] | None:
    """The (A, B, magnitude) tensor names of base tensor ``name`` (``<prefix>.weight``, or an expert matrix
    ``<prefix>.experts.<param>``) under the naming contract."""
    if name.endswith(".weight"):
        prefix = name[: -len(".weight")]
        return f"{prefix}.lora_A", f"{prefix}.lora_B", f"{prefix}.lora_magnitude"
    if ".experts." in name:
        return f"{name}_lora_A", f"{name}_lora_B", f"{name}_lora_magnitude"
    return None


def merged_tensors(keys, read, config: LoraConfig):
    """``(name, tensor)`` of a model's tensors with every adapter merged into its weight and the adapter tensors
    left out: ``keys`` the stored names, ``read(name)`` one full tensor. One weight (and its adapter) at a time."""
    keys = list(keys)
    present = set(keys)
    for name in keys:
        if is_adapter(name):
            continue
        tensor = read(name)
        names = adapter_keys(name)
        if names is not None and names[0] in present:
            A, B, m = names
            tensor = merged(tensor, read(A), read(B), config, read(m) if m in present else None)
        yield name, tensor


def is_adapter(name: str) -> bool:
    """Whether parameter ``name`` (a module path) is an adapter tensor (LoRA A / B, DoRA's magnitude)."""
    leaf = name.rsplit(".", 1)[-1]
    return any(leaf == s or leaf.endswith("_" + s) for s in ADAPTER_SUFFIXES)


# ---------------------------------------------------------------------------------------------------------------
# The math, shared by the layers
# ---------------------------------------------------------------------------------------------------------------


def _dropout(x, p: float, training: bool, per_rank: bool):
    if not training or p == 0.0:
        return x
    if per_rank:  # the input is sharded over TP: each rank draws its own features' mask
        with tensor_parallel_rng():
            return F.dropout(x, p, True)
    return F.dropout(x, p, True)


def _summed(w, group):
    """``w`` whose gradient is summed over ``group`` (forward identity); None or size 1: ``w``."""
    return w if group is None else copy_to_tensor_model_parallel_region(w, group)


def _squared_row_norms(weight, lora_B, lora_A, scale: float) -> torch.Tensor:
    """``||W + s B A||^2`` per row of this rank's ``[out_local, in_local]`` block, without gradient (as PEFT's
    weight norm, whose B A is detached and the norm too)."""
    with torch.no_grad():
        w = weight + scale * (lora_B @ lora_A).to(weight.dtype)
        return w.float().square().sum(1)  # fp32: the square root is taken after any sum over TP


def _column_lora(layer, x, weight, bias, lora_B, magnitude):
    """``y = W x + b (+ DoRA)`` for this rank's rows of a column-parallel weight; x ``[..., in]`` whole."""
    cfg = layer.lora_config
    A = _summed(layer.lora_A, layer.tp_group)  # [r, in]: each rank's B rows see only their share of the gradient
    xd = _dropout(x, cfg.dropout, layer.training, per_rank=False)
    low = F.linear(F.linear(xd, A), lora_B) * cfg.scale  # [..., out_local]
    if magnitude is None:
        return F.linear(x, weight, bias) + low
    base = F.linear(x, weight)
    factor = magnitude / _squared_row_norms(weight, lora_B, A, cfg.scale).sqrt().to(magnitude.dtype)  # [out_local]
    base_d = base if xd is x else F.linear(xd, weight)
    y = base if bias is None else base + bias
    return y + ((factor - 1) * base_d + factor * low)


class LoraColumnParallelLinear(ColumnParallelLinear):
    """:class:`ColumnParallelLinear` with an adapter: ``lora_A`` [r, in] replicated, ``lora_B`` [out/tp, r] and
    ``lora_magnitude`` [out/tp] sharded as ``weight``'s rows (same partition stride)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.tp_group, tensor_parallel_output_grad=True)
        else:
            x = copy_to_tensor_model_parallel_region(x, self.tp_group)
        y = _column_lora(self, x, self.weight, self.bias, self.lora_B, getattr(self, "lora_magnitude", None))
        if self.gather_output:
            y = gather_from_tensor_model_parallel_region(y, self.tp_group)
        return y

    def merged_weight(self) -> torch.Tensor:
        """This rank's rows of the weight the adapter stands for (:func:`merged`, without dropout), for a consumer
        that reads the weight itself (the fused LM head + loss); gradients reach A (summed over TP), B and m."""
        A = _summed(self.lora_A, self.tp_group)
        w = self.weight + self.lora_config.scale * (self.lora_B @ A).to(self.weight.dtype)
        if hasattr(self, "lora_magnitude"):
            norm = _squared_row_norms(self.weight, self.lora_B, A, self.lora_config.scale).sqrt()
            w = w * (self.lora_magnitude / norm.to(w.dtype)).unsqueeze(-1)
        return w


class LoraGroupedQKVLinear(GroupedQKVLinear):
    """:class:`GroupedQKVLinear` with an adapter: ``lora_A`` [r, in] replicated over TP; ``lora_B`` / ``lora_magnitude``
    the query rows (sharded), ``kv_lora_B`` / ``kv_lora_magnitude`` the group's k/v rows (replicated over the kv
    group, gradients summed over it), stored as one ``lora_B`` / ``lora_magnitude`` tensor as ``weight`` is."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.tp_group, tensor_parallel_output_grad=True)
        else:
            x = copy_to_tensor_model_parallel_region(x, self.tp_group)

        def rows(q, kv):  # [q_local; k; v] of this rank's group, the k/v part's gradient summed over the group
            return torch.cat([q, copy_to_tensor_model_parallel_region(kv, self.kv_group)])

        bias = None if self.bias is None else rows(self.bias, self.kv_bias)
        magnitude = None
        if hasattr(self, "lora_magnitude"):
            magnitude = rows(self.lora_magnitude, self.kv_lora_magnitude)
        return _column_lora(self, x, rows(self.weight, self.kv_weight), bias, rows(self.lora_B, self.kv_lora_B),
                            magnitude)


class LoraRowParallelLinear(RowParallelLinear):
    """:class:`RowParallelLinear` with an adapter: ``lora_A`` [r, in/tp] sharded as ``weight``'s columns,
    ``lora_B`` [out, r] and ``lora_magnitude`` [out] replicated. The low-rank term joins the partial sums before the
    reduction."""

    def _reduce(self, y):
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(y, self.tp_group)
        return reduce_from_tensor_model_parallel_region(y, self.tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, self.tp_group)
        cfg, magnitude = self.lora_config, getattr(self, "lora_magnitude", None)
        B = _summed(self.lora_B, self.tp_group)  # this rank's A_i x_i is a partial sum: so is B's gradient
        xd = _dropout(x, cfg.dropout, self.training, per_rank=True)
        base = F.linear(x, self.weight)  # [..., out], partial
        low = F.linear(F.linear(xd, self.lora_A), B) * cfg.scale
        bias = self.bias
        if bias is not None and self.sequence_parallel:
            bias = copy_to_tensor_model_parallel_region(bias, self.tp_group)  # sum grads of the seq shards
        if magnitude is None:
            y = self._reduce(base + low)
            return y if bias is None else y + bias
        norm = reduce_from_tensor_model_parallel_region(_squared_row_norms(self.weight, B, self.lora_A, cfg.scale),
                                                        self.tp_group).sqrt().to(magnitude.dtype)  # [out]
        if self.sequence_parallel:
            magnitude = copy_to_tensor_model_parallel_region(magnitude, self.tp_group)
        factor = magnitude / norm
        if xd is x:  # W x + (m/n - 1) W x + (m/n) s B A x = (m/n) (W x + s B A x)
            y = factor * self._reduce(base + low)
        else:  # three sums in one reduction: W x, W x', s B A x'
            out = base.shape[-1]
            y, base_d, low = self._reduce(torch.cat([base, F.linear(xd, self.weight), low], -1)).split(out, -1)
            y = y + ((factor - 1) * base_d + factor * low)
        return y if bias is None else y + bias


class LoraGroupedExperts(GroupedExperts):
    """:class:`GroupedExperts` with an adapter per expert on each matrix: ``<param>_lora_A`` [E_l, r, in],
    ``<param>_lora_B`` [E_l, out, r] (this EP rank's experts, as the matrices)."""

    def forward(self, x: torch.Tensor, counts: list[int], token_group=None) -> torch.Tensor:
        cfg = self.lora_config
        names = (self.w1_name, "down_proj")
        w = {n: _summed(getattr(self, n), token_group) for n in names}
        A = {n: _summed(getattr(self, f"{n}_lora_A"), token_group) for n in names}
        B = {n: _summed(getattr(self, f"{n}_lora_B"), token_group) for n in names}

        def linear(h, n, e):
            low = F.linear(F.linear(_dropout(h, cfg.dropout, self.training, per_rank=False), A[n][e]), B[n][e])
            return F.linear(h, w[n][e]) + low * cfg.scale

        def expert(h, e):
            a = linear(h, self.w1_name, e)
            if self.swiglu:
                gate, up = a.chunk(2, dim=-1)
                a = F.silu(gate) * up
            else:
                a = F.gelu(a, approximate="tanh")
            return linear(a, "down_proj", e)

        # Every expert runs, even on no rows, as the base layer (the same backward collectives on all ranks).
        return torch.cat([expert(chunk, e) for e, chunk in enumerate(x.split(counts))], dim=0)


# ---------------------------------------------------------------------------------------------------------------
# Adding adapters to a built model
# ---------------------------------------------------------------------------------------------------------------


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))


def _kaiming(shape, gen: torch.Generator) -> torch.Tensor:
    """``nn.Linear``'s (and PEFT's) init of A: kaiming-uniform with a = sqrt(5), U(+-1/sqrt(in)), fan-in = in."""
    bound = 1.0 / math.sqrt(shape[-1])
    return torch.empty(shape, dtype=torch.float32).uniform_(-bound, bound, generator=gen)


def _param(value: torch.Tensor, like: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(value.to(device=like.device, dtype=like.dtype))


def _copy_expert_attrs(p: nn.Parameter, base: nn.Parameter) -> None:
    for attr in ("expert_parallel", "partition_dim", "num_experts", "model_parallel"):
        if hasattr(base, attr):
            setattr(p, attr, getattr(base, attr))


def _add_column(layer: ColumnParallelLinear, cfg: LoraConfig, gen) -> None:
    r, stride = cfg.r, getattr(layer.weight, "partition_stride", 1)
    layer.lora_A = _param(_kaiming((r, layer.input_size), gen), layer.weight)  # replicated over TP
    layer.lora_B = _param(torch.zeros(layer.weight.shape[0], r), layer.weight)
    set_tensor_model_parallel_attributes(layer.lora_B, 0, stride)
    _same_rows(layer.lora_B, layer.weight)
    if cfg.dora:  # m = ||W + s B A|| = ||W|| (B = 0): the base model
        layer.lora_magnitude = _param(_squared_row_norms(layer.weight, layer.lora_B, layer.lora_A, cfg.scale).sqrt(),
                                      layer.weight)
        set_tensor_model_parallel_attributes(layer.lora_magnitude, 0, stride)
        _same_rows(layer.lora_magnitude, layer.weight)
    layer.__class__ = LoraColumnParallelLinear


def _same_rows(p, weight) -> None:
    """A tensor stored with its weight's rows (a vocabulary-padded weight: only the unpadded rows are stored)."""
    if hasattr(weight, "unpadded_size"):
        p.unpadded_size = weight.unpadded_size


def _add_grouped_qkv(layer: GroupedQKVLinear, cfg: LoraConfig, gen) -> None:
    r = cfg.r
    layer.lora_A = _param(_kaiming((r, layer.input_size), gen), layer.weight)
    pairs = [("lora_B", "kv_lora_B")] + ([("lora_magnitude", "kv_lora_magnitude")] if cfg.dora else [])
    for q_name, kv_name in pairs:
        if q_name == "lora_B":
            q, kv = torch.zeros(layer.weight.shape[0], r), torch.zeros(layer.kv_weight.shape[0], r)
        else:
            q = _squared_row_norms(layer.weight, layer.lora_B, layer.lora_A, cfg.scale).sqrt()
            kv = _squared_row_norms(layer.kv_weight, layer.kv_lora_B, layer.lora_A, cfg.scale).sqrt()
        setattr(layer, q_name, _param(q, layer.weight))
        setattr(layer, kv_name, _param(kv, layer.kv_weight))
        qp, kvp = getattr(layer, q_name), getattr(layer, kv_name)
        for p, base in ((qp, layer.weight), (kvp, layer.kv_weight)):  # stored as one tensor, as W is
            set_tensor_model_parallel_attributes(p, 0)
            p.tensor_model_parallel = base.tensor_model_parallel
            for attr in ("kv_replicas", "stored_size", "stored_rows"):
                if hasattr(base, attr):
                    setattr(p, attr, getattr(base, attr))
            p.stored_name = q_name
    layer.__class__ = LoraGroupedQKVLinear


def _add_row(layer: RowParallelLinear, cfg: LoraConfig, gen) -> None:
    r = cfg.r
    A = shard_master_weight(_kaiming((r, layer.input_size), gen), 1, layer.tp_rank, layer.tp_world_size)
    layer.lora_A = _param(A, layer.weight)
    set_tensor_model_parallel_attributes(layer.lora_A, 1)
    layer.lora_B = _param(torch.zeros(layer.output_size, r), layer.weight)  # replicated over TP
    if cfg.dora:
        sq = _squared_row_norms(layer.weight, layer.lora_B, layer.lora_A, cfg.scale)
        layer.lora_magnitude = _param(reduce_from_tensor_model_parallel_region(sq, layer.tp_group).sqrt(),
                                      layer.weight)
    layer.__class__ = LoraRowParallelLinear


def _add_experts(layer: GroupedExperts, cfg: LoraConfig, gen) -> None:
    r, E_l = cfg.r, layer.num_local_experts
    for name in (layer.w1_name, "down_proj"):
        base = getattr(layer, name)  # [E_l, out, in]
        E = getattr(base, "num_experts", E_l)
        master = _kaiming((E, r, base.shape[2]), gen)  # every expert's A, drawn whole: the same at any ep
        A = master[layer.first_expert:layer.first_expert + E_l].clone()
        for suffix, value in (("lora_A", A), ("lora_B", torch.zeros(E_l, base.shape[1], r))):
            p = _param(value, base)
            _copy_expert_attrs(p, base)
            setattr(layer, f"{name}_{suffix}", p)
    layer.__class__ = LoraGroupedExperts


def lora_targets(model: nn.Module) -> dict[str, tuple[str, nn.Module]]:
    """The modules of ``model`` an adapter can go on: module path -> (target name, layer)."""
    found = {}
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, (ColumnParallelLinear, GroupedQKVLinear)) and leaf == "qkv":
            found[name] = ("qkv", module)
        elif isinstance(module, RowParallelLinear) and leaf == "dense":
            found[name] = ("dense", module)
        elif isinstance(module, GPTMLP):
            found[f"{name}.fc1"] = ("fc1", module.fc1)
            found[f"{name}.fc2"] = ("fc2", module.fc2)
        elif isinstance(module, GPTMoE):
            found[f"{name}.experts"] = ("experts", module.experts)
        elif isinstance(module, GPTLMHead):
            found[f"{name}.linear"] = ("lm_head", module.linear)
    return found


def apply_lora(model: nn.Module, config: LoraConfig, seed: int = 0) -> list[str]:
    """Freeze every parameter of ``model`` (its base weights loaded) and add ``config``'s adapters in place; returns
    the adapted modules' paths. Call it before ``deepspeed.initialize``. Collective over TP with DoRA (a row-parallel
    magnitude's norm). A model already adapted is refused."""
    if any(is_adapter(n) for n, _ in model.named_parameters()):
        raise ValueError("this model already has adapters (lora_A / lora_B parameters); apply lora once")
    if "embedding" in config.targets:
        raise ValueError("lora.targets 'embedding' is not supported yet; remove it (the LM head: 'lm_head', untied)")
    for p in model.parameters():
        p.requires_grad_(False)
    adders = {ColumnParallelLinear: _add_column, GroupedQKVLinear: _add_grouped_qkv, RowParallelLinear: _add_row,
              GroupedExperts: _add_experts}
    adapted = []
    for name, (target, layer) in lora_targets(model).items():
        if target not in config.targets:
            continue
        layer.lora_config = config
        adders[next(k for k in adders if type(layer) is k)](layer, config, _generator(seed, name))
        adapted.append(name)
    _inputs_require_grad(model)
    return adapted


def _inputs_require_grad(model: nn.Module) -> None:
    """The embedding's output requires grad though its weight is frozen: a block recomputed by a reentrant
    checkpoint passes gradients to its parameters (the adapters) only when its input requires grad (HF's
    ``enable_input_require_grads``)."""
    def hook(module, args, out):
        if torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.is_floating_point() \
                and not out.requires_grad:
            return out.requires_grad_(True)
        return out

    for module in model.modules():
        if isinstance(module, GPTEmbedding):
            module.register_forward_hook(hook)


def adapter_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The adapter tensors of ``model`` by name (what trains)."""
    return {n: p for n, p in model.named_parameters() if is_adapter(n)}

"""Key tables: one :class:`Row` per zoo tensor, and the pure transforms between HF's layout and zoo's.

A row names one zoo tensor, the HF (transformers or diffusers) tensors it is made from, their shapes where the table
knows them, and the two transforms. ``{}`` in a key is filled per block: :meth:`Row.at` for a transformer block
(zoo's layer ``i + 1``, layer 0 being the embedding; HF's block ``i``), :meth:`Row.fill` for anything else (a
diffusers unit's layer index and module path). Every transform is data movement (transpose, split, concatenate,
stack), so HF -> zoo -> HF is bit-exact; each inverse sits next to its transform.
Notation: h hidden, f intermediate, nq/nkv query/key-value heads, d head dim, E experts, I expert width.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch


def same(w):
    """Same layout on both sides."""
    return w


def transpose(w):
    """HF GPT-2's Conv1D stores [in, out]; zoo's linear layers are nn.Linear, [out, in]. Its own inverse."""
    return w.t()


def qkv_groups(q, k, v, cfg):
    """Separate Q [nq*d], K [nkv*d], V [nkv*d] (rows) -> zoo's fused QKV, one block per key-value group:
    [q heads g*nq/nkv ... (g+1)*nq/nkv - 1, k head g, v head g] for g < nkv (Megatron's layout, so a
    contiguous TP split hands each rank whole groups). ``cfg``: anything with head_dim, num_attention_heads and
    num_key_value_heads."""
    d, nq, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    rest = q.shape[1:]  # () for a bias, (h,) for a weight
    q = q.reshape(nkv, nq // nkv * d, *rest)
    k = k.reshape(nkv, d, *rest)
    v = v.reshape(nkv, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)  # [nkv * (nq/nkv + 2) * d, ...]


def qkv_ungroup(w, cfg):
    """zoo's fused QKV -> (Q [nq*d], K [nkv*d], V [nkv*d]), the inverse of :func:`qkv_groups`."""
    d, nq, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    rest = w.shape[1:]
    w = w.reshape(nkv, (nq // nkv + 2) * d, *rest)  # [nkv, (q_per_group + 2) * d, ...]
    q, k, v = w.split([nq // nkv * d, d, d], dim=1)
    return q.reshape(nq * d, *rest), k.reshape(nkv * d, *rest), v.reshape(nkv * d, *rest)


def concat_qkv(q, k, v):
    """Separate q, k, v ``[C, ...]`` -> one ``[3C, ...]`` = [q; k; v] by rows (diffusers' attention -> zoo's qkv,
    which ``ParallelConvAttention`` shards with stride 3)."""
    return torch.cat([q, k, v], dim=0)


def split_qkv(w):
    """The inverse of :func:`concat_qkv` (clones: safetensors refuses shared views)."""
    return tuple(t.clone() for t in w.chunk(3, dim=0))


def cat_gate_up(gate, up):
    """zoo's SwiGLU fc1 is [gate; up]: silu(gate x) * up x."""
    return torch.cat([gate, up], dim=0)


def split_gate_up(w):
    return tuple(w.chunk(2, dim=0))


def stack_gate_up(*ws):
    """[gate_0, up_0, gate_1, up_1, ...] (each [I, h]) -> zoo's experts [E, 2I, h], rows [gate; up] per expert."""
    return torch.stack([torch.cat(ws[j:j + 2], dim=0) for j in range(0, len(ws), 2)])


def unstack_gate_up(w):
    return tuple(t for expert in w for t in expert.chunk(2, dim=0))


def stack(*ws):
    """[down_0, down_1, ...] (each [h, I]) -> [E, h, I]."""
    return torch.stack(ws)


def unstack(w):
    return tuple(w.unbind(0))


@dataclass(frozen=True)
class Row:
    """One zoo tensor made from one or more HF tensors. ``to_hf`` returns a tensor or a tuple (one per HF key).
    ``hf_shapes`` may be empty where the shapes come from the model instead (diffusers)."""

    zoo: str
    hf: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...] = ()
    to_zoo: Callable = same
    to_hf: Callable = same

    def fill(self, zoo_index, hf_index) -> Row:
        """The row with ``{}`` filled in: ``zoo_index`` in the zoo key, ``hf_index`` in the HF keys."""
        return Row(self.zoo.format(zoo_index), tuple(k.format(hf_index) for k in self.hf), self.hf_shapes,
                   self.to_zoo, self.to_hf)

    def at(self, i: int | None) -> Row:
        """Block ``i``'s row: zoo's layer ``i + 1`` (layer 0 is the embedding), HF's block ``i``."""
        return self if i is None else self.fill(i + 1, i)

    def with_hf(self, keys: tuple[str, ...]) -> Row:
        return Row(self.zoo, tuple(keys), self.hf_shapes, self.to_zoo, self.to_hf)

    def hf_tensors(self, zoo_tensor) -> tuple:
        out = self.to_hf(zoo_tensor)
        return out if isinstance(out, tuple) else (out,)

    def zoo_shape(self) -> tuple[int, ...]:
        """The zoo tensor's shape, found by running ``to_zoo`` on meta tensors of the HF shapes."""
        return tuple(self.to_zoo(*(torch.empty(s, device="meta") for s in self.hf_shapes)).shape)


def blocks(table: list[Row], num_layers: int) -> Iterator[list[Row]]:
    """The table's rows with ``{}`` filled in, grouped so a group can be converted at once: the rows before the
    first per-block row, then one group per block, then the rest."""
    per_block = [r for r in table if "{}" in r.zoo]
    first = table.index(per_block[0])
    yield table[:first]
    for i in range(num_layers):
        yield [r.at(i) for r in per_block]
    yield [r for r in table[first:] if "{}" not in r.zoo]


def rows_of(groups) -> list[Row]:
    """Every row of ``groups``, in conversion order."""
    return [r for g in groups for r in g]

"""Bytes and calls of every collective a process issues, by process group and kind (``comm_bytes`` in metrics).

A stray collective costs nothing on 2 CPU ranks and minutes on a cluster; counting them makes it a failing test
(tests/parallel/test_comm_count.py holds zoo's GPT to the closed forms of Megatron's tensor, sequence and pipeline
parallelism and DeepSpeed's ZeRO stages).

``CommCounter`` wraps the collectives of ``torch.distributed`` while it is active: zoo's TP/SP/EP/CP primitives
(``zoo.parallel.mappings``), DeepSpeed's ZeRO reductions and its pipeline's point-to-point messages all end there.
Two callers keep their own reference to a collective (``zoo.parallel.mappings`` and DeepSpeed's torch backend,
for the single-tensor all-gather and reduce-scatter); the counter swaps those too, and restores everything on exit.
Collectives that run inside an outer one (``all_gather_object`` calls ``all_gather``) are counted once, as the
outer call, because torch calls them through its internal module, not the public names wrapped here.

Bytes are the size of the buffer the collective is about, the figure the closed forms use: the tensor of an
all-reduce, broadcast, send or receive; the gathered output of an all-gather; the input of a reduce-scatter and of
an all-to-all. A group is named from the grid (``tp``, ``cp``, ``ep``, ``edp``, ``dp`` (DeepSpeed's data-parallel
group, dp x cp), ``pp``, ``tpsub<n>`` (runs of n TP ranks sharing a replicated kv head), ``world``), first by
identity, then by its ranks; point-to-point messages are named by the pipeline group when the peer is in it.
Counting adds one Python call per collective and nothing else, so it stays
on in every run: 1.6-2.4 us of bookkeeping per collective (measured on 2 loaded CPU cores, torch 2.13), against
configs/gpt/tiny.yaml's steps on 2 ranks: at tp=2, 47 collectives, 0.1% of a step's ~80 ms of CPU; at dp=2 ZeRO-1,
6 collectives, 0.02% (alternating blocks of steps with and without it: no difference above the noise). It would
reach 1% only where a step takes under ~8 ms per 47 collectives.
"""

from __future__ import annotations

import functools
from collections import defaultdict

import torch
import torch.distributed as dist

# name -> (kind, how to find the buffer: argument position and keyword)
_WRAPPED = {
    "all_reduce": ("all_reduce", 0, "tensor"),
    "all_reduce_coalesced": ("all_reduce", 0, "tensors"),
    "reduce": ("reduce", 0, "tensor"),
    "broadcast": ("broadcast", 0, "tensor"),
    "all_gather": ("all_gather", 0, "tensor_list"),
    "all_gather_into_tensor": ("all_gather", 0, "output_tensor"),
    "_all_gather_base": ("all_gather", 0, "output_tensor"),
    "all_gather_single": ("all_gather", 0, "output_tensor"),
    "reduce_scatter": ("reduce_scatter", 1, "input_list"),
    "reduce_scatter_tensor": ("reduce_scatter", 1, "input"),
    "_reduce_scatter_base": ("reduce_scatter", 1, "input"),
    "reduce_scatter_single": ("reduce_scatter", 1, "input"),
    "all_to_all_single": ("all_to_all", 1, "input"),
    "all_to_all": ("all_to_all", 1, "input_tensor_list"),
    "send": ("send", 0, "tensor"),
    "recv": ("recv", 0, "tensor"),
    "batch_isend_irecv": ("p2p", 0, "p2p_op_list"),
    "barrier": ("barrier", None, None),
}
_PEER = {"send": (1, "dst"), "recv": (1, "src")}
# isend / irecv stay unwrapped: P2POp checks that its op *is* one of them (ring attention's batch_isend_irecv);
# the batch is counted message by message instead.


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def _arg(args, kwargs, position, keyword):
    if keyword in kwargs:
        return kwargs[keyword]
    return args[position] if position is not None and len(args) > position else None


class CommCounter:
    """``with CommCounter(grid) as comm: ...; comm.take()`` -> ``({"tp/all_reduce": bytes, ...}, {... calls})``
    of the collectives since the last ``take``. ``grid`` (a ``zoo.parallel.topology.ParallelGrid``) names the
    groups; without one every group is named by its ranks."""

    def __init__(self, grid=None):
        self.grid = grid
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self._saved: list = []
        self._names = self._group_names(grid)
        self._by_ranks: dict = {}

    @staticmethod
    def _group_names(grid) -> list:
        if grid is None:
            return []
        axes = [("tp", grid.tp_group, grid.tp_ranks), ("cp", grid.cp_group, grid.cp_ranks),
                ("ep", grid.ep_group, grid.ep_ranks), ("edp", grid.edp_group, grid.edp_ranks),
                ("dp", grid.get_data_parallel_group(), grid._data.ranks),
                ("pp", grid.pp_group, grid.pp_ranks)]
        # runs of consecutive TP ranks sharing a replicated kv head (tp > kv heads): "tpsub2" for runs of 2
        axes += [(f"tpsub{size}", group, ranks) for size, group, ranks in getattr(grid, "tp_subgroups", list)()]
        if grid.ep == 1:  # no expert groups: the expert-data-parallel group is the data-parallel one
            axes = [axis for axis in axes if axis[0] not in ("ep", "edp")]
        return [(name, group, tuple(sorted(ranks))) for name, group, ranks in axes if group is not None]

    def name_of(self, group) -> str:
        if group is None or group is dist.group.WORLD:
            ranks = tuple(range(dist.get_world_size()))
        else:
            for name, g, _ in self._names:
                if g is group:
                    return name
            ranks = tuple(sorted(dist.get_process_group_ranks(group)))
        if ranks not in self._by_ranks:
            names = [name for name, _, r in self._names if r == ranks]
            self._by_ranks[ranks] = names[0] if names else ("world" if len(ranks) == dist.get_world_size()
                                                             else "ranks" + "_".join(map(str, ranks)))
        return self._by_ranks[ranks]

    def _peer_name(self, peer, group=None) -> str:
        """A message's group: the one it was sent in, else the pipeline's when the peer (a global rank) is in it."""
        if group is not None:
            return self.name_of(group)
        if self.grid is not None and self.grid.pp > 1 and peer in self.grid.pp_ranks:
            return "pp"
        return "p2p"

    @torch.compiler.disable  # bookkeeping: no graph of a compiled block guards on (or recompiles for) its counts
    def record(self, fn_name: str, args, kwargs) -> None:
        kind, position, keyword = _WRAPPED[fn_name]
        if fn_name == "batch_isend_irecv":
            for op in _arg(args, kwargs, position, keyword) or []:
                key = f"{self._peer_name(op.peer, op.group)}/{'send' if op.op is dist.isend else 'recv'}"
                self.bytes[key] += _nbytes(op.tensor)
                self.calls[key] += 1
            return
        if fn_name in _PEER:
            where = self._peer_name(_arg(args, kwargs, *_PEER[fn_name]))
        else:
            where = self.name_of(kwargs.get("group"))
        key = f"{where}/{kind}"
        self.bytes[key] += _nbytes(_arg(args, kwargs, position, keyword)) if position is not None else 0
        self.calls[key] += 1

    def _wrap(self, fn_name: str, fn):
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            self.record(fn_name, args, kwargs)
            return fn(*args, **kwargs)

        counted._zoo_counted = True
        return counted

    def _swap(self, owner, attr: str, fn_name: str) -> None:
        fn = getattr(owner, attr, None)
        if fn is None or getattr(fn, "_zoo_counted", False):
            return
        self._saved.append((owner, attr, fn))
        setattr(owner, attr, self._wrap(fn_name, fn))

    def __enter__(self) -> CommCounter:
        originals = {name: getattr(dist, name) for name in _WRAPPED if hasattr(dist, name)}
        for name in originals:
            self._swap(dist, name, name)
        from zoo.parallel import mappings

        for attr in ("_all_gather_single", "_reduce_scatter_single"):
            fn = getattr(mappings, attr)
            name = next((n for n, f in originals.items() if f is fn), None)
            if name is not None:
                self._swap(mappings, attr, name)
        from zoo.compat.deepspeed import comm_backend

        # DeepSpeed's torch backend keeps the all-gather / reduce-scatter it picked at start-up
        backend = comm_backend()
        for attr in ("all_gather_function", "reduce_scatter_function"):
            fn = getattr(backend, attr, None) if backend is not None else None
            name = next((n for n, f in originals.items() if f is fn), None)
            if name is not None:
                self._swap(backend, attr, name)
        return self

    def __exit__(self, *exc) -> None:
        for owner, attr, fn in reversed(self._saved):
            setattr(owner, attr, fn)
        self._saved.clear()

    def take(self) -> tuple[dict, dict]:
        """Bytes and calls by ``group/kind`` since the last take (sorted by key), and start counting afresh."""
        out = dict(sorted(self.bytes.items())), dict(sorted(self.calls.items()))
        self.bytes.clear()
        self.calls.clear()
        return out

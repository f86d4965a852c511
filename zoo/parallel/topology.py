"""One process grid for tensor x context x data x pipeline parallelism, with expert parallelism inside data
parallelism.

The grid is DeepSpeed's ``PipeModelDataParallelTopology(num_pp, num_mp=tp, num_dp)``. Its axes are
``(pipe, data, model)`` with ``model`` (= tensor parallel) varying fastest, so the ranks of one TP group are
adjacent, as Megatron places them inside a node (TP traffic is the heaviest). For 8 ranks at tp=2, pp=2:

    rank:  0 1 2 3 4 5 6 7
    pipe:  0 0 0 0 1 1 1 1
    data:  0 0 1 1 0 0 1 1
    tp:    0 1 0 1 0 1 0 1

Expert parallelism (ep, which must divide dp) lives inside data parallelism, in the order of DeepSpeed's
``deepspeed.utils.groups``: each data-parallel group is cut into consecutive chunks of ep ranks, the EP groups
(together they hold one MoE layer's experts, E/ep each, and exchange tokens); the ranks at the same place of
those chunks, strided, form the expert-data-parallel (EDP) groups (they hold the same experts and average their
gradients). For 8 ranks at tp=2, pp=1, ep=2 (dp=4; DP groups [0,2,4,6] [1,3,5,7]):

    rank:  0 1 2 3 4 5 6 7
    data:  0 0 1 1 2 2 3 3
    tp:    0 1 0 1 0 1 0 1
    ep:    0 0 1 1 0 0 1 1     EP groups  [0,2] [4,6] [1,3] [5,7]
    edp:   0 0 0 0 1 1 1 1     EDP groups [0,4] [2,6] [1,5] [3,7]

With ``ep_spans_tp`` (Megatron-Core's "parallel folding") an EP group is ep / tp data-parallel places with their
whole TP groups, TP rank fastest, so the TP ranks hold different experts; the same 8 ranks at ep=2 give EP groups
[0,1] [2,3] [4,5] [6,7] (each TP group) and EDP groups [0,2,4,6] [1,3,5,7]; at ep=4, [0,1,2,3] [4,5,6,7] and
[0,4] [1,5] [2,6] [3,7].

``ParallelGrid`` builds every group once and doubles as the ``mpu`` object DeepSpeed expects
(``deepspeed.initialize(mpu=grid)``, ``checkpointing.configure(mpu_=grid)``). Following DeepSpeed's own
``PipelineParallelGrid``, "model parallel" there means pipe x tensor; "tensor model parallel" is TP alone.
With ep > 1 the grid also puts its EP and EDP groups into DeepSpeed's own caches (``deepspeed.utils.groups``,
under the name ``ep_size_<ep>``), which DeepSpeed's MoE-aware gradient reduction and ZeRO partitioning read, so
DeepSpeed reduces expert gradients over exactly these groups.

Context parallelism (cp > 1, :mod:`zoo.parallel.context_parallel`) lives inside DeepSpeed's data axis. The
topology is built with ``num_dp = dp x cp``, and data index ``i = dp_rank x cp + cp_rank``: the cp ranks of one
replica are consecutive data indices (CP groups), the true data-parallel groups take every cp-th one. Rank order is
tp fastest, then cp, then dp, then pp: TP's blocking all-reduces are the heaviest traffic, CP's per-layer ring
sends or all-to-alls come next (so CP groups sit beside TP inside a node), DP's one gradient reduction per step
overlaps with compute, and pipeline stages exchange only activations. For 8 ranks at tp=2, cp=2 (dp=2, pp=1):

    rank:   0 1 2 3 4 5 6 7
    data:   0 0 1 1 2 2 3 3     DeepSpeed's data axis, dp x cp
    dp:     0 0 0 0 1 1 1 1     true data parallelism: which samples
    cp:     0 0 1 1 0 0 1 1     which part of each sequence
    tp:     0 1 0 1 0 1 0 1

    TP groups {0,1} {2,3} {4,5} {6,7}; CP groups {0,2} {1,3} {4,6} {5,7}; DP groups {0,4} {1,5} {2,6} {3,7};
    DeepSpeed's data-parallel groups (dp x cp) {0,2,4,6} {1,3,5,7}.

With both, ep divides the true dp: EP groups are chunks of the true DP groups (ranks that read different samples
exchange tokens), and an EDP group holds the ranks at its place in the CP ranks' chunks too, (dp / ep) x cp ranks,
since CP ranks hold the same experts. At tp=1, cp=2, ep=2 on 4 ranks (dp=2): EP groups [0,2] [1,3], EDP groups
[0,1] [2,3]. Expert gradients are then reduced over EDP and divided, as every gradient, by DeepSpeed's dp x cp.

Two meanings of "data parallel", kept apart on purpose:

- ``grid.dp``, ``grid.dp_rank``, ``grid.dp_group`` are the *true* data parallelism (different samples): data loading
  and the logged loss use them; the cp ranks of a replica read the same samples and split each sequence.
- the mpu's ``get_data_parallel_group/world_size/rank`` (what DeepSpeed reduces gradients over, partitions ZeRO
  over and counts ``train_batch_size`` with) are the dp x cp group: parameters are replicated over CP, and each cp
  rank's gradient is one share of the sequence's loss whose *average* over CP is the whole gradient (``GPTLoss``).

At cp = 1 both are the same group and the grid is exactly the (tp, pp, dp) grid; ``cp_group`` is then None.

Layers never read the grid while running: they take ``tp_group=None`` and resolve it once, when built, through
:func:`get_tensor_model_parallel_group` (``None`` when no grid exists, i.e. a single process).
"""

from __future__ import annotations

import atexit
import gc
import os
import weakref
from dataclasses import dataclass

import torch.distributed as dist


class LayoutError(ValueError):
    """A parallel layout that cannot be built; the message is one line naming the numbers and the fix."""


def check_layout(world_size: int, tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1, ep_spans_tp: bool = False) -> int:
    """Validate a (world size, tp, pp, ep, cp) layout and return the (true) data-parallel size. ``ep_spans_tp``:
    the EP groups take in the TP ranks (Megatron-Core's MoE "parallel folding"), so tp must divide ep and ep / tp
    the data-parallel size."""
    for name, value in (("tp", tp), ("pp", pp), ("ep", ep), ("world size", world_size)):
        if not isinstance(value, int) or value < 1:
            raise LayoutError(f"{name} must be a positive integer, got {value!r}")
    _check_context_layout(world_size, tp, pp, cp)
    if world_size % (tp * pp):
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise LayoutError(
            f"world size {world_size} is not divisible by tp*pp = {tp * pp}; "
            f"launch a multiple of {tp * pp} processes or pick tp*pp in {divisors}"
        )
    dp = world_size // (tp * pp * cp)
    if ep_spans_tp:
        divisors = [tp * d for d in range(1, dp + 1) if dp % d == 0]
        if ep % tp:
            raise LayoutError(f"ep {ep} is not a multiple of tp {tp}: with parallel.ep_spans_tp each EP group holds "
                              f"whole TP groups; pick ep in {divisors}")
        if dp % (ep // tp):
            raise LayoutError(f"ep / tp = {ep // tp} does not divide the data-parallel size {dp} (world size "
                              f"{world_size} / tp*pp {tp * pp}" + (f" / cp {cp}" if cp > 1 else "")
                              + f"); with parallel.ep_spans_tp pick ep in {divisors}")
        return dp
    if dp % ep:
        divisors = [d for d in range(1, dp + 1) if dp % d == 0]
        raise LayoutError(
            f"ep {ep} does not divide the data-parallel size {dp} (world size {world_size} / tp*pp {tp * pp}"
            + (f" / cp {cp}" if cp > 1 else "") + "); expert-parallel groups are carved out of the data-parallel "
            f"ranks: pick ep in {divisors} or launch a multiple of {'tp*cp*pp*ep' if cp > 1 else 'tp*pp*ep'} = "
            f"{tp * pp * ep * cp} processes"
            + (", or set parallel.ep_spans_tp: true or --ep-spans-tp (EP groups over the TP ranks too)"
               if tp > 1 and ep % tp == 0 and dp % (ep // tp) == 0 else "")
        )
    return dp


def expert_parallel_rank_lists(data_parallel_lists, ep: int, cp: int = 1, tp: int = 1) -> tuple[list, list]:
    """(EP groups, EDP groups) as rank lists: each data-parallel group cut into consecutive chunks of ep ranks,
    and the ranks at the same place of those chunks (DeepSpeed's ``_get_expert_parallel_ranks``). With cp > 1 the
    lists are the true data-parallel groups, each run of ``cp`` of them one replica's CP ranks (as
    ``ParallelGrid`` orders them); the CP ranks hold the same experts, so an EDP group takes the ranks at its place
    in all of them: (dp / ep) x cp ranks. With ``tp`` > 1 (EP spanning TP, "parallel folding"; the lists of one
    pipeline stage ordered by TP rank, each with its run of cp) an EP group is ep / tp data-parallel places, each
    with all its TP ranks (TP rank fastest), and the EDP groups are (dp tp / ep) x cp ranks."""
    ep_lists, edp_lists = [], []
    per_tp = ep // tp  # data-parallel places per EP group
    for first in range(0, len(data_parallel_lists), tp * cp):  # one pipeline stage's (tp, cp) lists at a time
        block = data_parallel_lists[first:first + tp * cp]
        chunks = [[block[t * cp + c][j + i] for i in range(per_tp) for t in range(tp)]
                  for c in range(cp) for j in range(0, len(block[c]), per_tp)]
        ep_lists += chunks
        edp_lists += [sorted(chunk[place] for chunk in chunks) for place in range(ep)]
    return ep_lists, edp_lists


def _check_context_layout(world_size: int, tp: int, pp: int, cp: int) -> None:
    if not isinstance(cp, int) or cp < 1:
        raise LayoutError(f"cp must be a positive integer, got {cp!r}")
    if cp > 1 and world_size % (tp * cp * pp):
        raise LayoutError(f"world size {world_size} is not divisible by tp*cp*pp = {tp * cp * pp} "
                          f"(tp={tp}, cp={cp}, pp={pp}); launch a multiple of {tp * cp * pp} processes")


_AT_EXIT = False


def init_distributed(timeout_minutes: float | None = None) -> None:
    """Start torch.distributed once, under any launcher or none.

    ``deepspeed``, ``torchrun`` and Slurm/MPI launchers set RANK/WORLD_SIZE (or MPI variables DeepSpeed
    discovers). A plain ``python script.py`` sets nothing: it becomes a world of one process, so every code path
    (DeepSpeed engine included) runs unchanged on a laptop. The backend comes from the accelerator: nccl on CUDA,
    gloo (or ccl) on CPU.
    """
    if dist.is_available() and dist.is_initialized():
        return
    import deepspeed

    # torch.distributed.nn.functional binds ``group=group.WORLD`` as default arguments when it is imported, and
    # DeepSpeed imports it lazily (its Ulysses module) once the world group exists: those defaults would then hold
    # the world group, and its threads, until interpreter exit (the exit-time abort, destroy_model_parallel).
    # Imported before the group exists, they hold None (which means the world group too).
    import torch.distributed.nn  # noqa: F401
    from deepspeed.accelerator import get_accelerator

    global _AT_EXIT
    if not _AT_EXIT:  # atexit runs before finalization, while every module is still whole
        atexit.register(destroy_model_parallel)
        _AT_EXIT = True

    # A child of a plain process inherits the RANK/WORLD_SIZE=1 it set below; that is not a launcher speaking.
    inherited = os.environ.get("ZOO_WORLD_OF_ONE", str(os.getpid())) != str(os.getpid()) \
        and os.environ.get("WORLD_SIZE") == "1"
    launched = not inherited and any(v in os.environ for v in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE",
                                                               "SLURM_NTASKS"))
    kwargs = {}
    if timeout_minutes is not None:
        from datetime import timedelta

        kwargs["timeout"] = timedelta(minutes=timeout_minutes)
    if not launched:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", ZOO_WORLD_OF_ONE=str(os.getpid()))
        # DeepSpeed checks that these exist (else it tries MPI discovery); nothing listens on them.
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        # A world of one needs no rendezvous: an in-memory store, so no port is ever bound (no clash with other
        # processes on the machine). DeepSpeed then wraps the existing group.
        dist.init_process_group(get_accelerator().communication_backend_name(), store=dist.HashStore(), rank=0,
                                world_size=1, **kwargs)
    elif int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 and \
            os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # A group torchrun restarted (--max-restarts): its agent keeps one store for every attempt, and env://
        # adds no prefix, so the new ranks would read the dead attempt's addresses (gloo: "connection refused")
        # whenever they look before their peers have written theirs. Each attempt gets keys of its own.
        from datetime import timedelta

        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              int(os.environ["WORLD_SIZE"]), is_master=False,
                              timeout=kwargs.get("timeout", timedelta(minutes=10)))
        store = dist.PrefixStore(f"zoo/attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)
        dist.init_process_group(get_accelerator().communication_backend_name(), store=store,
                                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]), **kwargs)
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(), verbose=False, **kwargs)
    accel = get_accelerator()
    if accel.device_name() != "cpu":
        accel.set_device(int(os.environ.get("LOCAL_RANK", "0")))


@dataclass(frozen=True)
class _Axis:
    rank: int
    world_size: int
    group: object
    ranks: tuple


class ParallelGrid:
    """Process groups and ranks of one (tp, pp, dp, ep, cp) layout; also DeepSpeed's ``mpu`` interface."""

    def __init__(self, tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1, ep_spans_tp: bool = False):
        from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

        _EVERY_GRID.add(self)

        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized; "
                               "call zoo.parallel.topology.init_distributed() first")
        world_size = dist.get_world_size()
        self.tp, self.pp, self.ep, self.dp = tp, pp, ep, check_layout(world_size, tp, pp, ep, cp, ep_spans_tp)
        self.cp = cp
        self.ep_spans_tp = ep_spans_tp and tp > 1 and ep > 1  # the experts of one TP group's ranks differ
        self.world_size = world_size
        self.rank = dist.get_rank()
        self.topology = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=self.dp * cp)

        # Every rank must call new_group for every group, in the same order.
        self._tp = self._build_axis(self.topology.get_axis_comm_lists("model"))
        for size in range(2, tp):  # runs of consecutive TP ranks: the ranks sharing a replicated kv head
            if tp % size == 0:
                runs = [ranks[i:i + size] for ranks in self.topology.get_axis_comm_lists("model")
                        for i in range(0, tp, size)]
                setattr(self, f"_tp_sub{size}", self._build_axis(runs))
        self._pp = self._build_axis(self.topology.get_axis_comm_lists("pipe"))
        self._dp = self._build_axis(self.topology.get_axis_comm_lists("data"))
        mp_lists = [self.topology.filter_match(data=d) for d in range(self.dp * cp)]  # pipe x tensor, per replica
        self._mp = self._build_axis(mp_lists)
        self._data = self._dp  # DeepSpeed's data axis: dp x cp
        self._cp, self._dp, dp_lists = self._build_context_axes()
        if ep > 1:  # experts split over ranks that see different samples: the true data-parallel groups
            ep_lists, edp_lists = expert_parallel_rank_lists(dp_lists, ep, cp, tp if self.ep_spans_tp else 1)
            self._ep = self._build_axis(ep_lists)
            self._edp = self._build_axis(edp_lists)
            self.register_expert_groups()
        else:  # no expert parallelism: no EP group (layers take None), experts are averaged like any weight
            self._ep = _Axis(0, 1, None, (self.rank,))
            self._edp = self._data

    def _build_context_axes(self) -> tuple[_Axis, _Axis, list]:
        """(CP axis, true DP axis, the true DP rank lists), carved from DeepSpeed's data axis; at cp = 1: no CP
        group, DP = the data axis."""
        cp = self.cp
        data_lists = self.topology.get_axis_comm_lists("data")  # ranks ordered by data index = dp_rank * cp + cp_rank
        if cp == 1:
            return _Axis(0, 1, None, (self.rank,)), self._data, data_lists
        cp_axis = self._build_axis([ranks[i:i + cp] for ranks in data_lists for i in range(0, len(ranks), cp)])
        dp_lists = [ranks[c::cp] for ranks in data_lists for c in range(cp)]
        return cp_axis, self._build_axis(dp_lists), dp_lists

    def tp_subgroup(self, size: int):
        """The group of ``size`` consecutive TP ranks holding this rank (``size`` divides tp; built with the grid, the
        same on every rank): the ranks that share one key-value head when tp exceeds the kv heads. ``size`` tp: the
        TP group; 1: None (no communication)."""
        if size == 1:
            return None
        if size == self.tp:
            return self._tp.group
        axis = getattr(self, f"_tp_sub{size}", None)
        if axis is None:
            raise LayoutError(f"no TP subgroup of {size} ranks: {size} does not divide tp {self.tp}")
        return axis.group

    def tp_subgroups(self) -> list[tuple[int, object, tuple]]:
        """``(size, group, ranks)`` of this rank's every TP subgroup smaller than the TP group
        (:meth:`tp_subgroup`)."""
        return [(size, axis.group, axis.ranks) for size in range(2, self.tp)
                if (axis := getattr(self, f"_tp_sub{size}", None)) is not None]

    @property
    def expert_group_name(self) -> str:
        """DeepSpeed's name for the EP/EDP groups of this ep (``param.group_name`` of expert parameters)."""
        return f"ep_size_{self.ep}"

    def register_expert_groups(self) -> None:
        """Put this grid's EP and EDP groups into DeepSpeed's caches, where its MoE gradient reduction, ZeRO's
        expert partitioning and its MoE checkpoint code look them up by ``expert_group_name``."""
        if self.ep == 1:
            return
        from zoo.compat import deepspeed as ds_compat

        ds_compat.register_expert_groups(self.expert_group_name, self._ep.group, self._ep.ranks, self._edp.group,
                                         self._edp.ranks)

    def forget_groups(self) -> None:
        """Drop this grid's references to its process groups (ranks stay), so that a destroyed group's threads end
        now instead of at interpreter exit, where gloo's are torn down in no fixed order (the exit-time abort)."""
        for name, axis in list(vars(self).items()):
            if isinstance(axis, _Axis):
                setattr(self, name, _Axis(axis.rank, axis.world_size, None, axis.ranks))

    def _build_axis(self, rank_lists) -> _Axis:
        mine = None
        for ranks in rank_lists:
            group = dist.new_group(ranks=ranks) if self.world_size > 1 else dist.group.WORLD
            if self.rank in ranks:
                mine = _Axis(ranks.index(self.rank), len(ranks), group, tuple(ranks))
        assert mine is not None, f"rank {self.rank} is in no group of {rank_lists}"
        return mine

    # ---- names used across zoo ------------------------------------------------------------------------
    tp_rank = property(lambda self: self._tp.rank)
    pp_rank = property(lambda self: self._pp.rank)
    dp_rank = property(lambda self: self._dp.rank)
    tp_group = property(lambda self: self._tp.group)
    pp_group = property(lambda self: self._pp.group)
    dp_group = property(lambda self: self._dp.group)
    tp_ranks = property(lambda self: self._tp.ranks)
    pp_ranks = property(lambda self: self._pp.ranks)
    dp_ranks = property(lambda self: self._dp.ranks)
    ep_rank = property(lambda self: self._ep.rank)  # expert parallel: None group when ep == 1
    ep_group = property(lambda self: self._ep.group)
    ep_ranks = property(lambda self: self._ep.ranks)
    edp_rank = property(lambda self: self._edp.rank)  # expert data parallel: the DP group when ep == 1
    edp_group = property(lambda self: self._edp.group)
    edp_ranks = property(lambda self: self._edp.ranks)
    cp_rank = property(lambda self: self._cp.rank)
    cp_group = property(lambda self: self._cp.group)  # None at cp = 1
    cp_ranks = property(lambda self: self._cp.ranks)
    is_first_stage = property(lambda self: self._pp.rank == 0)
    is_last_stage = property(lambda self: self._pp.rank == self.pp - 1)

    def __repr__(self):
        return (f"ParallelGrid(rank={self.rank}, tp={self.tp_rank}/{self.tp}, pp={self.pp_rank}/{self.pp}, "
                f"dp={self.dp_rank}/{self.dp}, ep={self.ep_rank}/{self.ep}"
                + (f", cp={self.cp_rank}/{self.cp})" if self.cp > 1 else ")"))

    # ---- the mpu interface (DeepSpeed engine, ZeRO, activation checkpointing) ---------------------------
    def get_tensor_model_parallel_rank(self):
        return self._tp.rank

    def get_tensor_model_parallel_world_size(self):
        return self._tp.world_size

    def get_tensor_model_parallel_group(self):
        return self._tp.group

    get_slice_parallel_rank = get_tensor_model_parallel_rank
    get_slice_parallel_world_size = get_tensor_model_parallel_world_size
    get_slice_parallel_group = get_tensor_model_parallel_group

    def get_model_parallel_rank(self):
        return self._mp.rank

    def get_model_parallel_world_size(self):
        return self._mp.world_size

    def get_model_parallel_group(self):
        return self._mp.group

    # DeepSpeed's data parallelism is dp x cp (module docstring); zoo's own code uses dp_rank / dp_group.
    def get_data_parallel_rank(self):
        return self._data.rank

    def get_data_parallel_world_size(self):
        return self._data.world_size

    def get_data_parallel_group(self):
        return self._data.group

    def get_pipe_parallel_rank(self):
        return self._pp.rank

    def get_pipe_parallel_world_size(self):
        return self._pp.world_size

    def get_pipe_parallel_group(self):
        return self._pp.group

    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size
    get_pipeline_model_parallel_group = get_pipe_parallel_group

    def get_expert_parallel_rank(self):
        return self._ep.rank

    def get_expert_parallel_world_size(self):
        return self._ep.world_size

    def get_expert_parallel_group(self):
        return self._ep.group

    def get_expert_data_parallel_rank(self):
        return self._edp.rank

    def get_expert_data_parallel_world_size(self):
        return self._edp.world_size

    def get_expert_data_parallel_group(self):
        return self._edp.group


_GRIDS: dict[tuple[int, ...], ParallelGrid] = {}
_CURRENT: ParallelGrid | None = None
_EVERY_GRID: weakref.WeakSet[ParallelGrid] = weakref.WeakSet()  # also those a caller still holds


def initialize_model_parallel(tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1,
                              timeout_minutes: float | None = None, ep_spans_tp: bool = False) -> ParallelGrid:
    """Build (or reuse) the grid for this layout and make it the default for layers built afterwards.

    Starts torch.distributed first when needed (with ``timeout_minutes`` for every collective, if given), so it
    works in one plain process with no launcher. The layout is validated before any process group is created.
    """
    global _CURRENT
    if dist.is_available() and dist.is_initialized():
        check_layout(dist.get_world_size(), tp, pp, ep, cp, ep_spans_tp)
    else:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        check_layout(world, tp, pp, ep, cp, ep_spans_tp)
        init_distributed(timeout_minutes)
    ep_spans_tp = ep_spans_tp and tp > 1 and ep > 1  # a no-op otherwise: the same grid
    key = (tp, pp, ep, cp, ep_spans_tp)
    if key not in _GRIDS:
        _GRIDS[key] = ParallelGrid(tp, pp, ep, cp, ep_spans_tp)
    _CURRENT = _GRIDS[key]
    _CURRENT.register_expert_groups()  # another grid with this ep may have registered its own groups since
    return _CURRENT


def get_grid() -> ParallelGrid | None:
    """The grid made default by the last :func:`initialize_model_parallel`, or None in a plain process."""
    return _CURRENT


def destroy_model_parallel() -> None:
    """Tear down every process group and torch.distributed itself, and end their threads before returning.

    A gloo group's threads end only when the last reference to the group goes. Left to interpreter exit, that
    happens during finalization in no fixed order, and now and then a still-joinable ``std::thread`` is destroyed:
    the process prints ``terminate called without an active exception`` and aborts after it has done its work
    (about 3 runs in 8 on 2 ranks without it; .ci/clean_exits.py checks). So this also empties every grid ever built
    (the caller may still hold one: its groups read ``None`` afterwards) and DeepSpeed's group caches, then collects.
    zoo's entry points call it on every exit path, and :func:`init_distributed` registers it with ``atexit`` for scripts
    that do not.
    """
    global _CURRENT
    if dist.is_available() and dist.is_initialized():
        release_groups()
    for grid in list(_EVERY_GRID):
        grid.forget_groups()
    _GRIDS.clear()
    _CURRENT = None
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def release_groups() -> int:
    """Destroy every process group but the world's and forget what was built on them; return how many went.

    Each gloo group holds threads (and a store connection) until it is destroyed, and every ``deepspeed.initialize``
    of a pipeline adds a grid of its own. A process that builds many engines (a test worker, a notebook, a sweep)
    calls this between them; the world group and torch.distributed itself stay up. zoo's cached grids and
    DeepSpeed's group caches (``deepspeed.utils.groups``, the activation checkpointing ``mpu``) are cleared with
    them, so the next layout rebuilds its groups instead of using destroyed ones, and nothing keeps the destroyed
    groups (and their threads) alive.
    """
    global _CURRENT
    _GRIDS.clear()
    _CURRENT = None
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    from torch.distributed import distributed_c10d as c10d

    from zoo.compat import deepspeed as ds_compat
    from zoo.compat import torch as torch_compat

    ds_compat.clear_group_caches()  # deepspeed.utils.groups, activation checkpointing's mpu, the pipeline's p2p
    world = c10d.GroupMember.WORLD
    extra = [pg for pg in torch_compat.process_groups() if pg is not world]
    for pg in extra:
        dist.destroy_process_group(pg)
    # A group's threads end when its last reference goes, and engines that used it often sit in reference cycles.
    gc.collect()
    return len(extra)


def get_tensor_model_parallel_group():
    return None if _CURRENT is None else _CURRENT.tp_group


def tensor_parallel_subgroup(tp_group, size: int):
    """The run of ``size`` consecutive ranks of ``tp_group`` holding this rank (:meth:`ParallelGrid.tp_subgroup` of
    the grid that built ``tp_group``): ``tp_group`` itself when ``size`` is its size, None when 1."""
    world = group_rank_and_size(tp_group)[1]
    if size == 1:
        return None
    if size == world:
        return tp_group
    for grid in list(_EVERY_GRID):
        if grid.tp_group is tp_group and tp_group is not None:
            return grid.tp_subgroup(size)
    raise LayoutError(f"a TP subgroup of {size} of {world} ranks needs a TP group built by "
                      f"zoo.parallel.topology.initialize_model_parallel")


def group_rank_and_size(group) -> tuple[int, int]:
    """(rank, world size) in ``group``; (0, 1) for ``None`` or when torch.distributed is not running."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


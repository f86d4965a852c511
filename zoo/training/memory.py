"""Measured memory per rank: the engine's own tensors, and the activations the first step keeps for backward.

The layout planner predicts, for every rank of a layout, the bytes of parameters, gradients, optimizer state and
activations. This module measures the same four in a real run, on any machine (CPU included: nothing here needs an
allocator's statistics), so the prediction can be held against it. A run measures its first step (the first one
this process runs, also after a resume) and only that one: the hooks are removed when it ends, later steps cost
nothing. The measured step costs more (configs/gpt/tiny.yaml on 2 CPU ranks: +11% of its CPU time at tp=2, nothing
measurable at dp=2), once per run: under 0.04% of that run's 300 steps.

Bytes are counted by storage. A tensor counts as the whole storage it lives in, and a storage counts once however
many tensors view it (``untyped_storage().data_ptr()``), so DeepSpeed's flat buffers and the parameter and gradient
views into them count once, at the buffer's full size, padding included. Empty tensors and those on the meta device
count nothing; all others count wherever they live (CPU offload included).

``params``       after the first step, what the parameters hold: each parameter's data and, at ZeRO-3, its
                 partition ``ds_tensor``. The full parameters at ZeRO 0-2 (ZeRO-1/2: the flat ``bit16_groups_flat``
                 buffers the parameters are views of; BF16_Optimizer, bf16 at pp > 1: ``bf16_groups_flat``); at
                 ZeRO-3 the flat partition buffer ``lp_param_buffer`` plus the full data of the parameters it keeps
                 gathered (``ds_persist``: those under ``stage3_param_persistence_threshold``, 1e5 elements by
                 default, which is every parameter of the tiny models). Parameters ZeRO-3 gathers for one module's
                 forward or backward and releases after count nowhere.
``optimizer``    after the first step, what the inner torch optimizer holds: its state (Adam: ``exp_avg``,
                 ``exp_avg_sq`` and a 4-byte ``step`` per tensor it updates), and its parameters where they are not
                 the model's own, i.e. the fp32 master copies every DeepSpeed wrapper gives it instead: ZeRO-1/2's
                 ``single_partition_of_fp32_groups`` (also when training in fp32), ZeRO-3's
                 ``fp32_partitioned_groups_flat``, BF16_Optimizer's ``fp32_groups_flat_partition``,
                 FP16_UnfusedOptimizer's ``fp32_groups`` (bf16 without ZeRO at pp = 1). Without ZeRO in fp32 the
                 torch optimizer updates the model's parameters, so only its state counts. With
                 ``training.ema_decay`` also the weight average's fp32 copies (``zoo.training.ema``; the planner
                 prices them with the optimizer state: 4 bytes per parameter the rank holds).
``grads``        the peak over the first step of the gradients the engine holds: the parameters' ``.grad`` (and
                 ZeRO-1/2's ``grad_accum``), the fp32 masters' ``.grad`` during the step (a flat fp32 copy of the
                 partition's gradients, made group by group), and the buffers of :data:`GRADIENT_BUFFERS`, among them
                 BF16_Optimizer's gradient accumulators ``fp32_groups_gradients_flat`` (named fp32, held in
                 DeepSpeed's ``grad_accum_dtype``: bf16 unless configured) and DeepSpeed's reduction buckets:
                 ZeRO-1/2 allocates one of ``reduce_bucket_size`` elements (zoo sets it to the rank's parameters,
                 at most DeepSpeed's default 5e8: 2 GB in fp32, 1 GB in bf16) at the first gradient of a step, at
                 pp > 1 a second one for the reduction, and frees them when the step's gradients are reduced;
                 ZeRO-3 allocates its bucket with the optimizer and keeps it. The buckets' share of that peak is
                 also reported alone (``grad_buckets``). Sampled after every backward (after every instruction at
                 pp > 1), on entering and leaving each bucket reduction (``reduce_ipg_grads``,
                 ``independent_gradient_partition_epilogue``) and on entering the optimizer step and each inner
                 optimizer step. Between two samples one parameter's fresh gradient can exist
                 unseen (before the hook that copies it into the bucket frees it).
``activations``  the peak over the first step (forwards, backwards and optimizer step of all its micro-batches) of
                 the storages held for backward, counted as they come and go:
                 - every tensor autograd saves (``torch.autograd.graph.saved_tensors_hooks``: added when packed,
                   subtracted when autograd frees it), except parameters, views of parameters and the parameters
                   ZeRO-3 gathered; the token ids and labels that the embedding and the loss save count;
                 - with activation checkpointing, DeepSpeed's ``CheckpointFunction`` keeps each checkpointed block's
                   inputs outside autograd (``ctx.deepspeed_saved_tensors``; it never calls ``save_for_backward``)
                   with three generator states to replay its dropout (``ctx.fwd_cpu_rng_state``,
                   ``fwd_cuda_rng_state`` and the model-parallel tracker's states; a CPU generator's is 5,056
                   bytes): they count from the block's forward to the end of its backward. The recomputation inside
                   backward saves through autograd and counts as above;
                 - at pp > 1, the pipeline engine's buffers of the micro-batches in flight (``pipe_buffers``: each
                   stage's inputs, labels and outputs, kept until that micro-batch's backward; the 1F1B schedule
                   decides how many; parameters in them, as the fused loss's head weight, not), resynchronised
                   after every instruction.
                 Not counted: the pipeline's receive buffers (``pipe_recv_buf``, ``grad_layer``: one micro-batch's
                 activation and its gradient), gradients of activations inside backward, and other temporaries.
``allocator_peak``  on an accelerator, the allocator's peak over the first step (``max_memory_allocated`` after
                 ``reset_peak_memory_stats``: everything at once, for comparison); null on CPU.

Every rank measures its own; :meth:`FirstStep.gather` collects them (one small all_gather) into lists indexed by
global rank. The training loop writes them into the first step's record of ``metrics.jsonl`` (``memory_bytes``),
returns them as ``RunResult.memory`` and prints :func:`summary` at the end; :func:`read_memory` reads them back.
"""

from __future__ import annotations

import contextlib
import functools
import json
from pathlib import Path

import torch
from torch import nn

CATEGORIES = ("params", "grads", "grad_buckets", "optimizer", "activations", "allocator_peak")

# Attributes of DeepSpeed's optimizer wrappers that hold gradients (deepspeed/runtime/zero/stage_1_and_2.py,
# stage3.py, bf16_optimizer.py). The buckets are also counted alone.
BUCKETS = "ipg_buckets"  # ZeRO-1/2/3: the reduction buckets, one per dtype (IPGBucket.buffer, IPGBucketZ3.buffer)
GRADIENT_BUFFERS = (
    BUCKETS,
    "grads_in_partition",  # ZeRO-1/2: the reduced gradients of the parameters in this rank's partition
    "averaged_gradients",  # ZeRO-1/2/3: the partition's gradients handed to the step
    "all_grad_tensors",  # ZeRO-1/2: the partition's gradients accumulated over micro-batches
    "grad_partitions_flat_buffer",  # ZeRO-3: this rank's gradient partition, flat
    "fp32_groups_gradients_flat",  # BF16_Optimizer: the fp32 gradient accumulators
)
# Flat buffers the parameters are views of (their padding counts with them).
PARAMETER_BUFFERS = ("bit16_groups_flat", "bf16_groups_flat", "lp_param_buffer")
# The fp32 master copies of DeepSpeed's wrappers (ZeRO-3 hands them to the inner optimizer only during its step).
MASTER_COPIES = (
    "single_partition_of_fp32_groups",  # ZeRO-1/2
    "fp32_partitioned_groups_flat",  # ZeRO-3
    "fp32_groups_flat_partition",  # BF16_Optimizer
    "fp32_groups",  # FP16_UnfusedOptimizer (bf16 or fp16 without ZeRO at pp = 1)
    "fp32_groups_flat",  # FP16_Optimizer (fp16 with a fused optimizer)
)
# Methods of ZeRO's optimizers around which the gradients are sampled (the bucket is fullest on entering).
REDUCTIONS = ("reduce_ipg_grads", "independent_gradient_partition_epilogue")


def _storage(t: torch.Tensor):
    """``(key, bytes)`` of the storage ``t`` lives in; None for what holds no memory."""
    if t.device.type == "meta":
        return None
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less tensors
        return None
    nbytes = storage.nbytes()
    return ((t.device.type, t.device.index, storage.data_ptr()), nbytes) if nbytes else None


def _tensors(obj):
    """The tensors in ``obj``: a tensor, nested dicts / lists / tuples of them, DeepSpeed's buckets (``.buffer``)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)
    elif hasattr(obj, "buffer"):
        yield from _tensors(obj.buffer)


def storages(tensors) -> dict:
    """``{storage key: bytes}`` of distinct storages."""
    out = {}
    for t in tensors:
        found = _storage(t)
        if found is not None:
            out[found[0]] = found[1]
    return out


def inner_optimizer(optimizer):
    """The torch optimizer that does the update: DeepSpeed's wrappers keep it as ``.optimizer``."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


class _Held:
    """One holder of a counted storage; the storage stops counting when its last holder is freed. Carries the
    tensor only for autograd's saved tensors (their unpack hook gives it back)."""

    __slots__ = ("tensor", "key", "live")

    def __init__(self, tensor, key, live):
        self.tensor, self.key, self.live = tensor, key, live

    def __del__(self):
        self.live.release(self.key)


class LiveBytes:
    """Bytes of the distinct storages held now, and their peak."""

    def __init__(self):
        self.held: dict = {}  # storage key -> [bytes, holders]
        self.now = self.peak = 0

    def hold(self, t: torch.Tensor, keep: bool = False) -> _Held | None:
        found = _storage(t)
        if found is None:
            return None
        key, nbytes = found
        entry = self.held.get(key)
        if entry is None:
            self.held[key] = [nbytes, 1]
            self.now += nbytes
            self.peak = max(self.peak, self.now)
        else:
            entry[1] += 1
        return _Held(t.detach() if keep else None, key, self)

    def release(self, key) -> None:
        entry = self.held[key]
        entry[1] -= 1
        if entry[1] == 0:
            del self.held[key]
            self.now -= entry[0]


def _unpack(saved):
    return saved.tensor if isinstance(saved, _Held) else saved


@contextlib.contextmanager
def _replaced(obj, name: str, make):
    """``obj.name`` replaced by ``make(original)`` for the body (an instance attribute, put back after)."""
    original = getattr(obj, name, None)
    if original is None:
        yield
        return
    had, previous = name in vars(obj), vars(obj).get(name)
    setattr(obj, name, make(original))
    try:
        yield
    finally:
        if had:
            setattr(obj, name, previous)
        else:
            delattr(obj, name)


def _then(fn, after=None, before=None):
    """``fn`` that calls ``before()`` first and ``after()`` when it returns."""
    @functools.wraps(fn)  # keeps the LR scheduler's mark on an optimizer's step
    def call(*args, **kwargs):
        if before is not None:
            before()
        result = fn(*args, **kwargs)
        if after is not None:
            after()
        return result

    return call


def checkpoint_inputs_counted(live: LiveBytes):
    """DeepSpeed's ``CheckpointFunction`` counting what it keeps outside autograd for its backward: the block's
    inputs and the generator states, from its forward to the end of its backward (module docstring)."""
    from zoo.compat.deepspeed import checkpoint_function_watched

    def forward_kept(ctx, kept):
        ctx.zoo_memory_held = [live.hold(t) for t in _tensors(kept)]

    def backward_ended(ctx):
        ctx.zoo_memory_held = None

    return checkpoint_function_watched(forward_kept, backward_ended)


@contextlib.contextmanager
def activations_held(module: nn.Module, live: LiveBytes | None = None, parameter_keys: set | None = None):
    """Count in ``live`` (yielded; a new one by default) the storages held for backward in the body: what autograd
    saves, except ``module``'s parameters (storages in ``parameter_keys``, default those of ``module``'s parameters,
    and those ZeRO-3 gathers), and what DeepSpeed's ``CheckpointFunction`` keeps (:func:`checkpoint_inputs_counted`).
    """
    live = LiveBytes() if live is None else live
    keys = set(storages(module.parameters())) if parameter_keys is None else parameter_keys
    zero3 = any(hasattr(p, "ds_tensor") for p in module.parameters())

    def is_parameter(t: torch.Tensor) -> bool:
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return True
        found = _storage(t)
        if found is None:
            return False
        # ZeRO-3 gathers a parameter into a new storage for each use: compare with where they live now
        return found[0] in keys or (zero3 and found[0] in storages(module.parameters()))

    def pack(t: torch.Tensor):
        held = None if is_parameter(t) else live.hold(t, keep=True)
        return t if held is None else held

    with torch.autograd.graph.saved_tensors_hooks(pack, _unpack), checkpoint_inputs_counted(live):
        yield live


class FirstStep:
    """Measures one training step of ``engine``: ``with first.measuring(): <the step>``, then ``first.gather()``
    on every rank (the module's docstring says what counts and when)."""

    def __init__(self, engine, ema=None):
        self.engine, self.module, self.optimizer = engine, engine.module, engine.optimizer
        self.ema_tensors = [] if ema is None else list(ema.shadow)
        self.inner = inner_optimizer(engine.optimizer)
        self.activations = LiveBytes()
        self.grads = self.grad_buckets = 0
        self.measured: dict | None = None
        self._param_keys: set = set()
        self._master_keys: set = set()
        self._pipe_held: dict = {}

    # -- what the engine holds -------------------------------------------------------------------------------
    def param_storages(self) -> dict:
        tensors = []
        for p in self.module.parameters():
            tensors += [p, *_tensors(getattr(p, "ds_tensor", None))]
        for name in PARAMETER_BUFFERS:
            tensors += _tensors(getattr(self.optimizer, name, None))
        return storages(tensors)

    def masters(self) -> list:
        """The tensors the inner optimizer updates: the fp32 masters under DeepSpeed's wrappers (also those ZeRO-3
        hands it only during its step), else the model's parameters."""
        named = [t for name in MASTER_COPIES for t in _tensors(getattr(self.optimizer, name, None))]
        return named + [p for group in self.inner.param_groups for p in group["params"]]

    def optimizer_storages(self) -> dict:
        found = storages([*self.masters(), *_tensors(list(self.inner.state.values())), *self.ema_tensors])
        return {k: v for k, v in found.items() if k not in self._param_keys}

    def grad_storages(self) -> tuple[dict, dict]:
        """``(all gradient storages, those of the buckets)`` held now."""
        tensors = []
        for p in self.module.parameters():
            tensors += [p.grad, getattr(p, "grad_accum", None)]
        tensors += [m.grad for m in self.masters()]
        for name in GRADIENT_BUFFERS:
            tensors += _tensors(getattr(self.optimizer, name, None))
        exclude = self._param_keys | self._master_keys
        held = {k: v for k, v in storages(t for t in tensors if t is not None).items() if k not in exclude}
        buckets = storages(_tensors(getattr(self.optimizer, BUCKETS, None)))
        return held, {k: v for k, v in buckets.items() if k in held}

    def sample(self) -> None:
        held, buckets = self.grad_storages()
        total = sum(held.values())
        if total > self.grads:
            self.grads, self.grad_buckets = total, sum(buckets.values())

    # -- activations -----------------------------------------------------------------------------------------
    def sync_pipe_buffers(self) -> None:
        """Count exactly what the pipeline engine's in-flight buffers hold now."""
        now = storages(_tensors(getattr(self.engine, "pipe_buffers", None)))
        for key in [k for k in self._pipe_held if k not in now]:
            del self._pipe_held[key]
        for t in _tensors(self.engine.pipe_buffers):
            found = _storage(t)
            # a parameter in a stage's outputs (the fused loss's head weight) is the parameter's memory, not more
            if found is not None and found[0] not in self._pipe_held and found[0] not in self._param_keys:
                self._pipe_held[found[0]] = self.activations.hold(t)

    # -- the step --------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _sampling(self):
        from zoo.compat import deepspeed as ds_compat

        with contextlib.ExitStack() as stack:
            if ds_compat.is_pipeline_engine(self.engine):  # after every instruction
                def after_instruction():
                    self.sync_pipe_buffers()
                    self.sample()

                stack.enter_context(ds_compat.after_each_pipe_instruction(self.engine, after_instruction))
            else:
                stack.enter_context(_replaced(self.engine, "backward", lambda fn: _then(fn, self.sample)))
            for name in REDUCTIONS:
                stack.enter_context(_replaced(self.optimizer, name, lambda fn: _then(fn, self.sample, self.sample)))
            for optimizer in {id(o): o for o in (self.optimizer, self.inner)}.values():
                stack.enter_context(_replaced(optimizer, "step", lambda fn: _then(fn, before=self.sample)))
            yield

    @contextlib.contextmanager
    def measuring(self):
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
        on_device = accelerator.device_name() != "cpu"
        if on_device:
            accelerator.reset_peak_memory_stats()
        self._param_keys = set(self.param_storages())
        self._master_keys = set(storages(self.masters())) - self._param_keys
        with activations_held(self.module, self.activations, self._param_keys), self._sampling():
            yield
        self._pipe_held.clear()
        params = self.param_storages()
        self._param_keys = set(params)
        self.measured = {"params": sum(params.values()), "grads": self.grads, "grad_buckets": self.grad_buckets,
                         "optimizer": sum(self.optimizer_storages().values()), "activations": self.activations.peak,
                         "allocator_peak": accelerator.max_memory_allocated() if on_device else None}

    def gather(self, group=None) -> dict:
        """Every rank's figures as lists indexed by rank (collective: every rank calls it)."""
        from zoo.parallel.shards import gather_ints

        rows = gather_ints([-1 if self.measured[c] is None else int(self.measured[c]) for c in CATEGORIES], group)
        out = {c: [row[i] for row in rows] for i, c in enumerate(CATEGORIES)}
        if all(v < 0 for v in out["allocator_peak"]):
            out["allocator_peak"] = None
        return out


def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{int(nbytes)} B"


def summary(memory: dict) -> str:
    """One line: the figures of the rank holding the most (params + grads + optimizer + activations)."""
    parts = ("params", "grads", "optimizer", "activations")
    ranks = len(memory["params"])
    r = max(range(ranks), key=lambda i: sum(memory[c][i] for c in parts))
    line = (f"memory of rank {r} (the largest of {ranks}, first step): " +
            " | ".join(f"{c} {_size(memory[c][r])}" for c in parts))
    if memory["grad_buckets"][r]:
        line += f" (grads: {_size(memory['grad_buckets'][r])} in DeepSpeed's reduction buckets)"
    if memory.get("allocator_peak"):
        line += f" | allocator peak {_size(memory['allocator_peak'][r])}"
    return line


def read_memory(out) -> dict | None:
    """The ``memory_bytes`` of a run folder's ``metrics.jsonl`` (its latest start, when it resumed); None if none."""
    path = Path(out) / "metrics.jsonl"
    found = None
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            found = record.get("memory_bytes", found)
    return found

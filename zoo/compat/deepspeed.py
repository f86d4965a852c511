"""DeepSpeed internals zoo relies on, each behind one function (the package docstring says why they live here).

Every piece was checked against DeepSpeed 0.19.8 (with torch 2.13.0); its canary test is in
``tests/compat/test_deepspeed.py``. "No upstream issue known" means none was found that asks for the public API the
piece stands in for; the pieces name the DeepSpeed function whose behaviour they depend on, so a reader can check a
new release there.
"""

from __future__ import annotations

import contextlib
import re

import torch
import torch.distributed as dist
from deepspeed.pipe import PipelineModule

# ---------------------------------------------------------------------------------------------------------------
# Mixture of experts
# ---------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def engine_counts_as_moe(*classes):
    """While ``deepspeed.initialize`` runs in the body, DeepSpeed's engine takes modules of ``classes`` for its own
    ``MoE`` layers, so it builds with ``has_moe_layers`` (expert-aware gradient reduction, ZeRO partitions over the
    expert-data-parallel groups, expert norms).

    Why: ``DeepSpeedEngine._configure_distributed_model`` recognises MoE layers by ``isinstance(module, MoE)``
    against the name ``MoE`` imported into ``deepspeed.runtime.engine``; there is no public way to register another
    class (its AutoEP layers are a second hard-coded class). The name is swapped for a tuple of classes while the
    engine is built and put back after. Checked: DeepSpeed 0.19.8. No upstream issue known."""
    from deepspeed.runtime import engine as ds_engine

    original = ds_engine.MoE
    ds_engine.MoE = (original, *classes)  # read by isinstance() in DeepSpeedEngine._configure_distributed_model
    try:
        yield
    finally:
        ds_engine.MoE = original


@contextlib.contextmanager
def moe_layers_hidden(engine):
    """While DeepSpeed saves or loads a checkpoint in the body, ``engine`` passes for one without MoE layers.

    Why: the engine sends the save and load of a model with MoE layers through its own MoE checkpoint code, which
    knows only DeepSpeed's per-expert modules; the switch is the plain attribute ``engine.has_moe_layers``, set
    once in ``_configure_distributed_model``, with no public setter. Checked: DeepSpeed 0.19.8. Related upstream:
    deepspeedai/DeepSpeed#5716 (universal checkpoints of MoE models)."""
    had = getattr(engine, "has_moe_layers", False)
    engine.has_moe_layers = False
    try:
        yield
    finally:
        engine.has_moe_layers = had


def register_expert_groups(name: str, ep_group, ep_ranks, edp_group, edp_ranks) -> None:
    """Put an expert-parallel (EP) and expert-data-parallel (EDP) group into DeepSpeed's group caches under
    ``name`` (``ep_size_<ep>``, the ``group_name`` of expert parameters), where its MoE gradient reduction, ZeRO's
    expert partitioning and its MoE checkpoint code look them up.

    Why: ``deepspeed.utils.groups`` builds these groups only from its own rank layout
    (``_create_expert_and_data_parallel``); zoo builds them on its grid (EP inside true data parallelism, CP,
    "parallel folding" over TP), so it fills the private dicts ``_EXPERT_PARALLEL_GROUP(_RANKS)`` and
    ``_EXPERT_DATA_PARALLEL_GROUP(_RANKS)`` itself. Checked: DeepSpeed 0.19.8. No upstream issue known."""
    from deepspeed.utils import groups as ds_groups

    ds_groups._EXPERT_PARALLEL_GROUP[name] = ep_group
    ds_groups._EXPERT_PARALLEL_GROUP_RANKS[name] = list(ep_ranks)
    ds_groups._EXPERT_DATA_PARALLEL_GROUP[name] = edp_group
    ds_groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = list(edp_ranks)


def data_parallel_group():
    """The data-parallel group DeepSpeed reduces gradients over (the mpu's, when it was given one).

    Why: ``deepspeed.utils.groups._get_data_parallel_group`` is private; zoo reads it to check the divisor of
    expert gradients under ZeRO-0 (``DeepSpeedEngine._reduce_expert_gradients`` divides by its world size).
    Checked: DeepSpeed 0.19.8. No upstream issue known."""
    from deepspeed.utils import groups as ds_groups

    return ds_groups._get_data_parallel_group()


def optimizer_loss_scale(engine) -> float | None:
    """The loss scale the engine's optimizer multiplies the loss by before backward (fp16's dynamic scale; None
    without one).

    Why: the current scale is read by the private ``DeepSpeedEngine._get_optimizer_loss_scale`` only; the public
    ``engine.loss_scale()`` returns the configured one (0 for a dynamic scale). Checked: DeepSpeed 0.19.8. No
    upstream issue known."""
    return engine._get_optimizer_loss_scale()


def has_tensor_fragment(param) -> bool:
    """Whether ZeRO-1/2 (or the bf16 optimizer) mapped ``param`` to a fragment of its flat fp32 partition, i.e.
    whether ``deepspeed.utils.safe_get_full_fp32_param`` and friends work for it.

    Why: the tensor-fragment API has no public "is this parameter mapped" query; its functions read the private
    attribute ``param._hp_mapping``. Checked: DeepSpeed 0.19.8. No upstream issue known."""
    return hasattr(param, "_hp_mapping")


# ---------------------------------------------------------------------------------------------------------------
# Universal checkpoints
# ---------------------------------------------------------------------------------------------------------------


def convert_to_universal(input_folder, output_folder) -> None:
    """Run ``ds_to_universal`` in this process: one worker, strict pattern checks, no injected state, no temporary
    folder left.

    Why: ``deepspeed.checkpoint.ds_to_universal`` is a script; its ``main`` takes the argparse namespace of its own
    command line, so the field names below are its flags (``--no_strict`` stores ``strict``). Running it in process
    lets :func:`universal_merge_leaving_out` act on it. Checked: DeepSpeed 0.19.8. No upstream issue known."""
    import argparse

    from deepspeed.checkpoint.ds_to_universal import main

    main(argparse.Namespace(input_folder=str(input_folder), output_folder=str(output_folder), num_extract_workers=1,
                            num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=False))


@contextlib.contextmanager
def universal_merge_leaving_out(names, edit_info=None):
    """While ``ds_to_universal`` runs in this process (:func:`convert_to_universal`), its merge of the TP slices
    leaves out the parameters ``names`` too. ``edit_info(uc_info, kept)`` (optional) returns the universal
    checkpoint info to merge with, given the names it still merges.

    Why: ``ds_to_universal`` has no option to skip parameters (its ``exclude_param_names`` is filled only
    internally, for AutoEP), so the private ``_merge_tp_slice_files(args, uc_info, tp_degree, slice_shapes,
    temp_dir, exclude_param_names=None)`` is wrapped, called with the signature ``main`` uses. Checked: DeepSpeed
    0.19.8. Related upstream: deepspeedai/DeepSpeed#5716 (universal checkpoints of MoE models)."""
    from deepspeed.checkpoint import ds_to_universal

    names = set(names)
    original = ds_to_universal._merge_tp_slice_files

    def merge(args, uc_info, tp_degree, slice_shapes, temp_dir, exclude_param_names=None):
        left_out = set(exclude_param_names or ()) | names
        if edit_info is not None:
            uc_info = edit_info(uc_info, [n for n in slice_shapes if n not in left_out])
        return original(args, uc_info, tp_degree, slice_shapes, temp_dir, left_out)

    ds_to_universal._merge_tp_slice_files = merge
    try:
        yield
    finally:
        ds_to_universal._merge_tp_slice_files = original


# ---------------------------------------------------------------------------------------------------------------
# The engine's gradient norm and clipping
# ---------------------------------------------------------------------------------------------------------------


def global_grad_norm(engine):
    """The gradient norm the engine reports for its last step (``engine.get_global_grad_norm()`` reads it); here
    for symmetry with :func:`set_global_grad_norm`."""
    return engine._global_grad_norm


def set_global_grad_norm(engine, norm) -> None:
    """Make ``engine.get_global_grad_norm()`` report ``norm`` for this step.

    Why: DeepSpeed keeps the norm in the private ``engine._global_grad_norm`` and has no setter; zoo computes the
    norm itself where DeepSpeed's is wrong (:func:`replace_fp32_clipping`) or marks a skipped step with inf.
    Checked: DeepSpeed 0.19.8. No upstream issue known."""
    engine._global_grad_norm = norm


def set_overflow(optimizer, overflow: bool) -> None:
    """Tell the engine whether the step its (bare torch) ``optimizer`` is taking overflowed: if so, the engine
    counts it in ``skipped_steps`` and leaves the LR schedule where it was.

    Why: the engine learns of a skipped step only by reading ``optimizer.overflow`` after ``optimizer.step()``
    (``DeepSpeedEngine._take_model_step``), the flag its own fp16/ZeRO optimizers set; a bare torch optimizer has
    none and no public way to say so. Checked: DeepSpeed 0.19.8. No upstream issue known."""
    optimizer.overflow = overflow


def replace_fp32_clipping(engine, clip) -> None:
    """Make ``engine`` call ``clip()`` where it clips fp32 gradients without ZeRO (``_take_model_step``, when
    ``gradient_clipping`` > 0 and neither fp16, bf16 nor ZeRO is on).

    Why: ``DeepSpeedEngine.clip_fp32_gradients`` (``deepspeed.runtime.utils.clip_grad_norm_``) counts replicated
    parameters only where the pipe x tensor rank is 0, dropping those of pipeline stages after the first
    (``zoo.parallel.grad_norm``); the engine has no hook for another clipping function, so the method is replaced on
    this engine (an instance attribute; the class is untouched). Checked: DeepSpeed 0.19.8. No upstream issue
    known."""
    engine.clip_fp32_gradients = clip


# ---------------------------------------------------------------------------------------------------------------
# Pipelines
# ---------------------------------------------------------------------------------------------------------------


class PipelineModuleWithParts(PipelineModule):
    """``PipelineModule`` with one more keyword, ``parts`` (stage boundaries ``[0, b1, ..., num_layers]``), used
    instead of its ``partition_method`` when given, and the built stage's layer range as public properties.

    Why: ``PipelineModule`` chooses stage boundaries only by its methods (uniform, parameters, type:regex); the
    hook to give them is the private ``_partition_layers``, called from ``__init__``, which must set ``parts``
    and call the private ``_set_bounds``; the stage's range is in the private ``_local_start`` /
    ``_local_stop`` and ``_layer_specs``. Checked: DeepSpeed 0.19.8. No upstream issue known."""

    def __init__(self, *args, parts: list[int] | None = None, **kwargs):
        self._zoo_parts = None if parts is None else list(parts)  # read by _partition_layers in __init__
        super().__init__(*args, **kwargs)

    def _partition_layers(self, method="uniform"):
        if self._zoo_parts is None:
            return super()._partition_layers(method)
        if len(self._zoo_parts) != self.num_stages + 1 or self._zoo_parts[0] != 0 or \
                self._zoo_parts[-1] != len(self._layer_specs):
            raise ValueError(f"parts {self._zoo_parts} do not split {len(self._layer_specs)} layers into "
                             f"{self.num_stages} stages")
        self.parts = list(self._zoo_parts)
        stage = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    # This stage builds layers [stage_start, stage_stop) of num_layers.
    stage_start = property(lambda self: self._local_start)
    stage_stop = property(lambda self: self._local_stop)
    num_layers = property(lambda self: len(self._layer_specs))


@contextlib.contextmanager
def after_each_pipe_instruction(engine, after):
    """While the body runs, a pipeline engine calls ``after()`` when each instruction of its schedule returns
    (forward, backward, send, receive, reduce, optimizer step, ...).

    Why: ``PipelineEngine._exec_schedule`` dispatches through the private class table ``_INSTRUCTION_MAP`` and has
    no per-instruction hook; this engine gets a table of its own (an instance attribute over the class's), removed
    after. Checked: DeepSpeed 0.19.8. No upstream issue known."""
    import functools

    def then(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            result = fn(*args, **kwargs)
            after()
            return result

        return call

    engine._INSTRUCTION_MAP = {cmd: then(fn) for cmd, fn in type(engine)._INSTRUCTION_MAP.items()}
    try:
        yield
    finally:
        delattr(engine, "_INSTRUCTION_MAP")


def skip_frozen_tied_weights(module) -> None:
    """A ``PipelineModule``'s tied weights that do not train (LoRA's frozen base: a tied embedding) leave the
    reduction of tied gradients, which would all-reduce their ``grad``, None.

    Why: ``PipelineModule.allreduce_tied_weight_gradients`` calls ``dist.all_reduce(weight.grad, ...)`` for every
    attribute in ``tied_comms[key]['weight_attr']``, trainable or not. The frozen attributes are removed from those
    lists (the tied weights stay tied: one value, synchronized when the module was built). Checked: DeepSpeed
    0.19.8. No upstream issue known."""
    for comm in getattr(module, "tied_comms", {}).values():
        comm["weight_attr"] = [attr for attr in comm["weight_attr"]  # a new list: tied_weight_attrs stays as it is
                               if module._recursive_getattr(comm["module"], attr).requires_grad]


def is_pipeline_engine(engine) -> bool:
    """Whether ``engine`` runs a pipeline schedule (the engine :func:`after_each_pipe_instruction` applies to)."""
    return hasattr(engine, "_INSTRUCTION_MAP")


# ---------------------------------------------------------------------------------------------------------------
# Activation checkpointing
# ---------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def checkpoint_function_watched(on_forward, on_backward_end):
    """While the body runs, DeepSpeed's ``CheckpointFunction`` calls ``on_forward(ctx, kept)`` after each forward
    and ``on_backward_end(ctx)`` when its backward ends (also on an error). ``kept``: what the forward keeps for
    backward outside autograd: ``[block inputs (a list), CPU RNG state, accelerator RNG state, RNG tracker states
    (a dict)]``.

    Why: ``CheckpointFunction`` keeps a checkpointed block's inputs in ``ctx.deepspeed_saved_tensors`` (it never
    calls ``save_for_backward``, so ``saved_tensors_hooks`` cannot see them) and its RNG states in
    ``ctx.fwd_cpu_rng_state``, ``ctx.fwd_cuda_rng_state``, ``ctx.fwd_cuda_rng_state_tracker``: private attributes
    of a class with no hooks. Its static ``forward`` and ``backward`` are swapped on the class (process-wide) for
    the body. Checked: DeepSpeed 0.19.8. No upstream issue known."""
    from deepspeed.runtime.activation_checkpointing.checkpointing import CheckpointFunction

    forward, backward = CheckpointFunction.__dict__["forward"], CheckpointFunction.__dict__["backward"]

    def watched_forward(ctx, *args):
        outputs = forward.__func__(ctx, *args)
        on_forward(ctx, [list(ctx.deepspeed_saved_tensors), ctx.fwd_cpu_rng_state, ctx.fwd_cuda_rng_state,
                         ctx.fwd_cuda_rng_state_tracker])
        return outputs

    def watched_backward(ctx, *grads):
        try:
            return backward.__func__(ctx, *grads)
        finally:
            on_backward_end(ctx)

    CheckpointFunction.forward, CheckpointFunction.backward = staticmethod(watched_forward), staticmethod(
        watched_backward)
    try:
        yield
    finally:
        CheckpointFunction.forward, CheckpointFunction.backward = forward, backward


# ---------------------------------------------------------------------------------------------------------------
# Communication
# ---------------------------------------------------------------------------------------------------------------


def comm_backend():
    """DeepSpeed's communication backend object (``deepspeed.comm.comm.cdb``), or None before
    ``deepspeed.init_distributed`` (or without DeepSpeed).

    Why: its torch backend keeps the all-gather and reduce-scatter it picked at start-up as the attributes
    ``all_gather_function`` / ``reduce_scatter_function``, so a wrapper of ``torch.distributed``'s functions (the
    collective counter) must swap those too; ``cdb`` is a module global with no accessor. Checked: DeepSpeed
    0.19.8. No upstream issue known."""
    try:
        from deepspeed.comm import comm as ds_comm
    except ImportError:
        return None
    return getattr(ds_comm, "cdb", None)


# DeepSpeed's group caches that hold process groups (``deepspeed.utils.groups``: _EXPERT_PARALLEL_GROUP, ...,
# _WORLD_GROUP, _DATA_PARALLEL_GROUP, ...): module globals named in capitals with a leading underscore.
_GROUP_CACHE = re.compile(r"_[A-Z_]+")


def group_cache_names() -> list[str]:
    """The names of ``deepspeed.utils.groups``' module globals that :func:`clear_group_caches` empties."""
    from deepspeed.utils import groups as ds_groups

    return [name for name, value in vars(ds_groups).items()
            if _GROUP_CACHE.fullmatch(name) and not isinstance(value, str)]


def clear_group_caches() -> None:
    """Forget every process group DeepSpeed keeps in module globals: its group caches, the mpu and device mesh it
    was given, activation checkpointing's ``mpu`` and ``mp_group``, and the pipeline's point-to-point groups.

    Why: a process that builds many engines (a test worker, a notebook, a sweep) destroys their groups between
    them; DeepSpeed has no reset, and groups it still holds would be used after they are destroyed (and keep their
    gloo threads alive). The caches are private globals (``deepspeed.utils.groups._*``; ``p2p._groups``,
    ``p2p._grid``, ``p2p._async``). Checked: DeepSpeed 0.19.8. No upstream issue known."""
    from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing
    from deepspeed.runtime.pipe import p2p as ds_p2p
    from deepspeed.utils import groups as ds_groups

    for name in group_cache_names():
        value = getattr(ds_groups, name)
        value.clear() if isinstance(value, dict) else setattr(ds_groups, name, None)
    ds_groups.mpu, ds_groups.mesh_device = None, None
    ds_checkpointing.mpu, ds_checkpointing.mp_group = None, None  # configure() points these at a grid
    ds_p2p._groups, ds_p2p._grid = None, None  # a pipeline engine's send/recv groups
    ds_p2p._async.clear()


# ---------------------------------------------------------------------------------------------------------------
# Engine teardown and start-up
# ---------------------------------------------------------------------------------------------------------------


def release_engine(engine) -> None:
    """After ``engine.destroy()``: drop what keeps an engine (and its process groups) alive.

    Why: DeepSpeed's output backward hooks hold the engine, and a pipeline's last stage keeps ``engine.loss``
    (``total_loss``, ``outputs``, ``pipe_buffers``, ``fwd_outputs``) whose autograd graph holds those hooks, out of
    the garbage collector's sight; ZeRO-3 keeps the module it ran last in the global
    ``deepspeed.runtime.zero.parameter_offload.FWD_MODULE_STACK``; ``destroy()`` clears none of them, and a ZeRO-3
    engine stays reachable from autograd state regardless, so the process groups its objects hold are dropped too.
    Checked: DeepSpeed 0.19.8. No upstream issue known."""
    from deepspeed.runtime.zero import parameter_offload

    from zoo.compat.torch import clear_module_hooks

    for name in ("loss", "total_loss", "outputs"):
        if hasattr(engine, name):
            setattr(engine, name, None)
    if isinstance(getattr(engine, "pipe_buffers", None), dict):
        engine.pipe_buffers = {key: [] for key in engine.pipe_buffers}
    if hasattr(engine, "fwd_outputs"):
        engine.fwd_outputs = []
    parameter_offload.FWD_MODULE_STACK.clear()  # ZeRO-3 leaves the last module it ran (and so the engine) here
    for module in engine.module.modules():  # the engine's hooks: the module is plain again, and holds no engine
        clear_module_hooks(module)
    holders = [engine, getattr(engine, "optimizer", None), *engine.module.parameters()]
    holders += [getattr(holders[1], name, None) for name in ("parameter_offload", "optimizer")]
    for obj in (h for h in holders if h is not None):
        for name, value in list(vars(obj).items()):
            if isinstance(value, dist.ProcessGroup):
                setattr(obj, name, None)


MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"


def import_muon_with_deferred_compile() -> None:
    """Import DeepSpeed's Muon module with its ``torch.compile`` calls deferred to the first call of each function.

    Why: DeepSpeed's ZeRO code imports the module on every run (its support check, and ZeRO-1/2's gradient copy,
    whatever the optimizer), and at import its Newton-Schulz kernels are wrapped by ``torch.compile``, which
    imports all of TorchInductor. zoo trains with AdamW and never calls them; if anything ever does, they are
    compiled then, exactly as before. There is no public switch, so ``torch.compile`` is swapped process-wide
    while the module is imported, and put back. (Blocking the import instead breaks ZeRO-2, which imports the
    module unguarded.) It earns its keep: without it the import takes 2.2-3.2 s of CPU (10 runs on 2 loaded cores;
    181 Inductor modules, never used later in a run), with it 1 ms; a one-step ``launch/train.py`` of
    configs/gpt/tiny.yaml used 9.4 s -> 8.4 s of CPU (medians of 8 alternating runs, loaded machine) and took
    9.6 s -> 8.0 s (median of 4, idle machine). Checked: DeepSpeed 0.19.8, torch 2.13.0. No upstream issue known."""
    import sys

    if MUON_MODULE in sys.modules:
        return
    import functools
    import importlib

    compile_now = torch.compile

    def compile_later(model=None, **kwargs):
        if model is None:  # @torch.compile(mode=...)
            return lambda fn: compile_later(fn, **kwargs)
        compiled = None

        @functools.wraps(model)
        def first_call_compiles(*args, **kw):
            nonlocal compiled
            if compiled is None:
                compiled = compile_now(model, **kwargs)
            return compiled(*args, **kw)

        return first_call_compiles

    torch.compile = compile_later
    try:
        importlib.import_module(MUON_MODULE)
    except ImportError:
        pass
    finally:
        torch.compile = compile_now

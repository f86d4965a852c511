"""Canaries of zoo.compat.deepspeed: each checks, in this one process, that DeepSpeed still has the private name,
signature or behaviour one piece relies on, and fails naming the DeepSpeed version and what changed."""

from __future__ import annotations

import ast
import inspect
import types
from pathlib import Path

import pytest
import torch

from tests.compat.canary import expect, parameters, source
from zoo.compat import deepspeed as ds_compat

LIB = "deepspeed"


def test_engine_counts_as_moe():
    from deepspeed.moe.layer import MoE
    from deepspeed.runtime import engine as ds_engine

    piece = "deepspeed.engine_counts_as_moe"
    expect(getattr(ds_engine, "MoE", None) is MoE, LIB, piece,
           "deepspeed.runtime.engine no longer imports deepspeed.moe.layer.MoE under the name MoE")
    configure = source(ds_engine.DeepSpeedEngine._configure_distributed_model)
    expect("isinstance(module, MoE)" in configure and "self.has_moe_layers = True" in configure, LIB, piece,
           "DeepSpeedEngine._configure_distributed_model no longer sets has_moe_layers by isinstance(module, MoE)")

    class Layer(torch.nn.Module):
        pass

    with ds_compat.engine_counts_as_moe(Layer):
        expect(isinstance(Layer(), ds_engine.MoE), LIB, piece, "the swapped MoE name does not take the class")
    assert ds_engine.MoE is MoE


def test_moe_layers_hidden():
    from deepspeed.runtime.engine import DeepSpeedEngine

    piece = "deepspeed.moe_layers_hidden"
    for method in (DeepSpeedEngine.save_checkpoint, DeepSpeedEngine._load_checkpoint):
        expect("self.has_moe_layers" in source(method), LIB, piece,
               f"DeepSpeedEngine.{method.__name__} no longer chooses its MoE path by engine.has_moe_layers")
    engine = types.SimpleNamespace(has_moe_layers=True)
    with ds_compat.moe_layers_hidden(engine):
        assert engine.has_moe_layers is False
    assert engine.has_moe_layers is True


EXPERT_CACHES = ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
                 "_EXPERT_DATA_PARALLEL_GROUP_RANKS")


def test_register_expert_groups():
    from deepspeed.utils import groups as ds_groups

    piece = "deepspeed.register_expert_groups"
    for name in EXPERT_CACHES:
        expect(isinstance(getattr(ds_groups, name, None), dict), LIB, piece,
               f"deepspeed.utils.groups.{name} is no longer a dict keyed by group name")
    name = "ep_size_canary"
    ep, edp = object(), object()
    ds_compat.register_expert_groups(name, ep, (0, 2), edp, (0, 4))
    try:  # DeepSpeed's own readers, as its MoE reduction and ZeRO partitioning call them
        expect(ds_groups._get_expert_parallel_group(name) is ep and
               ds_groups._get_expert_data_parallel_group(name) is edp and
               ds_groups._get_expert_parallel_group_ranks(name) == [0, 2] and
               ds_groups._get_expert_data_parallel_group_ranks(name) == [0, 4], LIB, piece,
               "deepspeed.utils.groups' _get_expert_(data_)parallel_group(_ranks) no longer read those dicts")
    finally:
        for cache in EXPERT_CACHES:
            getattr(ds_groups, cache).pop(name, None)


def test_data_parallel_group():
    from deepspeed.utils import groups as ds_groups

    fn = getattr(ds_groups, "_get_data_parallel_group", None)
    expect(callable(fn) and parameters(fn) == [], LIB, "deepspeed.data_parallel_group",
           "deepspeed.utils.groups._get_data_parallel_group() is gone or takes arguments")
    from deepspeed.runtime.engine import DeepSpeedEngine

    expect("_get_data_parallel_group()" in source(DeepSpeedEngine._reduce_expert_gradients), LIB,
           "deepspeed.data_parallel_group",
           "DeepSpeedEngine._reduce_expert_gradients no longer divides by the world size of "
           "groups._get_data_parallel_group() (zoo.training.moe.check_expert_gradient_divisor checks that divisor)")


def test_optimizer_loss_scale():
    from deepspeed.runtime.engine import DeepSpeedEngine

    fn = getattr(DeepSpeedEngine, "_get_optimizer_loss_scale", None)
    expect(callable(fn) and parameters(fn) == ["self"], LIB, "deepspeed.optimizer_loss_scale",
           "DeepSpeedEngine._get_optimizer_loss_scale(self) is gone or takes arguments")
    fp16 = types.SimpleNamespace(optimizer=types.SimpleNamespace(cur_scale=1024.0))
    expect(DeepSpeedEngine._get_optimizer_loss_scale(fp16) == 1024.0, LIB, "deepspeed.optimizer_loss_scale",
           "DeepSpeedEngine._get_optimizer_loss_scale no longer reads the optimizer's cur_scale")


def test_has_tensor_fragment():
    from deepspeed.utils import mixed_precision_linkage, safe_get_full_fp32_param

    piece = "deepspeed.has_tensor_fragment"
    expect("lp_param._hp_mapping = " in source(mixed_precision_linkage), LIB, piece,
           "deepspeed.utils.mixed_precision_linkage no longer maps parameters through param._hp_mapping")
    expect("_hp_mapping" in source(safe_get_full_fp32_param), LIB, piece,
           "deepspeed.utils.safe_get_full_fp32_param no longer reads param._hp_mapping")
    assert not ds_compat.has_tensor_fragment(torch.nn.Parameter(torch.zeros(1)))


def test_convert_to_universal_arguments(monkeypatch):
    """``main`` reads the namespace of the script's own command line: zoo's must hold exactly its fields."""
    from deepspeed.checkpoint import ds_to_universal

    piece = "deepspeed.convert_to_universal"
    expect(parameters(ds_to_universal.main) == ["args"], LIB, piece, "ds_to_universal.main(args) changed")
    monkeypatch.setattr("sys.argv", ["ds_to_universal", "--input_folder", "in", "--output_folder", "out"])
    theirs = set(vars(ds_to_universal.parse_arguments()))
    ours = {"input_folder", "output_folder", "num_extract_workers", "num_merge_workers", "keep_temp_folder", "strict",
            "inject_missing_state"}
    expect(theirs == ours, LIB, piece, f"ds_to_universal's command line now has the fields {sorted(theirs)}, zoo "
                                       f"passes {sorted(ours)}")


def test_universal_merge_leaving_out(monkeypatch):
    from deepspeed.checkpoint import ds_to_universal

    piece = "deepspeed.universal_merge_leaving_out"
    signature = parameters(ds_to_universal._merge_tp_slice_files)
    expected = ["args", "uc_info", "tp_degree", "slice_shapes", "temp_dir", "exclude_param_names"]
    expect(signature == expected, LIB, piece,
           f"ds_to_universal._merge_tp_slice_files now takes {signature}, zoo's wrapper {expected}")
    expect("_merge_tp_slice_files(args" in source(ds_to_universal.main), LIB, piece,
           "ds_to_universal.main no longer calls _merge_tp_slice_files through the module global")
    calls = []
    monkeypatch.setattr(ds_to_universal, "_merge_tp_slice_files", lambda *a: calls.append(a))
    with ds_compat.universal_merge_leaving_out({"3.expert"}, lambda info, kept: {**info, "kept": kept}):
        ds_to_universal._merge_tp_slice_files("args", {}, 2, {"1.w": 0, "3.expert": 0, "4.b": 0}, "tmp", {"4.b"})
    assert calls == [("args", {"kept": ["1.w"]}, 2, {"1.w": 0, "3.expert": 0, "4.b": 0}, "tmp", {"3.expert", "4.b"})]


def test_global_grad_norm():
    from deepspeed.runtime.engine import DeepSpeedEngine

    piece = "deepspeed.set_global_grad_norm"
    engine = types.SimpleNamespace(_global_grad_norm=None)
    ds_compat.set_global_grad_norm(engine, 2.5)
    expect(DeepSpeedEngine.get_global_grad_norm(engine) == 2.5 and ds_compat.global_grad_norm(engine) == 2.5, LIB,
           piece, "DeepSpeedEngine.get_global_grad_norm no longer returns engine._global_grad_norm")
    expect("self._global_grad_norm = self.optimizer._global_grad_norm" in source(DeepSpeedEngine._take_model_step),
           LIB, piece, "DeepSpeedEngine._take_model_step no longer takes _global_grad_norm from its optimizer only "
                       "when the optimizer has one (zoo's fp32 clipping sets it itself)")


def test_set_overflow():
    from deepspeed.runtime.engine import DeepSpeedEngine

    step = " ".join(source(DeepSpeedEngine._take_model_step).split())
    expect("overflow = self.optimizer.overflow" in step and "self.skipped_steps += 1" in step, LIB,
           "deepspeed.set_overflow", "DeepSpeedEngine._take_model_step no longer counts a step skipped by reading "
                                     "optimizer.overflow")
    optimizer = types.SimpleNamespace()
    ds_compat.set_overflow(optimizer, True)
    assert optimizer.overflow is True


def test_replace_fp32_clipping():
    from deepspeed.runtime.engine import DeepSpeedEngine

    piece = "deepspeed.replace_fp32_clipping"
    expect(parameters(DeepSpeedEngine.clip_fp32_gradients) == ["self"], LIB, piece,
           "DeepSpeedEngine.clip_fp32_gradients(self) changed")
    step = source(DeepSpeedEngine._take_model_step)
    expect("self.clip_fp32_gradients()" in step, LIB, piece,
           "DeepSpeedEngine._take_model_step no longer clips fp32 gradients through self.clip_fp32_gradients()")


def test_pipeline_module_with_parts():
    from deepspeed.pipe import PipelineModule

    piece = "deepspeed.PipelineModuleWithParts"
    expect(parameters(PipelineModule._partition_layers) == ["self", "method"], LIB, piece,
           "PipelineModule._partition_layers(self, method) changed")
    expect(parameters(PipelineModule._set_bounds) == ["self", "start", "stop"], LIB, piece,
           "PipelineModule._set_bounds(self, start, stop) changed")
    init = source(PipelineModule.__init__)
    order = [init.find(s) for s in ("self.global_rank", "self._topo", "self._layer_specs = ",
                                    "self._partition_layers(")]
    expect(-1 not in order and order == sorted(order), LIB, piece,
           "PipelineModule.__init__ no longer sets global_rank, _topo and _layer_specs before it calls "
           "_partition_layers")
    forward = source(PipelineModule.forward)
    expect("self._local_start" in forward and "self._local_stop" in source(PipelineModule._build), LIB, piece,
           "PipelineModule no longer keeps the stage's layer range in _local_start / _local_stop")
    assert issubclass(ds_compat.PipelineModuleWithParts, PipelineModule)


def test_after_each_pipe_instruction():
    from deepspeed.runtime.pipe import schedule
    from deepspeed.runtime.pipe.engine import PipelineEngine

    piece = "deepspeed.after_each_pipe_instruction"
    table = getattr(PipelineEngine, "_INSTRUCTION_MAP", None)
    expect(isinstance(table, dict) and schedule.ForwardPass in table and schedule.OptimizerStep in table, LIB, piece,
           "PipelineEngine._INSTRUCTION_MAP is no longer a dict from schedule instructions to methods")
    expect("self._INSTRUCTION_MAP[type(cmd)]" in source(PipelineEngine._exec_schedule), LIB, piece,
           "PipelineEngine._exec_schedule no longer dispatches through self._INSTRUCTION_MAP")
    calls = []

    engine = type("Engine", (), {"_INSTRUCTION_MAP": {int: lambda self, x: calls.append(x)}})()
    assert ds_compat.is_pipeline_engine(engine)
    with ds_compat.after_each_pipe_instruction(engine, lambda: calls.append("after")):
        engine._INSTRUCTION_MAP[int](engine, 1)
    assert calls == [1, "after"] and "_INSTRUCTION_MAP" not in vars(engine)


def test_skip_frozen_tied_weights():
    from deepspeed.pipe import PipelineModule

    piece = "deepspeed.skip_frozen_tied_weights"
    reduce = source(PipelineModule.allreduce_tied_weight_gradients)
    expect("self.tied_comms.items()" in reduce and "comm['weight_attr']" in reduce and "weight.grad" in reduce, LIB,
           piece, "PipelineModule.allreduce_tied_weight_gradients no longer all-reduces weight.grad of every "
           "tied_comms[key]['weight_attr']")
    expect("'module': self.tied_modules[key]" in source(PipelineModule._index_tied_modules), LIB, piece,
           "PipelineModule._index_tied_modules no longer records the tied module under tied_comms[key]['module']")
    frozen, trained = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    frozen.weight.requires_grad_(False)
    attrs = ["0.weight", "1.weight"]
    module = types.SimpleNamespace(tied_comms={"embed": {"weight_attr": attrs, "module": torch.nn.Sequential(
        frozen, trained)}}, _recursive_getattr=PipelineModule._recursive_getattr)
    ds_compat.skip_frozen_tied_weights(module)
    assert module.tied_comms["embed"]["weight_attr"] == ["1.weight"] and attrs == ["0.weight", "1.weight"]


def test_checkpoint_function_watched():
    """DeepSpeed's activation checkpoint of a small function, in this process: the watch sees the inputs it keeps
    and the end of its backward, and the gradient is unchanged."""
    from deepspeed.runtime.activation_checkpointing import checkpointing

    piece = "deepspeed.checkpoint_function_watched"
    cls = checkpointing.CheckpointFunction
    expect(all(isinstance(cls.__dict__.get(n), staticmethod) for n in ("forward", "backward")), LIB, piece,
           "CheckpointFunction.forward / backward are no longer staticmethods")
    forward = source(cls.forward)
    for name in ("deepspeed_saved_tensors", "fwd_cpu_rng_state", "fwd_cuda_rng_state", "fwd_cuda_rng_state_tracker"):
        expect(f"ctx.{name} = " in forward, LIB, piece, f"CheckpointFunction.forward no longer keeps ctx.{name}")
    seen = []
    x = torch.arange(3.0, requires_grad=True)
    with ds_compat.checkpoint_function_watched(lambda ctx, kept: seen.append(kept), lambda ctx: seen.append("end")):
        checkpointing.checkpoint(lambda t: (t * t).sum(), x).backward()
    expect(len(seen) == 2 and seen[1] == "end" and any(t is x for t in seen[0][0]), LIB, piece,
           "CheckpointFunction's forward no longer keeps the block's inputs in ctx.deepspeed_saved_tensors")
    torch.testing.assert_close(x.grad, 2 * x.detach())
    assert cls.__dict__["forward"].__func__.__name__ == "forward"  # put back


def test_comm_backend():
    import torch.distributed as dist
    from deepspeed.comm import comm as ds_comm
    from deepspeed.comm.torch import TorchBackend

    from zoo.parallel.comm_count import _WRAPPED

    piece = "deepspeed.comm_backend"
    expect(hasattr(ds_comm, "cdb"), LIB, piece, "deepspeed.comm.comm no longer keeps its backend in the global cdb")
    init = source(TorchBackend.__init__)
    expect("self.all_gather_function = " in init and "self.reduce_scatter_function = " in init, LIB, piece,
           "TorchBackend no longer keeps all_gather_function / reduce_scatter_function")
    for picked in (TorchBackend.get_all_gather_function(), TorchBackend.get_reduce_scatter_function()):
        names = [name for name in _WRAPPED if getattr(dist, name, None) is picked]
        expect(names, LIB, piece, f"TorchBackend picks {picked}, which the collective counter does not wrap")


def test_clear_group_caches():
    """Every module global it clears starts as None or an empty dict in DeepSpeed's source, so clearing puts it
    back as it was; and the other globals it resets still exist."""
    from deepspeed.runtime.activation_checkpointing import checkpointing
    from deepspeed.runtime.pipe import p2p
    from deepspeed.utils import groups as ds_groups

    piece = "deepspeed.clear_group_caches"
    tree = ast.parse(Path(ds_groups.__file__).read_text())
    initial = {target.id: node.value for node in tree.body if isinstance(node, ast.Assign)
               for target in node.targets if isinstance(target, ast.Name)}
    for name in ds_compat.group_cache_names():
        value = initial.get(name)
        fresh = (isinstance(value, ast.Constant) and value.value is None
                 or isinstance(value, ast.Dict) and not value.keys)
        expect(fresh, LIB, piece, f"deepspeed.utils.groups.{name} starts as {ast.unparse(value) if value else '?'}, "
                                  f"not None or {{}}: clearing it would not reset it")
    for cache in EXPERT_CACHES + ("_DATA_PARALLEL_GROUP", "_WORLD_GROUP"):
        expect(cache in ds_compat.group_cache_names(), LIB, piece, f"deepspeed.utils.groups.{cache} is gone")
    for module, names in ((ds_groups, ("mpu", "mesh_device")), (checkpointing, ("mpu", "mp_group")),
                          (p2p, ("_groups", "_grid", "_async"))):
        for name in names:
            expect(hasattr(module, name), LIB, piece, f"{module.__name__}.{name} is gone")
    expect(isinstance(p2p._async, list), LIB, piece, "deepspeed.runtime.pipe.p2p._async is no longer a list")


def test_release_engine():
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero import parameter_offload

    piece = "deepspeed.release_engine"
    expect(isinstance(getattr(parameter_offload, "FWD_MODULE_STACK", None), list), LIB, piece,
           "deepspeed.runtime.zero.parameter_offload.FWD_MODULE_STACK is no longer a list")
    expect(parameters(DeepSpeedEngine.destroy) == ["self"], LIB, piece, "DeepSpeedEngine.destroy(self) changed")


def test_muon_module_compiles_at_import():
    """The deferral earns its keep only while the Muon modules wrap their kernels in torch.compile when imported
    (directly, or through ``deepspeed.runtime.compiler.compile()``, which returns ``torch.compile``)."""
    import importlib.util

    from deepspeed.runtime import compiler

    piece = "deepspeed.import_muon_with_deferred_compile"
    spec = importlib.util.find_spec(ds_compat.MUON_MODULE)
    expect(spec is not None, LIB, piece, f"{ds_compat.MUON_MODULE} is gone: the deferral can go too")
    sources = " ".join(path.read_text() for path in Path(spec.origin).parent.glob("*.py"))
    expect("@compiler.compile()" in sources or "@torch.compile" in sources, LIB, piece,
           f"the modules beside {ds_compat.MUON_MODULE} no longer compile at import: the deferral can go")
    expect("return torch.compile" in source(compiler.compile), LIB, piece,
           "deepspeed.runtime.compiler.compile() no longer returns torch.compile (read when the decorator runs)")


def test_every_piece_says_why_and_what_it_was_checked_on():
    for name, obj in vars(ds_compat).items():
        if callable(obj) and getattr(obj, "__module__", None) == ds_compat.__name__ and not name.startswith("_") \
                and name not in ("group_cache_names", "is_pipeline_engine", "global_grad_norm"):
            doc = " ".join((inspect.getdoc(obj) or "").split())
            assert "Why:" in doc and "DeepSpeed 0.19.8" in doc and "upstream" in doc.lower(), name


@pytest.fixture(autouse=True)
def _no_swap_left_behind():
    from deepspeed.runtime import engine as ds_engine

    before = ds_engine.MoE
    yield
    assert ds_engine.MoE is before

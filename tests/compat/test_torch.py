"""Canaries of zoo.compat.torch: each checks, in this one process, that torch still has the private name, signature
or behaviour one piece relies on, and fails naming the torch version and what changed."""

from __future__ import annotations

import inspect

import torch

from tests.compat.canary import expect, parameters
from zoo.compat import torch as torch_compat

LIB = "torch"


def test_compile_backends():
    import torch._dynamo

    expect("exclude_tags" in parameters(torch._dynamo.list_backends), LIB, "torch.compile_backends",
           "torch._dynamo.list_backends no longer takes exclude_tags")
    backends = torch_compat.compile_backends()
    expect(isinstance(backends, list) and "eager" in backends, LIB, "torch.compile_backends",
           f"torch._dynamo.list_backends(exclude_tags=()) gives {backends!r}, without 'eager'")


def test_compiled_graph_count():
    """Compiling a new function with the eager backend adds one graph to Dynamo's counter."""
    before = torch_compat.compiled_graph_count()

    def double(x):
        return x * 2 + 1

    torch.compile(double, backend="eager")(torch.ones(2))
    expect(torch_compat.compiled_graph_count() == before + 1, LIB, "torch.compiled_graph_count",
           "torch._dynamo.utils.counters['stats']['unique_graphs'] no longer counts the graphs compiled")


def test_clear_module_hooks():
    piece = "torch.clear_module_hooks"
    module = torch.nn.Linear(2, 2)
    calls = []
    module.register_forward_pre_hook(lambda m, args: calls.append("pre"))
    module.register_forward_hook(lambda m, args, out: calls.append("post"))
    module.register_full_backward_pre_hook(lambda m, grad: calls.append("backward pre"))
    module.register_full_backward_hook(lambda m, grad_in, grad_out: calls.append("backward"))
    for name in torch_compat.MODULE_HOOKS:
        expect(len(getattr(module, name, ())) == 1, LIB, piece,
               f"nn.Module no longer keeps its hooks in the dict {name}")
    torch_compat.clear_module_hooks(module)
    module(torch.ones(1, 2, requires_grad=True)).sum().backward()
    expect(calls == [], LIB, piece, f"hooks still ran after their dicts were emptied: {calls}")


def test_foreach_lerp_():
    tensors, ends = [torch.zeros(3), torch.ones(2)], [torch.full((3,), 2.0), torch.full((2,), 3.0)]
    expected = [torch.lerp(t, e, 0.25) for t, e in zip(tensors, ends)]
    torch_compat.foreach_lerp_(tensors, ends, 0.25)
    expect(all(torch.equal(t, e) for t, e in zip(tensors, expected)), LIB, "torch.foreach_lerp_",
           "torch._foreach_lerp_ no longer computes torch.lerp in place")


def test_process_groups_and_default_store():
    from torch.distributed import distributed_c10d as c10d

    expect(hasattr(getattr(c10d, "_world", None), "pg_map"), LIB, "torch.process_groups",
           "torch.distributed.distributed_c10d._world.pg_map is gone")
    expect(isinstance(torch_compat.process_groups(), list), LIB, "torch.process_groups",
           "distributed_c10d._world.pg_map is no longer iterable over the groups")
    store = getattr(c10d, "_get_default_store", None)
    expect(callable(store) and parameters(store) == [], LIB, "torch.default_store",
           "torch.distributed.distributed_c10d._get_default_store() is gone or takes arguments")


def test_dispatch_mode_sees_aten_calls():
    seen = []

    class Record(torch_compat.dispatch_mode_class()):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Record():
        torch.mm(torch.ones(2, 3), torch.ones(3, 2))
    expect(torch.ops.aten.mm.default in seen, LIB, "torch.dispatch_mode_class",
           "a TorchDispatchMode (torch.utils._python_dispatch) no longer sees aten.mm")


def test_op_argument_names():
    """The names the benchmark reads SDPA's fused kernels' arguments by."""
    piece = "torch.op_argument_names"
    expect(torch_compat.op_argument_names(torch.ops.aten.mm.default) == ["self", "mat2"], LIB, piece,
           "an OpOverload's _schema.arguments no longer name aten.mm's arguments")
    for name in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention"):
        op = getattr(torch.ops.aten, name, None)
        names = [] if op is None else torch_compat.op_argument_names(op.default)
        expect({"query", "key", "value"} <= set(names), LIB, piece,
               f"aten.{name} no longer takes query, key and value by those names: {names}")


def test_cpu_allocations():
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        x = torch.empty(1 << 16)
        del x
    events = torch_compat.cpu_allocations(prof)
    expect(any(size == 1 << 18 for _, size in events), LIB, "torch.cpu_allocations",
           f"the profiler's event tree no longer shows a 256 KiB CPU allocation (found {events[:5]})")


def test_every_piece_says_why_and_what_it_was_checked_on():
    for name, obj in vars(torch_compat).items():
        if inspect.isfunction(obj) and obj.__module__ == torch_compat.__name__:
            doc = " ".join((inspect.getdoc(obj) or "").split())
            assert "Why:" in doc and "torch 2.13.0" in doc and "upstream" in doc.lower(), name

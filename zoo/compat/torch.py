"""torch internals zoo relies on, each behind one function (the package docstring says why they live here).

Every piece was checked against torch 2.13.0; its canary test is in ``tests/compat/test_torch.py``. "No upstream
issue known" means none was found that asks for the public API the piece stands in for.
"""

from __future__ import annotations

import torch

# ---------------------------------------------------------------------------------------------------------------
# torch.compile
# ---------------------------------------------------------------------------------------------------------------


def compile_backends() -> list[str]:
    """The names ``torch.compile(backend=...)`` accepts here, experimental and debug ones included.

    Why: the only listing is ``torch._dynamo.list_backends`` (``torch.compiler.list_backends`` leaves out the
    tagged ones, ``exclude_tags=()`` here keeps them). Checked: torch 2.13.0. No upstream issue known."""
    import torch._dynamo

    return torch._dynamo.list_backends(exclude_tags=())


def compiled_graph_count() -> int:
    """Graphs ``torch.compile`` has made in this process so far (Dynamo's ``unique_graphs`` counter).

    Why: Dynamo's counters (``torch._dynamo.utils.counters``) are its only record of how many graphs it compiled;
    a count that grows after the first step means recompilations. Checked: torch 2.13.0. No upstream issue
    known."""
    import torch._dynamo.utils

    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


# ---------------------------------------------------------------------------------------------------------------
# Modules and tensors
# ---------------------------------------------------------------------------------------------------------------

MODULE_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks")


def clear_module_hooks(module: torch.nn.Module) -> None:
    """Remove every forward (pre-)hook and backward (pre-)hook of ``module`` itself (not of its children).

    Why: ``register_*_hook`` hands out a handle per hook, and a library that registered hooks (DeepSpeed's engine)
    keeps its handles; the hooks live in the private dicts named in :data:`MODULE_HOOKS`. Checked: torch 2.13.0.
    No upstream issue known."""
    for name in MODULE_HOOKS:
        getattr(module, name).clear()


def foreach_lerp_(tensors, ends, weight: float) -> None:
    """``t += weight * (end - t)`` for every pair, in place, in one fused call per device and dtype.

    Why: the fused multi-tensor form is ``torch._foreach_lerp_``, a private name (the optimizers use it too).
    Checked: torch 2.13.0. No upstream issue known."""
    torch._foreach_lerp_(tensors, ends, weight)


# ---------------------------------------------------------------------------------------------------------------
# torch.distributed
# ---------------------------------------------------------------------------------------------------------------


def process_groups() -> list:
    """Every process group torch.distributed holds now, the default (world) group included.

    Why: torch.distributed lists groups only in its private registry ``distributed_c10d._world.pg_map``; zoo
    destroys all but the world's between engines. Checked: torch 2.13.0. No upstream issue known."""
    from torch.distributed import distributed_c10d as c10d

    return list(c10d._world.pg_map)


def default_store():
    """The key-value store of the default process group (the rendezvous store).

    Why: it is reachable only through the private ``distributed_c10d._get_default_store``; zoo uses it for a roll
    call after a failed collective (it outlives the collective). Checked: torch 2.13.0. No upstream issue known."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


# ---------------------------------------------------------------------------------------------------------------
# Dispatch and profiler (the benchmark's GEMM recorder and memory probe)
# ---------------------------------------------------------------------------------------------------------------


def dispatch_mode_class():
    """``TorchDispatchMode``, the base of a mode that sees every aten call (its ``__torch_dispatch__``).

    Why: the class lives in the private module ``torch.utils._python_dispatch`` (documented there, not exported
    elsewhere). Checked: torch 2.13.0. No upstream issue known."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def op_argument_names(op) -> list[str]:
    """The schema's argument names of an aten operator overload, in order (to name its positional arguments).

    Why: an ``OpOverload``'s schema is the private attribute ``_schema``. Checked: torch 2.13.0. No upstream issue
    known."""
    return [argument.name for argument in op._schema.arguments]


def cpu_allocations(prof) -> list[tuple[int, int]]:
    """``(start time in ns, bytes)`` of every CPU allocation and free (negative bytes) a finished
    ``torch.profiler.profile(profile_memory=True)`` recorded.

    Why: the profiler's public API (``key_averages``, the Chrome trace) gives no per-event allocation list; the
    event tree (``prof.profiler.kineto_results.experimental_event_tree()``) and its tag type
    (``torch._C._profiler._EventType``) are private. Checked: torch 2.13.0. No upstream issue known."""
    from torch._C._profiler import _EventType

    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and str(node.extra_fields.device).startswith("cpu"):
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    return events

"""Peak memory of one training step of one model alone: parameters, optimizer state and the most the step
allocates on top (the accelerator's allocator statistics; on a CPU, the profiler's allocation events).
"""

from __future__ import annotations

import gc
import os

from zoo.bench.compare import Trainee


def step_peak_memory_gb(trainee: Trainee, ids, labels, accel) -> float | None:
    """Peak memory of one training step of this model alone: parameters + optimizer state + the step's peak
    allocation on top (activations, gradients, optimizer temporaries). One extra, untimed step."""
    trainee.optimizer.zero_grad(set_to_none=True)
    gc.collect()
    static = trainee.static_bytes()
    if accel.device_name() == "cpu":
        extra = _cpu_step_peak_bytes(trainee, ids, labels)
        if extra is None:
            return None
    else:
        accel.synchronize()
        accel.reset_peak_memory_stats()
        base = accel.memory_allocated()
        trainee.train_step(ids, labels)
        accel.synchronize()
        extra = accel.max_memory_allocated() - base
    trainee.optimizer.zero_grad(set_to_none=True)
    return (static + extra) / 2**30


def _cpu_step_peak_bytes(trainee: Trainee, ids, labels) -> int | None:
    """The most one step allocates on top of what it starts with, from the profiler's CPU allocation events."""
    # Kineto writes "USDT: profiler_start/stop" lines to stderr around every profile on some CPUs (seen on a Zen 5);
    # level 6 silences its log while this runs: a failure here already means "no figure", not an error.
    previous = os.environ.get("KINETO_LOG_LEVEL")
    os.environ["KINETO_LOG_LEVEL"] = "6"
    try:
        from torch.profiler import ProfilerActivity, profile

        from zoo.compat.torch import cpu_allocations

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            trainee.train_step(ids, labels)
        events = cpu_allocations(prof)
    except Exception:  # private profiler API: no memory figure rather than no benchmark
        return None
    finally:
        if previous is None:
            os.environ.pop("KINETO_LOG_LEVEL", None)
        else:
            os.environ["KINETO_LOG_LEVEL"] = previous
    current = peak = 0
    for _, size in sorted(events, key=lambda e: e[0]):
        current += size
        peak = max(peak, current)
    return peak

"""The roofline of a training step: what the step's GEMMs alone would take at the rates this device sustains for
their shapes. A dispatch mode records every matrix product one step runs (attention's products inside SDPA's fused
kernels included), each shape is timed alone, and the sum is set against the measured step (``fraction_of_matmul``).
"""

from __future__ import annotations

import time

import torch

from zoo.bench.compare import Trainee


def gemm_shapes(trainee: Trainee, ids, labels) -> dict:
    """``{(batch, m, n, k, a transposed, b transposed, dtype): calls}`` of every matrix product one training
    step runs (aten mm / addmm / bmm / baddbmm, plain, out= and in place; forward and backward), recorded by a
    dispatch mode around one extra, untimed eager step.

    A fused attention kernel (SDPA's flash / memory-efficient / cuDNN ops) runs its products inside: they are
    counted as the batched GEMMs they are, 2 forward (``Q K^T``, ``P V``) and 4 backward (``dV``, ``dP``, ``dQ``,
    ``dK``; not the flash backward's recomputed ``Q K^T``), one per query head. Under a causal mask only the
    products' unmasked share is work (``(s + 1) / 2s`` at ``s`` queries and keys), so those calls count that
    share: the roofline does not credit the step for half-masked work a kernel can skip."""
    from collections import Counter

    from zoo.compat.torch import dispatch_mode_class

    TorchDispatchMode = dispatch_mode_class()

    aten = torch.ops.aten
    # the out= and in-place forms too: zoo's fused cross entropy writes its input gradient with torch.mm(..., out=)
    # and accumulates its weight gradient over the chunks with addmm_
    two_d = {aten.mm.default: (0, 1), aten.mm.out: (0, 1), aten.addmm.default: (1, 2), aten.addmm.out: (1, 2),
             aten.addmm_.default: (1, 2)}
    three_d = {aten.bmm.default: (0, 1), aten.bmm.out: (0, 1), aten.baddbmm.default: (1, 2),
               aten.baddbmm.out: (1, 2), aten.baddbmm_.default: (1, 2)}
    shapes: Counter = Counter()

    def transposed(t: torch.Tensor) -> bool:
        return t.dim() >= 2 and t.stride(-2) == 1 and t.stride(-1) != 1

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            where = two_d.get(func) or three_d.get(func)
            if where is not None:
                a, b = args[where[0]], args[where[1]]
                batch = a.shape[0] if func in three_d else 1
                shapes[(batch, a.shape[-2], b.shape[-1], a.shape[-1], transposed(a), transposed(b),
                        str(a.dtype))] += 1
            elif func.overloadpacket in ATTENTION_KERNELS:
                shapes.update(attention_products(func, args, kwargs or {}))
            return func(*args, **(kwargs or {}))

    trainee.optimizer.zero_grad(set_to_none=True)
    with Record():
        trainee.train_step(ids, labels)
    trainee.optimizer.zero_grad(set_to_none=True)
    return dict(shapes)


# SDPA's fused kernels: forward ops, and their backward ops (the same names + "_backward")
ATTENTION_KERNELS = {getattr(torch.ops.aten, name) for base in (
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
    for name in (base, base + "_backward") if hasattr(torch.ops.aten, name)}


def causal_share(queries: int, keys: int) -> float:
    """The share of a ``[queries, keys]`` score matrix a causal mask leaves (SDPA's ``is_causal``: query i sees
    keys 0..i, the mask aligned top left)."""
    return sum(min(i + 1, keys) for i in range(queries)) / (queries * keys)


def attention_products(func, args, kwargs) -> dict:
    """``{gemm shape: calls}`` of the products one fused attention op runs (see ``gemm_shapes``)."""
    from zoo.compat.torch import op_argument_names

    named = dict(zip(op_argument_names(func), args)) | kwargs
    q, k = named["query"], named["key"]  # [b, heads, s, d] and [b, kv heads, s_kv, d]
    batch, s, s_kv, d = q.shape[0] * q.shape[1], q.shape[-2], k.shape[-2], q.shape[-1]
    dv = named["value"].shape[-1]
    share = causal_share(s, s_kv) if named.get("is_causal") else 1.0
    dtype = str(q.dtype)
    if not func.overloadpacket.__name__.endswith("_backward"):
        products = [(batch, s, s_kv, d, False, True, dtype),  # S = Q K^T
                    (batch, s, dv, s_kv, False, False, dtype)]  # O = P V
    else:
        products = [(batch, s_kv, dv, s, True, False, dtype),  # dV = P^T dO
                    (batch, s, s_kv, dv, False, True, dtype),  # dP = dO V^T
                    (batch, s, d, s_kv, False, False, dtype),  # dQ = dS K
                    (batch, s_kv, d, s, True, False, dtype)]  # dK = dS^T Q
    out: dict = {}
    for shape in products:
        out[shape] = out.get(shape, 0.0) + share
    return out


def _operand(rows: int, cols: int, transposed: bool, batch: int, dtype, device) -> torch.Tensor:
    shape = (cols, rows) if transposed else (rows, cols)
    t = torch.randn((batch, *shape) if batch > 1 else shape, dtype=dtype, device=device)
    return t.transpose(-1, -2) if transposed else t


def gemm_seconds(shape: tuple, device, accel, reps: int = 7) -> float:
    """Seconds of one product of this shape and layout here (``torch.mm`` / ``torch.bmm``): the fastest of
    ``reps`` (other processes only ever add time; the step it is compared with is a median)."""
    batch, m, n, k, ta, tb, dtype = shape
    dtype = getattr(torch, dtype.removeprefix("torch."))
    a, b = _operand(m, k, ta, batch, dtype, device), _operand(k, n, tb, batch, dtype, device)
    mm = torch.bmm if batch > 1 else torch.mm
    for _ in range(2):
        mm(a, b)
    times = []
    for _ in range(reps):
        accel.synchronize()
        start = time.perf_counter()
        mm(a, b)
        accel.synchronize()
        times.append(time.perf_counter() - start)
    return min(times)


def gemm_times(shapes: dict, device, accel) -> dict:
    """``{shape: seconds of one product}`` for every recorded shape (``gemm_seconds``)."""
    return {shape: gemm_seconds(shape, device, accel) for shape in shapes}


def roofline(shapes: dict, times: dict) -> tuple[float, float]:
    """``(seconds the step's GEMMs take at the measured rates ``times``, their FLOPs)``."""
    seconds = sum(calls * times[shape] for shape, calls in shapes.items())
    flops = sum(calls * 2 * b * m * n * k for (b, m, n, k, *_), calls in shapes.items())
    return seconds, flops


def square_gemm_flops(device, accel, dtype, size: int | None = None) -> float:
    """FLOP/s of a plain square GEMM of this dtype (1024 on a CPU, 8192 on an accelerator)."""
    size = size or (1024 if accel.device_name() == "cpu" else 8192)
    seconds = gemm_seconds((1, size, size, size, False, False, str(dtype)), device, accel, reps=7)
    return 2 * size**3 / seconds


def device_rates(shapes: dict, device, accel, dtype) -> tuple[dict, float]:
    """``(gemm_times(shapes), square_gemm_flops)`` as this device runs them now: measured before the steps and
    again after them (``roofline_report`` keeps each shape's faster time)."""
    return gemm_times(shapes, device, accel), square_gemm_flops(device, accel, dtype)


def roofline_report(of: str, shapes: dict, before: tuple, after: tuple, step_time_s: float,
                    step_flops: float) -> dict:
    """The report's ``roofline``: the step's GEMMs at each shape's faster rate of ``before`` and ``after``
    (``device_rates``) against the measured step of the model ``of`` (``step_time_s``, ``step_flops`` per step)."""
    times = {shape: min(before[0][shape], after[0][shape]) for shape in shapes}
    gemm_s, gemm_flops = roofline(shapes, times)
    return {"of": of, "gemm_seconds": gemm_s, "gemm_flops": gemm_flops,
            "gemm_seconds_before_after": [roofline(shapes, t)[0] for t in (before[0], after[0])],
            "gemm_shapes": len(shapes), "fraction_of_matmul": gemm_s / step_time_s,
            "step_flops_per_s": step_flops / step_time_s,
            "square_gemm_flops_per_s": max(before[1], after[1])}

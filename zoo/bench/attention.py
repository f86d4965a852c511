"""Forward + backward time of the attention call: a sliding window (zoo.models.attention's kernel for it here,
the blocked path on CPU, FlexAttention on CUDA) against full causal SDPA at the same sequence length; the figure
that shows the windowed cost growing with s x W, not s^2.

    python -m zoo.bench.attention                     # b=1, 4 heads, d=64, s=4096, W=512, 3 repeats: medians
    python -m zoo.bench.attention --seq 2048 8192 --window 256 --softcap 50 --repeats 5

Each repeat times one forward + backward after one warm-up call; the median and the minimum of the repeats are
reported, in wall-clock and in this process's CPU time (on a machine shared with other work single wall-clock runs
vary several-fold; CPU time, all threads summed, much less).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from zoo.bench.common import DTYPES, cores
from zoo.models.attention import attention, choose_kernel


def time_attention(s: int, window: int | None, *, softcap: float | None = None, batch: int = 1, heads: int = 4,
                   head_dim: int = 64, dtype=torch.float32, device: str = "cpu", repeats: int = 3) -> list[float]:
    """(wall, CPU) seconds of forward + backward of ``attention`` (causal, the given window and cap), one pair per
    repeat, after a warm-up. CPU time is this process's, all threads: on a shared machine it moves far less than the
    wall clock."""
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(batch, heads, s, head_dim, generator=g, device=device, dtype=dtype).requires_grad_()
               for _ in range(3))
    dout = torch.randn(batch, heads, s, head_dim, generator=g, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def once() -> tuple[float, float]:
        sync()
        start, cpu = time.perf_counter(), time.process_time()
        out = attention(q, k, v, window=window, softcap=softcap)
        torch.autograd.grad(out, (q, k, v), dout)
        sync()
        return time.perf_counter() - start, time.process_time() - cpu

    once()  # warm-up: allocator, FlexAttention's compilation
    return [once() for _ in range(repeats)]


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seq", type=int, nargs="+", default=[4096])
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--softcap", type=float, default=None, help="also time the window with this soft cap")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's); 1 on a busy "
                   "machine, where a second thread mostly waits for the first")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"attention forward+backward | b={args.batch} heads={args.heads} d={args.head_dim} {args.dtype} on "
          f"{args.device} ({torch.get_num_threads()} threads, {cores()} cores) | median of {args.repeats}", flush=True)
    rows = []
    cases = [(None, None), (args.window, None)] + ([(args.window, args.softcap)] if args.softcap else [])
    for s in args.seq:
        for window, softcap in cases:
            probe = torch.empty(1, args.heads, s, 1, device=args.device)
            kernel = choose_kernel(probe, window=window, softcap=softcap)[0]
            times = time_attention(s, window, softcap=softcap, batch=args.batch, heads=args.heads,
                                   head_dim=args.head_dim, dtype=DTYPES[args.dtype], device=args.device,
                                   repeats=args.repeats)
            wall, cpu = [t[0] for t in times], [t[1] for t in times]
            row = {"seq": s, "window": window, "softcap": softcap, "kernel": kernel, "wall_s": wall, "cpu_s": cpu,
                   "median_wall_s": statistics.median(wall), "median_cpu_s": statistics.median(cpu)}
            rows.append(row)
            what = f"window={window or 'full':>6}" + (f" softcap={softcap}" if softcap else "")
            print(f"s={s:6d} {what:22s} {kernel:8s} median wall {row['median_wall_s'] * 1e3:8.1f} ms "
                  f"(min {min(wall) * 1e3:8.1f}), median CPU {row['median_cpu_s'] * 1e3:8.1f} ms "
                  f"(min {min(cpu) * 1e3:8.1f})", flush=True)
    return rows


if __name__ == "__main__":
    main()

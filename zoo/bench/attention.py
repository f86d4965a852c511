"""Forward + backward time of the attention call: a sliding window (zoo.models.attention's kernel for it here,
the blocked path on CPU, FlexAttention on CUDA) against full causal SDPA at the same sequence length; the figure
that shows the windowed cost growing with s x W, not s^2.

    python -m zoo.bench.attention                     # b=1, 4 heads, d=64, s=4096, W=512, 3 repeats: medians
    python -m zoo.bench.attention --seq 2048 8192 --window 256 --softcap 50 --repeats 5

Each repeat times one forward + backward after one warm-up call; the median of the repeats is reported (a machine
shared with other work varies from run to run).
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
    """Seconds of forward + backward of ``attention`` (causal, the given window and cap), one per repeat, after a
    warm-up."""
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(batch, heads, s, head_dim, generator=g, device=device, dtype=dtype).requires_grad_()
               for _ in range(3))
    dout = torch.randn(batch, heads, s, head_dim, generator=g, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def once() -> float:
        sync()
        start = time.perf_counter()
        out = attention(q, k, v, window=window, softcap=softcap)
        torch.autograd.grad(out, (q, k, v), dout)
        sync()
        return time.perf_counter() - start

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
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
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
            row = {"seq": s, "window": window, "softcap": softcap, "kernel": kernel,
                   "median_s": statistics.median(times), "times": times}
            rows.append(row)
            what = f"window={window or 'full':>6}" + (f" softcap={softcap}" if softcap else "")
            print(f"s={s:6d} {what} {kernel:8s} median {row['median_s'] * 1e3:9.1f} ms  "
                  f"({', '.join(f'{t * 1e3:.1f}' for t in times)})", flush=True)
    return rows


if __name__ == "__main__":
    main()

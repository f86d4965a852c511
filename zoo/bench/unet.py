"""Training throughput of zoo's diffusion U-Net against diffusers' ``UNet2DModel`` of the same config, one process.

    python launch/benchmark_unet.py                                  # the tiny preset, batch 16 (CPU-sized)
    python launch/benchmark_unet.py --preset ddpm-32 --batch-size 32 --dtype bf16 --device cuda   # on a GPU

Both models are built from one ``DiffusionUNetConfig`` (``UNet2DModel(**config)`` on diffusers' side; zoo's layers
keep diffusers' structure, so the parameter counts are equal, which is checked) and train on the same batch: DDPM
training pairs ``((x_t, t), noise)`` of the embedded shapes images, the noise MSE, ``torch.optim.AdamW``, and the same
step: zero grads, forward, loss, backward, optimizer step. Parameters are cast to ``--dtype``; the loss is fp32.

Timing: warm-up steps first, then N timed steps with the device synchronised around each; the two models' steps
are interleaved and their order alternated, so load from other processes hits both alike. Reported per model:
median wall time per step, images/s = batch / median, median process CPU time per step (steadier than wall time
on a shared CPU), and the ratio zoo / diffusers of images/s.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from zoo.bench.common import DTYPES, write_report
from zoo.flags import Parser


def parse_args(argv=None):
    p = Parser(prog="launch/benchmark_unet.py",
               description="Training images/s of zoo's diffusion U-Net vs diffusers' UNet2DModel of "
                                            "the same config, batch, dtype and optimizer, in one process.")
    p.add_argument("--preset", default="tiny", help="a zoo diffusion U-Net preset: tiny (default) or ddpm-32")
    p.add_argument("--batch-size", type=int, default=16, help="images per step (default 16)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per model (default 10; the median is reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed warm-up steps per model (default 3)")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="parameter and activation dtype")
    p.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (default 1e-4)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    return p.parse_args(argv)


def build_models(config, device, dtype):
    """(zoo model, diffusers model), both in train mode on ``device`` in ``dtype``."""
    from zoo.convert.unet import zoo_config_to_diffusers
    from zoo.models.gpt import ParallelOptions
    from zoo.models.specs import SpecSequential
    from zoo.models.unet import layer_specs
    from zoo.package import require

    UNet2DModel = require("diffusers").UNet2DModel  # the diffusion extra

    zoo_model = SpecSequential(layer_specs(config, ParallelOptions()))
    kwargs = {k: v for k, v in zoo_config_to_diffusers(config).items() if not k.startswith("_")}
    hf_model = UNet2DModel(**kwargs)
    return zoo_model.to(device, dtype).train(), hf_model.to(device, dtype).train()


def training_batch(config, batch_size: int, device, dtype, seed: int = 0):
    from zoo.data.shapes import ShapesImages, stack
    from zoo.models.unet import DDPMSchedule

    h, w = config.sizes
    images = stack(ShapesImages(h, seed=seed, channels=config.in_channels), range(batch_size))
    (x_t, t), noise = DDPMSchedule().training_batch(images, torch.Generator().manual_seed(seed))
    return x_t.to(device, dtype), t.to(device), noise.to(device)


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def make_step(forward, model, lr: float, x_t, t, noise, device):
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)

    def step() -> tuple[float, float, float]:
        """(wall seconds, process CPU seconds, loss) of one training step."""
        _sync(device)
        w0, c0 = time.perf_counter(), time.process_time()
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(forward(model, x_t, t).float(), noise.float())
        loss.backward()
        optimizer.step()
        _sync(device)
        return time.perf_counter() - w0, time.process_time() - c0, float(loss.detach())

    return step


def run(args) -> dict:
    from zoo.models.unet import DiffusionUNetConfig, num_parameters

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = DTYPES[args.dtype]
    config = DiffusionUNetConfig.from_preset(args.preset)
    torch.manual_seed(0)
    zoo_model, hf_model = build_models(config, device, dtype)
    counts = {"zoo": sum(p.numel() for p in zoo_model.parameters()),
              "diffusers": sum(p.numel() for p in hf_model.parameters())}
    if counts["zoo"] != counts["diffusers"] or counts["zoo"] != num_parameters(config):
        raise RuntimeError(f"the two models differ in size: {counts}, expected {num_parameters(config)}")
    x_t, t, noise = training_batch(config, args.batch_size, device, dtype)
    steps = {"zoo": make_step(lambda m, x, t: m((x, t)), zoo_model, args.lr, x_t, t, noise, device),
             "diffusers": make_step(lambda m, x, t: m(x, t).sample, hf_model, args.lr, x_t, t, noise, device)}
    names = list(steps)
    for _ in range(args.warmup):
        for name in names:
            steps[name]()
    times = {n: {"wall": [], "cpu": [], "loss": []} for n in names}
    for i in range(args.steps):
        for name in (names if i % 2 == 0 else names[::-1]):  # alternate who goes first
            wall, cpu, loss = steps[name]()
            times[name]["wall"].append(wall)
            times[name]["cpu"].append(cpu)
            times[name]["loss"].append(loss)
    results = {"preset": args.preset, "batch_size": args.batch_size, "dtype": args.dtype, "device": str(device),
               "image_size": list(config.sizes), "parameters": counts["zoo"], "threads": torch.get_num_threads()}
    for name in names:
        wall, cpu = statistics.median(times[name]["wall"]), statistics.median(times[name]["cpu"])
        results[name] = {"step_s": wall, "images_per_s": args.batch_size / wall, "cpu_s_per_step": cpu,
                         "last_loss": times[name]["loss"][-1]}
    results["ratio_zoo_over_diffusers"] = results["zoo"]["images_per_s"] / results["diffusers"]["images_per_s"]
    results["cpu_time_ratio_diffusers_over_zoo"] = results["diffusers"]["cpu_s_per_step"] / \
        results["zoo"]["cpu_s_per_step"]
    return results


def report(r: dict) -> str:
    lines = [f"diffusion U-Net preset {r['preset']}: {r['parameters'] / 1e6:.2f}M parameters, "
             f"{r['image_size'][0]}x{r['image_size'][1]} images, batch {r['batch_size']}, {r['dtype']} on "
             f"{r['device']} ({r['threads']} threads); AdamW; median of the timed steps"]
    for name in ("zoo", "diffusers"):
        m = r[name]
        lines.append(f"  {name:9s} {m['images_per_s']:8.1f} images/s | {m['step_s'] * 1e3:8.1f} ms/step | "
                     f"CPU {m['cpu_s_per_step'] * 1e3:8.1f} ms/step")
    lines.append(f"  ratio zoo / diffusers: {r['ratio_zoo_over_diffusers']:.2f}x images/s "
                 f"({r['cpu_time_ratio_diffusers_over_zoo']:.2f}x by CPU time)")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    for name in ("batch_size", "steps"):
        if getattr(args, name) < 1:
            print(f"error: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    try:
        results = run(args)
    except ValueError as e:  # an unknown preset
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report(results))
    if args.json:
        write_report(args.json, json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Draws the pictures of docs/images/: a rank grid, a loss curve, a segmentation grid and diffusion samples.

    python docs/make_pictures.py                  # all four (three short CPU runs: a few minutes on 2 cores)
    python docs/make_pictures.py rank-grid        # only the ones named

Every picture comes from zoo itself: the rank grid from the same DeepSpeed topology and CP carving that
``zoo.parallel.topology.ParallelGrid`` builds, the others from short ``launch/train.py`` runs drawn with the
functions the runs use (``zoo.training.train.plot_losses``, the segmentation run's own grid, ``zoo.generate.unet``'s
``sample_grid``). The runs are short so the script stays cheap; the captions in the docs say how short. Each PNG
is kept under 200 KB.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "docs" / "images"
MAX_BYTES = 200_000

# The layout drawn: 16 ranks as tp 2 x cp 2 x dp 2 x pp 2.
LAYOUT = {"tp": 2, "cp": 2, "dp": 2, "pp": 2}
# The short runs (steps), each a fraction of its config's default, so the script stays cheap on a busy CPU.
LOSS_RUN = ["--config", "configs/gpt/tiny.yaml", "--no-sample", "--steps", "150"]
SEGMENTATION_RUN = ["--config", "configs/unet/segmentation.yaml", "--steps", "40"]
DIFFUSION_RUN = ["--config", "configs/unet/diffusion-flow.yaml", "--steps", "40",
                 "--set", "training.eval_interval=0", "training.save_interval=0", "training.ema_decay=0.9",
                 "training.micro_batch_size=8", "training.global_batch_size=8"]


def rank_coordinates(tp: int, cp: int, dp: int, pp: int) -> dict[int, dict[str, int]]:
    """``rank -> {tp, cp, dp, pp}`` as zoo places ranks: DeepSpeed's ``PipeModelDataParallelTopology(num_pp=pp,
    num_mp=tp, num_dp=dp x cp)`` (tp fastest), its data axis cut into CP groups of cp consecutive data indices
    (``ParallelGrid._build_context_axes``)."""
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    topology = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp * cp)
    out = {}
    for rank in range(topology.world_size()):
        coord = topology.get_coord(rank)
        out[rank] = {"tp": coord.model, "cp": coord.data % cp, "dp": coord.data // cp, "pp": coord.pipe}
    return out


def draw_rank_grid(path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    coords = rank_coordinates(**LAYOUT)
    tp, cp, dp, pp = (LAYOUT[k] for k in ("tp", "cp", "dp", "pp"))
    fig, ax = plt.subplots(figsize=(7.2, 3.6), dpi=100)
    colors = plt.colormaps["Pastel1"]
    w = 1.4  # a rank's box width (its height is 1)
    # x: pipeline stage, then tp inside it; y: data-parallel replica, then cp inside it.
    for rank, c in coords.items():
        x = c["pp"] * (tp * w + 0.6) + c["tp"] * w
        y = (dp - 1 - c["dp"]) * (cp + 0.6) + (cp - 1 - c["cp"])
        ax.add_patch(Rectangle((x, y), w - 0.08, 0.88, facecolor=colors(c["dp"] * cp + c["cp"]), edgecolor="black"))
        ax.text(x + w / 2, y + 0.55, f"rank {rank}", ha="center", va="center", fontsize=9, weight="bold")
        ax.text(x + w / 2, y + 0.22, f"tp{c['tp']} cp{c['cp']}", ha="center", va="center", fontsize=7)
    for s in range(pp):
        ax.text(s * (tp * w + 0.6) + tp * w / 2, dp * (cp + 0.6) - 0.35, f"pipeline stage {s}", ha="center", fontsize=9)
    for d in range(dp):
        ax.text(-0.15, (dp - 1 - d) * (cp + 0.6) + cp / 2, f"replica dp{d}", ha="right", va="center", fontsize=9,
                rotation=90)
    ax.set_xlim(-0.5, pp * (tp * w + 0.6))
    ax.set_ylim(-0.2, dp * (cp + 0.6))
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"{len(coords)} ranks as tp {tp} x cp {cp} x dp {dp} x pp {pp}\n"
                 "side by side: a TP group; one above the other: a CP group", fontsize=9)
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return path


def train(args: list[str], out: Path) -> Path:
    """One ``launch/train.py`` run in a plain process, in ``out``."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    subprocess.run([sys.executable, str(ROOT / "launch" / "train.py"), *args, "--out", str(out)], check=True,
                   cwd=ROOT, env=env)
    return out


def draw_loss_curve(path: Path, work: Path) -> Path:
    from zoo.training.train import plot_losses

    run = train(LOSS_RUN, work / "gpt-tiny")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return plot_losses(records, path)


def draw_segmentation(path: Path, work: Path) -> Path:
    run = train(SEGMENTATION_RUN, work / "seg")
    grid = max((run / "samples").glob("step_*.png"))  # the run's own grid, drawn from its export
    shutil.copyfile(grid, path)
    return path


def draw_diffusion(path: Path, work: Path) -> Path:
    from zoo.generate.unet import sample_grid

    run = train(DIFFUSION_RUN, work / "flow")
    if (run / "samples.png").is_file():  # the run's own 16 samples from its export
        shutil.copyfile(run / "samples.png", path)
        return path
    return sample_grid(run, path, num=16, seed=0)


PICTURES = {"rank-grid": lambda p, w: draw_rank_grid(p), "loss-curve": draw_loss_curve,
            "segmentation": draw_segmentation, "diffusion-samples": draw_diffusion}


def shrink(path: Path) -> None:
    """Re-save as an optimized palette PNG when it is larger than the limit."""
    if path.stat().st_size <= MAX_BYTES:
        return
    from PIL import Image

    Image.open(path).convert("RGB").quantize(colors=128).save(path, optimize=True)
    if path.stat().st_size > MAX_BYTES:
        raise SystemExit(f"{path} is {path.stat().st_size} bytes, over {MAX_BYTES}")


def main(argv=None) -> int:
    names = (sys.argv[1:] if argv is None else argv) or list(PICTURES)
    unknown = sorted(set(names) - set(PICTURES))
    if unknown:
        print(f"error: unknown pictures {unknown}; known: {', '.join(PICTURES)}", file=sys.stderr)
        return 2
    IMAGES.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            path = PICTURES[name](IMAGES / f"{name}.png", Path(tmp))
            shrink(path)
            print(f"wrote {path.relative_to(ROOT)} ({path.stat().st_size // 1000} KB)")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())

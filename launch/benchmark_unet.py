"""Training images/s of zoo's diffusion U-Net against diffusers' UNet2DModel of the same config.

    python launch/benchmark_unet.py                                   # tiny preset, batch 16, fp32 on the CPU
    python launch/benchmark_unet.py --preset ddpm-32 --batch-size 32 --dtype bf16 --device cuda
    python launch/benchmark_unet.py --help                            # all flags
"""

import sys

from zoo.progress import no_bars_in_logs

no_bars_in_logs()  # in a log file no \r-drawn bars: before any library imports tqdm

from zoo.bench.unet import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

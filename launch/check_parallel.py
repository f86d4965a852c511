"""Smoke test of tensor parallelism on this machine or cluster.

    python launch/check_parallel.py                                  # one process
    torchrun --nproc_per_node 2 launch/check_parallel.py --tp 2
    # or: deepspeed --num_gpus 2 launch/check_parallel.py --tp 2

Builds a column/row-parallel MLP at the given tp, runs forward and backward, and compares output and gradients
with the same MLP computed unsharded on every rank. Prints the max difference; exits 1 above the tolerance.
"""

import sys

from zoo.progress import no_bars_in_logs

no_bars_in_logs()  # in a log file no \r-drawn bars: before any library imports tqdm

from zoo.parallel.check import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

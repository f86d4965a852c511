"""Per-rank activation memory and step time of long sequences at cp = 1, 2, 4, and the longest that fits a budget.

    python launch/benchmark_long_context.py                                   # tiny Llama, 2k..32k tokens, cp 1 2 4
    python launch/benchmark_long_context.py --seq-lengths 2048 4096 8192 --cp 1 2 --memory-budget-gb 80
    python launch/benchmark_long_context.py --help                            # all flags

It spawns the ranks of each cp itself (no launcher): run it as one plain process.
"""

import sys

from zoo.progress import no_bars_in_logs

no_bars_in_logs()  # in a log file no \r-drawn bars: before any library imports tqdm

from zoo.bench.long_context import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

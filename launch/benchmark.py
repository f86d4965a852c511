"""Training tokens/s of zoo's GPT against transformers' GPT2LMHeadModel / LlamaForCausalLM of the same size.

    python launch/benchmark.py                        # both styles, CPU-sized defaults (about a minute on 2 cores)
    python launch/benchmark.py --style llama --steps 20 --json runs/bench.json
    python launch/benchmark.py --preset gpt2-124m --dtype bf16          # on a GPU
    python launch/benchmark.py --help                                   # all flags
"""

import sys

from zoo.cli import benchmark

if __name__ == "__main__":
    sys.exit(benchmark())

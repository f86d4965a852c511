"""Tokenize text into a Megatron indexed dataset (OUT.bin/OUT.idx); see zoo/data/preprocess.py for the formats.

    python launch/preprocess.py --input docs.jsonl --output-prefix data/docs --tokenizer tok/
    python launch/preprocess.py --input embedded --output-prefix data/pydoc \
        --train-tokenizer --vocab-size 8192 --tokenizer-out tok/
"""

import sys

from zoo.cli import preprocess

if __name__ == "__main__":
    sys.exit(preprocess())

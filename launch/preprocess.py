"""Tokenize text into a Megatron indexed dataset (OUT.bin/OUT.idx); see zoo/data/preprocess.py for the formats.

    python launch/preprocess.py --input docs.jsonl --output-prefix data/docs --tokenizer tok/
    python launch/preprocess.py --input embedded --output-prefix data/pydoc \
        --train-tokenizer --vocab-size 8192 --tokenizer-out tok/
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zoo.progress import no_bars_in_logs  # noqa: E402

no_bars_in_logs()  # in a log file no \r-drawn bars: before any library imports tqdm

from zoo.data.preprocess import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

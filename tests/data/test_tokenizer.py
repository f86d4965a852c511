"""Tests for the byte-level BPE tokenizer (zoo/data/tokenizer.py): exact round trips and offline reload."""

import pytest
from transformers import AutoTokenizer

from zoo.data.corpus import embedded_documents
from zoo.data.tokenizer import EOS_TOKEN, load_tokenizer, train_bpe_tokenizer

SAMPLES = [
    "naïve café — 東京",
    "def f(x):\n    return x  # trailing  \n\n",
    "  leading and trailing spaces  ",
    "\t\ttabs\r\nand CRLF\n",
    "Hello , world ! don 't",
    "emoji 🙂 and \x00 nul",
    "",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    train_bpe_tokenizer(embedded_documents(), 1024, out)
    return out


def test_reload_round_trips_exactly(trained):
    tok = AutoTokenizer.from_pretrained(trained, local_files_only=True)
    for text in SAMPLES:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
        # Special tokens must not be added implicitly either: a round trip with the default is exact too.
        assert tok.decode(tok.encode(text)) == text


def test_vocab_and_eos(trained):
    tok = load_tokenizer(trained)
    assert len(tok) <= 1024
    assert tok.eos_token == EOS_TOKEN
    assert tok.eos_token_id is not None and tok.convert_ids_to_tokens(tok.eos_token_id) == EOS_TOKEN
    # BPE merges were actually learned: common English compresses below one token per byte.
    text = embedded_documents()[0][:2000]
    assert len(tok.encode(text)) < 0.6 * len(text.encode())


def test_load_tokenizer_empty_folder(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer files") as err:
        load_tokenizer(tmp_path)
    msg = str(err.value)
    assert "\n" not in msg and "tokenizer.json" in msg


def test_too_small_vocab(tmp_path):
    with pytest.raises(ValueError, match="257"):
        train_bpe_tokenizer(["abc"], 100, tmp_path)

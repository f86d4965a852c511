"""Train and load a byte-level BPE tokenizer, stored in the HuggingFace format.

The scheme is GPT-2's: text is first mapped to bytes, each byte to one of 256 printable symbols, and BPE merges are
learned over those symbols. Every string is therefore encodable with no unknown token, and decoding gives back
the exact input bytes. Training uses the ``tokenizers`` library; the result is wrapped in a
``PreTrainedTokenizerFast`` and saved with ``save_pretrained``, so ``AutoTokenizer.from_pretrained(folder)`` loads
it offline, with no custom code.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"
# A folder holding any of these can be loaded by AutoTokenizer without a network.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | os.PathLike) -> PreTrainedTokenizerFast:
    """Learn a byte-level BPE of at most ``vocab_size`` tokens from ``texts``; save it to ``out_dir`` and return it.

    ``<|endoftext|>`` is the only special token (id 0) and serves as eos, bos, unk and pad: one separator between
    documents is all a GPT-style model needs, and byte-level BPE never produces an unknown token anyway.
    """
    # 256 byte symbols plus the special token are the floor: below that some byte would have no token.
    if vocab_size < 257:
        raise ValueError(f"vocab_size={vocab_size} is below 257 (256 bytes + {EOS_TOKEN}); pass vocab_size >= 257")
    tok = Tokenizer(models.BPE())
    # add_prefix_space=False: a prefix space would be added on encode and kept on decode, breaking the round trip.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # trim_offsets=False keeps offsets pointing at the exact characters, spaces included.
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        # Seed with all 256 bytes, not only those seen, so unseen characters still encode.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        unk_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        # The default cleanup removes spaces before punctuation on decode, which would break the exact round trip.
        clean_up_tokenization_spaces=False,
    )
    os.makedirs(out_dir, exist_ok=True)
    hf.save_pretrained(out_dir)
    # transformers 5 records its class as "TokenizersBackend", a name 4.x does not know; "PreTrainedTokenizerFast"
    # names the same tokenizer.json-backed class in both, so the folder loads with either major version.
    config_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
    return hf


def load_tokenizer(path: str | os.PathLike):
    """``AutoTokenizer.from_pretrained`` on a local folder, offline, with a clear error if it holds no tokenizer."""
    if not os.path.isdir(path):
        raise ValueError(f"tokenizer folder {path} does not exist; pass a folder written by train_bpe_tokenizer "
                         f"or save_pretrained")
    if not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        raise ValueError(f"no tokenizer files in {path} (expected {' or '.join(TOKENIZER_FILES)}); "
                         f"train one with train_bpe_tokenizer or point at a save_pretrained folder")
    # local_files_only: a path must never turn into a hub download. trust_remote_code stays at its False default.
    return AutoTokenizer.from_pretrained(path, local_files_only=True)

"""Instruction data for supervised fine-tuning: JSONL examples -> fixed-length ``(input_ids, labels)`` samples.

Each line of the file is one example, in either form::

    {"prompt": "reverse: abc\\n", "response": "cba"}
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}, ...]}

How an example becomes tokens (loss is taken only on the tokens marked *trained*):

- prompt/response: the prompt verbatim (not trained), then the response verbatim and EOS (trained). Nothing is
  inserted between them: end the prompt with the separator the model should see (": ", "\\n", ...). Special
  tokens the tokenizer puts in front of a text (Llama's BOS) come first.
- messages, tokenizer with a chat template: the conversation is rendered with ``apply_chat_template``. The trained
  span of assistant turn k is what rendering turns ``[:k+1]`` adds to rendering ``[:k]`` with the generation prompt:
  the reply and the template's end of turn. EOS follows it unless the span holds EOS already.
- messages, no chat template (fallback): each turn is ``"<role>: <content>\\n"``, except an assistant turn, which
  is ``"assistant: "`` (not trained) and ``<content><eos>`` (trained): EOS closes it instead of the newline.

Each text piece is tokenized on its own, as at inference, where the prompt is tokenized and the reply generated.
Samples are one example each, never packed: the first ``seq_length + 1`` tokens (longer examples are truncated and
counted), padded with the pad (else EOS) token whose labels are -100. Labels are the next tokens: ``labels[t]`` is
token ``t + 1`` where that token is trained, else -100.

Index ``i`` of a dataset (any ``i >= 0``) is example ``perm_e[i mod N]`` of epoch ``e = i // N``, ``perm_e`` a
permutation seeded by ``(seed, e)``: a pure function of (data, seed, i), so a resumed run sees the same samples.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

IGNORE_INDEX = -100
FORMS = '{"prompt": ..., "response": ...} or {"messages": [{"role": ..., "content": ...}, ...]}'


class InstructError(ValueError):
    """Unusable instruction data; the message is one line naming the file, the line and what is expected."""


# ---------------------------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Example:
    line: int  # 1-based line in its file, for messages
    prompt: str | None = None
    response: str | None = None
    messages: list | None = None


def _check_messages(messages, where: str) -> list:
    if not isinstance(messages, list) or not messages:
        raise InstructError(f"{where}: \"messages\" must be a non-empty list of {{\"role\": ..., \"content\": ...}}")
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise InstructError(f"{where}: message {k} must be {{\"role\": <string>, \"content\": <string>}}, "
                                f"got {json.dumps(m)[:80]}")
    if not any(m["role"] == "assistant" for m in messages):
        raise InstructError(f"{where}: the conversation has no assistant turn (role \"assistant\"), so nothing to "
                            f"train on")
    return messages


def read_examples(path: str | Path) -> list[Example]:
    """Every example of a JSONL file, checked; blank lines are skipped."""
    path = Path(path)
    if not path.is_file():
        raise InstructError(f"instruction data {path} does not exist" if not path.exists() else
                            f"instruction data {path} is not a file")
    examples = []
    with open(path, encoding="utf-8") as f:
        for n, text in enumerate(f, start=1):
            if not text.strip():
                continue
            where = f"{path} line {n}"
            try:
                obj = json.loads(text)
            except ValueError as e:
                raise InstructError(f"{where} is not JSON ({e.msg}); each line is one example: {FORMS}") from None
            if not isinstance(obj, dict):
                raise InstructError(f"{where} is a JSON {type(obj).__name__}; each line is one example: {FORMS}")
            if "messages" in obj:
                examples.append(Example(n, messages=_check_messages(obj["messages"], where)))
                continue
            missing = [k for k in ("prompt", "response") if k not in obj]
            if missing:
                raise InstructError(f"{where}: missing key(s) {missing} (has {sorted(obj)}); expected {FORMS}")
            for key in ("prompt", "response"):
                if not isinstance(obj[key], str):
                    raise InstructError(f"{where}: \"{key}\" must be a string, got {type(obj[key]).__name__}")
            if not obj["response"]:
                raise InstructError(f"{where}: \"response\" is empty, so nothing to train on")
            examples.append(Example(n, prompt=obj["prompt"], response=obj["response"]))
    if not examples:
        raise InstructError(f"instruction data {path} holds no examples; each line is one example: {FORMS}")
    return examples


# ---------------------------------------------------------------------------------------------------------------
# Tokenizing
# ---------------------------------------------------------------------------------------------------------------


def _leading_special_ids(tokenizer) -> list[int]:
    """The special tokens the tokenizer puts in front of a text (Llama: [BOS]; GPT-2 style: none)."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a", add_special_tokens=True)["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return full[:start]
    return []


def _template_segments(tokenizer, messages: list, where: str) -> list[tuple[str, bool]]:
    """``(text, trained)`` pieces of a conversation rendered with the tokenizer's chat template."""
    def render(msgs, generation_prompt=False):
        try:
            return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as e:  # jinja errors of all kinds: the template's own message says what it wanted
            raise InstructError(f"{where}: the chat template failed on this conversation: "
                                f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None

    full = render(messages)
    segments, pos = [], 0
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if k == 0:
            raise InstructError(f"{where}: the conversation starts with an assistant turn; with a chat template, "
                                f"put a user (or system) message before it")
        before, through = render(messages[:k], True), render(messages[:k + 1])
        if not (through.startswith(before) and full.startswith(through)) or len(before) < pos:
            raise InstructError(f"{where}: the chat template does not render the conversation turn by turn "
                                f"(rendering turns 0..{k} is not a prefix of the whole), so assistant turn {k} "
                                f"cannot be located")
        segments += [(full[pos:len(before)], False), (full[len(before):len(through)], True)]
        pos = len(through)
    segments.append((full[pos:], False))
    return segments


def encode_example(tokenizer, example: Example, *, use_template: bool | None = None,
                   where: str = "example") -> tuple[list[int], list[bool]]:
    """Token ids of an example and, for each, whether the loss is taken on it (see the module docstring)."""
    eos = tokenizer.eos_token_id
    if use_template is None:
        use_template = bool(getattr(tokenizer, "chat_template", None))
    if example.messages is None:
        segments = [(example.prompt, False), (example.response, True)]
    elif use_template:
        segments = _template_segments(tokenizer, example.messages, where)
    else:
        segments = []
        for m in example.messages:
            if m["role"] == "assistant":
                segments += [("assistant: ", False), (m["content"], True)]
            else:
                segments.append((f"{m['role']}: {m['content']}\n", False))
    ids: list[int] = [] if example.messages is not None and use_template else _leading_special_ids(tokenizer)
    trained = [False] * len(ids)
    for text, is_trained in segments:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
        if is_trained and eos not in piece:
            piece = piece + [eos]
        ids += piece
        trained += [is_trained] * len(piece)
    return ids, trained


def to_sample(ids: list[int], trained: list[bool], seq_length: int, pad_id: int):
    """``(input_ids [s], labels [s])`` of one example: its first s + 1 tokens, padded; labels -100 where untrained."""
    ids, trained = ids[:seq_length + 1], trained[:seq_length + 1]
    n = len(ids) - 1  # positions that have a next token
    input_ids = torch.full((seq_length,), pad_id, dtype=torch.long)
    labels = torch.full((seq_length,), IGNORE_INDEX, dtype=torch.long)
    if n > 0:
        input_ids[:n] = torch.tensor(ids[:n])
        nxt = torch.tensor(ids[1:])
        labels[:n] = torch.where(torch.tensor(trained[1:]), nxt, torch.full_like(nxt, IGNORE_INDEX))
    return input_ids, labels


# ---------------------------------------------------------------------------------------------------------------
# Datasets
# ---------------------------------------------------------------------------------------------------------------


class InstructDataset:
    """Fixed-length samples, addressable by any index ``i >= 0`` (epochs repeat the examples, each shuffled by
    ``(seed, epoch)``; ``seed=None``: file order, for validation)."""

    def __init__(self, input_ids: torch.Tensor, labels: torch.Tensor, seed: int | None = None):
        if len(input_ids) == 0:
            raise InstructError("an instruction dataset needs at least one example")
        self.input_ids, self.labels, self.seed = input_ids, labels, seed  # [N, s] each
        self._perm: tuple[int, torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.input_ids)

    def order(self, epoch: int) -> torch.Tensor:
        """The example order of one epoch (a pure function of seed and epoch)."""
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = (epoch, torch.randperm(len(self), generator=g))
        return self._perm[1]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if index < 0:
            raise IndexError(f"sample index {index} < 0")
        epoch, pos = divmod(int(index), len(self))
        j = pos if self.seed is None else int(self.order(epoch)[pos])
        return self.input_ids[j], self.labels[j]


@dataclass
class InstructData:
    train: InstructDataset
    valid: InstructDataset | None
    sample_prompt: list[int]  # token ids of the first validation prompt (the first training one without validation)
    examples: int = 0  # training examples
    truncated: int = 0  # examples (train and valid) longer than seq_length + 1 tokens
    emptied: int = 0  # of those, examples left with no trained token
    conversations: int = 0  # examples given as messages (train and valid)
    chat_template: bool = False  # whether conversations were rendered with the tokenizer's chat template

    def summary(self) -> str:
        valid = "none" if self.valid is None else f"{len(self.valid)} examples"
        how = "the chat template" if self.chat_template else "the 'role: content' fallback (no chat template)"
        chats = f"; {self.conversations} conversations rendered with {how}" if self.conversations else ""
        return f"instruction data: {self.examples} training examples, validation {valid}{chats}"


def _tokenize_all(tokenizer, examples, seq_length, pad_id, path, use_template):
    rows, counts = [], [0, 0]
    for ex in examples:
        ids, trained = encode_example(tokenizer, ex, use_template=use_template, where=f"{path} line {ex.line}")
        input_ids, labels = to_sample(ids, trained, seq_length, pad_id)
        if len(ids) > seq_length + 1:
            counts[0] += 1
            counts[1] += int(bool((labels == IGNORE_INDEX).all()))
        rows.append((input_ids, labels, ids[:trained.index(True)] if True in trained else ids))
    return rows, counts


def load_instruct_data(path, tokenizer, seq_length: int, seed: int, *, valid_path=None,
                       valid_fraction: float = 0.0) -> InstructData:
    """Read, check and tokenize the training (and validation) examples; hold out ``valid_fraction`` of the training
    file (a seeded choice, kept in file order) when no validation file is given."""
    if tokenizer.eos_token_id is None:
        raise InstructError(f"the tokenizer ({type(tokenizer).__name__}) has no eos_token; each response ends with "
                            f"EOS, so set one (tokenizer_config.json \"eos_token\")")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    use_template = bool(getattr(tokenizer, "chat_template", None))
    train_ex = read_examples(path)
    valid_ex = read_examples(valid_path) if valid_path is not None else []
    if valid_path is None and valid_fraction > 0:
        n_valid = math.ceil(len(train_ex) * valid_fraction)
        if n_valid >= len(train_ex):
            raise InstructError(f"{path} has {len(train_ex)} example(s): too few to hold out {valid_fraction:g} for "
                                f"validation; pass --valid-data FILE or --set data.valid_fraction=0")
        g = torch.Generator().manual_seed(seed)
        held = set(torch.randperm(len(train_ex), generator=g)[:n_valid].tolist())
        valid_ex = [ex for i, ex in enumerate(train_ex) if i in held]
        train_ex = [ex for i, ex in enumerate(train_ex) if i not in held]
    train_rows, (trunc, emptied) = _tokenize_all(tokenizer, train_ex, seq_length, pad_id, path, use_template)
    valid_rows, (v_trunc, v_emptied) = _tokenize_all(tokenizer, valid_ex, seq_length, pad_id,
                                                     valid_path or path, use_template)
    if all(bool((labels == IGNORE_INDEX).all()) for _, labels, _ in train_rows):
        raise InstructError(f"{path}: no example keeps a response token within seq_length {seq_length}; raise "
                            f"training.seq_length or shorten the prompts")

    def dataset(rows, seed_):
        return InstructDataset(torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows]), seed_)

    first = (valid_rows or train_rows)[0][2][:seq_length]
    return InstructData(dataset(train_rows, seed), dataset(valid_rows, None) if valid_rows else None, first,
                        examples=len(train_rows), truncated=trunc + v_trunc, emptied=emptied + v_emptied,
                        conversations=sum(ex.messages is not None for ex in train_ex + valid_ex),
                        chat_template=use_template)

"""Instruction data: which tokens carry labels (prompt/response, chat template, fallback), padding and truncation,
the purity of the shuffled index, and one-line errors for bad files. Expected token ids are computed here from the
tokenizer, piece by piece, not taken from the code under test."""

from __future__ import annotations

import json

import pytest
import torch

from zoo.data.instruct import (
    IGNORE_INDEX,
    Example,
    InstructError,
    encode_example,
    load_instruct_data,
    read_examples,
    to_sample,
)

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from zoo.data.tokenizer import train_bpe_tokenizer

    folder = tmp_path_factory.mktemp("tok")
    texts = ["reverse abc: cba", "user: hello\nassistant: hi there", "<|user|>what is two\n<|assistant|>2\n"] * 20
    train_bpe_tokenizer(texts, 300, folder)
    return folder


@pytest.fixture
def tok(tok_dir):
    from zoo.data.tokenizer import load_tokenizer

    return load_tokenizer(tok_dir)  # fresh each test: some set a chat template


def enc(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def labelled(labels):
    return labels[labels != IGNORE_INDEX].tolist()


def test_prompt_response_labels_and_padding(tok):
    eos = tok.eos_token_id
    prompt, response = enc(tok, "reverse abc:"), enc(tok, " cba")
    ids, trained = encode_example(tok, Example(1, prompt="reverse abc:", response=" cba"))
    assert ids == prompt + response + [eos]
    assert trained == [False] * len(prompt) + [True] * (len(response) + 1)

    s = 24
    input_ids, labels = to_sample(ids, trained, s, pad_id=tok.pad_token_id)
    n = len(ids)
    assert input_ids[:n - 1].tolist() == ids[:-1] and (input_ids[n - 1:] == tok.pad_token_id).all()
    # labels[t] is token t + 1: -100 while the next token is still the prompt, then the response and EOS, then padding
    expected = [IGNORE_INDEX] * (len(prompt) - 1) + response + [eos] + [IGNORE_INDEX] * (s - n + 1)
    assert labels.tolist() == expected


def test_truncation_is_counted(tok, tmp_path):
    long_prompt = "reverse " + "abc " * 30 + ":"
    rows = [{"prompt": "reverse abc:", "response": " cba"},
            {"prompt": "reverse ab:", "response": " ba" * 40},  # response cut: keeps some labels
            {"prompt": long_prompt, "response": " x"}]  # prompt alone fills the sample: no label left
    data = load_instruct_data(write_jsonl(tmp_path / "d.jsonl", rows), tok, 16, seed=0)
    assert (data.examples, data.truncated, data.emptied) == (3, 2, 1)
    by_prompt = {tuple(x.tolist()): y for x, y in zip(data.train.input_ids, data.train.labels)}
    cut = enc(tok, "reverse ab:") + enc(tok, " ba" * 40)
    labels = by_prompt[tuple(cut[:16])]
    assert labels.tolist() == [IGNORE_INDEX] * (len(enc(tok, "reverse ab:")) - 1) + cut[len(enc(tok, "reverse ab:")):17]
    assert (by_prompt[tuple(enc(tok, long_prompt)[:16])] == IGNORE_INDEX).all()


def test_chat_template_labels_only_assistant_turns(tok):
    tok.chat_template = TEMPLATE
    eos = tok.eos_token_id
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is two"},
                {"role": "assistant", "content": "2"}, {"role": "user", "content": "and three"},
                {"role": "assistant", "content": "3"}]
    ids, trained = encode_example(tok, Example(1, messages=messages))
    prompt1 = "<|system|>be brief\n<|user|>what is two\n<|assistant|>"
    prompt2 = "<|user|>and three\n<|assistant|>"
    expected = (enc(tok, prompt1) + enc(tok, "2\n") + [eos] + enc(tok, prompt2) + enc(tok, "3\n") + [eos])
    assert ids == expected
    # the trained tokens are exactly each reply with the template's end of turn, plus EOS
    assert [i for i, t in zip(ids, trained) if t] == enc(tok, "2\n") + [eos] + enc(tok, "3\n") + [eos]

    # A template that closes turns with EOS itself gets no second one.
    tok.chat_template = TEMPLATE.replace("}}\n{% endfor %}", "}}<|endoftext|>{% endfor %}")
    assert tok.chat_template != TEMPLATE
    ids, trained = encode_example(tok, Example(1, messages=messages[:3]))
    assert [i for i, t in zip(ids, trained) if t] == enc(tok, "2") + [eos]


def test_fallback_format_without_template(tok):
    assert not tok.chat_template
    eos = tok.eos_token_id
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"},
                {"role": "user", "content": "bye"}]
    ids, trained = encode_example(tok, Example(1, messages=messages))
    assert ids == enc(tok, "user: hello\n") + enc(tok, "assistant: ") + enc(tok, "hi there") + [eos] + \
        enc(tok, "user: bye\n")
    assert [i for i, t in zip(ids, trained) if t] == enc(tok, "hi there") + [eos]
    _, labels = to_sample(ids, trained, 64, tok.pad_token_id)
    assert tok.decode(labelled(labels)) == "hi there<|endoftext|>"


def test_index_is_pure_and_each_epoch_a_permutation(tok, tmp_path):
    rows = [{"prompt": f"reverse {w}:", "response": f" {w[::-1]}"} for w in ("abc", "bca", "cab", "ab", "ba", "c", "a")]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    a = load_instruct_data(path, tok, 16, seed=7).train
    b = load_instruct_data(path, tok, 16, seed=7).train
    n = len(a)
    forward = [a[i] for i in range(3 * n)]
    backward = [b[i] for i in reversed(range(3 * n))][::-1]  # another access order, another object
    assert all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(forward, backward))
    rows_of = {tuple(x.tolist()): k for k, x in enumerate(a.input_ids)}
    epochs = [[rows_of[tuple(forward[e * n + j][0].tolist())] for j in range(n)] for e in range(3)]
    assert all(sorted(order) == list(range(n)) for order in epochs)
    assert epochs[0] != epochs[1] or epochs[1] != epochs[2]  # reshuffled between epochs
    other = load_instruct_data(path, tok, 16, seed=8).train
    assert [rows_of[tuple(other[j][0].tolist())] for j in range(n)] != epochs[0]
    with pytest.raises(IndexError):
        a[-1]


def test_held_out_split_is_seeded_and_disjoint(tok, tmp_path):
    rows = [{"prompt": f"reverse {c}{d}:", "response": f" {d}{c}"} for c in "abcd" for d in "abcde"]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    data = load_instruct_data(path, tok, 16, seed=3, valid_fraction=0.25)
    assert (len(data.train), len(data.valid)) == (15, 5)
    train = {tuple(x.tolist()) for x in data.train.input_ids}
    valid = [tuple(x.tolist()) for x in data.valid.input_ids]
    assert not train & set(valid)
    again = load_instruct_data(path, tok, 16, seed=3, valid_fraction=0.25)
    assert [tuple(x.tolist()) for x in again.valid.input_ids] == valid
    assert data.valid[len(data.valid) + 1][0].tolist() == list(valid[1])  # validation wraps in file order
    assert data.sample_prompt == list(valid[0])[:len(data.sample_prompt)]  # the first validation prompt
    sep = load_instruct_data(path, tok, 16, seed=3, valid_path=write_jsonl(tmp_path / "v.jsonl", rows[:2]))
    assert (len(sep.train), len(sep.valid)) == (20, 2)


@pytest.mark.parametrize("lines, message", [
    (['{"prompt": "a", "response": "b"}', "not json"], "line 2 is not JSON"),
    (['{"prompt": "a"}'], "line 1: missing key(s) ['response']"),
    (['{"text": "a"}'], 'missing key(s) [\'prompt\', \'response\'] (has [\'text\']); expected {"prompt"'),
    (['{"messages": [{"role": "user", "content": "hi"}]}'], "line 1: the conversation has no assistant turn"),
    (['{"messages": [{"role": "user"}]}'], "message 0 must be"),
    (['[1, 2]'], "line 1 is a JSON list"),
    (['{"prompt": "a", "response": 3}'], '"response" must be a string'),
])
def test_bad_lines(tmp_path, lines, message):
    with pytest.raises(InstructError) as e:
        read_examples(write_jsonl(tmp_path / "d.jsonl", lines))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_bad_files(tmp_path):
    with pytest.raises(InstructError, match="does not exist"):
        read_examples(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n  \n")
    with pytest.raises(InstructError, match="holds no examples"):
        read_examples(tmp_path / "empty.jsonl")

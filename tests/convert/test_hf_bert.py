"""HuggingFace <-> zoo for BERT: outputs equal at every layout, round trips bit-exact, bad input refused in one line.

Small random HF models (BertForMaskedLM, BertForSequenceClassification, BertForPreTraining, and a BertModel
dressed as a sentence-transformers folder), each with a tiny WordPiece tokenizer, are saved in a temporary folder
and imported with ``hf_to_zoo_bert``. ``verify`` runs in one 4-rank gloo pool at (tp, pp) in {1, 2} x {1, 2} for the
MLM and classification models (the other two at tp=2, pp=2) on a batch whose last row ends in padding, and once
as the ``launch/convert.py verify`` command; the round trips go through the command's ``main`` too.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from zoo.convert import io, registry
from zoo.convert.bert import (
    HEAD_OF,
    IGNORED,
    ConvertError,
    bert_config_from_hf,
    check_bert_hf,
    hf_rows,
    hf_to_zoo_bert,
    zoo_bert_config,
    zoo_to_hf_bert,
)
from zoo.convert.cli import main
from zoo.convert.gpt import check_hf

VOCAB = 300  # > the tokenizer's entries; not a multiple of 128, so zoo pads it at load
TOL = 1e-4
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (tp, pp)
LABELS = {0: "negative", 1: "neutral", 2: "positive"}
WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijklmnopqrstuvwxyz", "the", "quick", "brown", "fox",
         "jumps", "over", "lazy", "dog", "##s", "##ed"]
ARCHS = {"mlm": "BertForMaskedLM", "cls": "BertForSequenceClassification", "pretraining": "BertForPreTraining",
         "sentence": "BertModel"}
ST_FILES = {"modules.json": [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                             {"idx": 1, "name": "1", "path": "1_Pooling",
                              "type": "sentence_transformers.models.Pooling"}],
            "sentence_bert_config.json": {"max_seq_length": 64, "do_lower_case": False},
            "1_Pooling/config.json": {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True}}


# ---------------------------------------------------------------------------------------------------------------
# Small HF models on disk
# ---------------------------------------------------------------------------------------------------------------


def hf_config(**overrides):
    from transformers import BertConfig

    return BertConfig(**{**dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                intermediate_size=128, max_position_embeddings=64, pad_token_id=0,
                                id2label=LABELS, label2id={v: k for k, v in LABELS.items()}), **overrides})


def hf_model(arch: str, seed: int = 0, **overrides):
    """A HF model whose every weight is moved away from its init (LayerNorm weights ~1, the rest ~N(0, 0.1)), so a
    swapped norm, a dropped bias or a mis-ordered head shows in the outputs."""
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, arch)(hf_config(**overrides)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.1
            p.copy_(1.0 + noise if "LayerNorm.weight" in name else noise)
    return model


def save_tokenizer(folder: Path) -> None:
    from transformers import BertTokenizer

    (folder / "vocab.txt").write_text("\n".join(WORDS) + "\n")
    BertTokenizer(str(folder / "vocab.txt")).save_pretrained(folder)


def save_hf(name: str, folder: Path, seed: int) -> Path:
    hf_model(ARCHS[name], seed).save_pretrained(folder)
    save_tokenizer(folder)
    if name == "sentence":
        for rel, content in ST_FILES.items():
            (folder / rel).parent.mkdir(exist_ok=True)
            (folder / rel).write_text(json.dumps(content))
    return folder


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {name: save_hf(name, root / name, seed) for seed, name in enumerate(ARCHS)}


@pytest.fixture(scope="module")
def zoo_dirs(hf_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("zoo")
    return {name: hf_to_zoo_bert(folder, root / name) for name, folder in hf_dirs.items()}


def hf_tensors(folder: Path) -> dict:
    return {k: t for f in sorted(folder.glob("*.safetensors")) for k, t in load_file(f).items()}


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    """``main(argv)``: exit code, stdout and stderr."""
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def assert_error(capsys, pattern: str, *argv) -> None:
    rc, _, err = run_cli(capsys, *argv)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), (rc, err)
    assert re.search(pattern, lines[0]), lines[0]


def edited_copy(folder: Path, dst: Path, **config) -> Path:
    shutil.copytree(folder, dst)
    meta = json.loads((dst / "config.json").read_text())
    meta.update(config)
    (dst / "config.json").write_text(json.dumps(meta))
    return dst


# ---------------------------------------------------------------------------------------------------------------
# The table (pure)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", list(HEAD_OF))
def test_table_covers_each_class_and_inverts(arch):
    """Every HF tensor is read once (HF's tied copies aside), with the shape the table expects; to_hf(to_zoo(x))
    gives x back exactly; the zoo side is exactly the state dict of zoo's model of that head (BertModel's pooler
    aside, which head None keeps beside the encoder)."""
    from zoo.models.bert import layer_specs
    from zoo.models.specs import SpecSequential

    hf = hf_model(arch)
    head = HEAD_OF[arch]
    cfg = bert_config_from_hf(arch, hf.config)
    rows = hf_rows(cfg, head, "" if arch == "BertModel" else "bert.", pooler=arch == "BertModel")
    state = {k: v for k, v in hf.state_dict().items() if not IGNORED.search(k)}
    assert sorted(k for r in rows for k in r.hf) == sorted(state)
    zoo_keys = set(SpecSequential(layer_specs(cfg, head=head)).state_dict())
    assert {r.zoo for r in rows} - zoo_keys == ({"3.pooler.dense.weight", "3.pooler.dense.bias"} if head is None
                                                 else set())
    assert zoo_keys <= {r.zoo for r in rows}
    g = torch.Generator().manual_seed(0)
    for row in rows:
        assert [tuple(state[k].shape) for k in row.hf] == [tuple(s) for s in row.hf_shapes], row.zoo
        xs = [torch.randn(s, generator=g) for s in row.hf_shapes]
        assert all(torch.equal(a, b) for a, b in zip(xs, row.hf_tensors(row.to_zoo(*xs)))), row.zoo


def test_head_is_recorded_and_inferred(zoo_dirs, tmp_path):
    """The zoo config holds BertConfig's fields plus "head"; a folder without the key (as io.save_model writes)
    gets its head from its family and tensors."""
    expected = {"mlm": ("bert", "mlm"), "cls": ("bert-classifier", "classification"),
                "pretraining": ("bert", "mlm+nsp"), "sentence": ("bert", None)}
    for name, (family, head) in expected.items():
        stored_family, meta = io.read_config(zoo_dirs[name])
        assert stored_family == family and meta["head"] == head
        got_family, cfg, got_head = zoo_bert_config(zoo_dirs[name])
        assert (got_family, got_head, cfg.hidden_size, cfg.num_labels) == (family, head, 64, len(LABELS))
        bare = tmp_path / name
        config = {k: v for k, v in io.read_config(zoo_dirs[name])[1].items() if k != "head"}
        io.write_model_folder(bare, family, config, io.iter_tensors(zoo_dirs[name]))
        assert zoo_bert_config(bare)[2] == head
    assert json.loads((zoo_dirs["cls"] / "labels.json").read_text())["id2label"] == {str(k): v for k, v in
                                                                                     LABELS.items()}


# ---------------------------------------------------------------------------------------------------------------
# verify at every layout (one gloo pool), and that it notices a wrong weight
# ---------------------------------------------------------------------------------------------------------------


def verify_cases(pairs, tp, pp):
    from zoo.convert.verify import verify

    return [verify(hf, zoo, tp, pp, batch=3, seq=24) for hf, zoo in pairs]


def test_verify_every_layout(hf_dirs, zoo_dirs, dist_run):
    """One pool of 4 ranks serves every layout (dp = 4 / (tp x pp) replicas; rank 0's replica is compared)."""
    for tp, pp in LAYOUTS:
        names = ["mlm", "cls"] + (["pretraining", "sentence"] if (tp, pp) == (2, 2) else [])
        pairs = [(str(hf_dirs[n]), str(zoo_dirs[n])) for n in names]
        per_rank = dist_run(4, verify_cases, pairs, tp, pp)
        assert all(r == per_rank[0] for r in per_rank)  # every rank returns rank 0's number
        for name, diff in zip(names, per_rank[0]):
            assert diff < TOL, f"{name} at tp={tp} pp={pp}: max |diff| {diff}"


def test_verify_with_a_memory_cap_streams_both_sides(hf_dirs, zoo_dirs, dist_run):
    """--max-memory at tp=2 for every head: the uncapped number, HF through accelerate's device_map, the zoo side one
    layer at a time. With an MLM head (MLM + NSP here) the tied decoder reads the embedding's rows as it computes
    and is never filled, and HF's embedding and decoder both read theirs from disk; without one, only the
    embeddings do."""
    from tests.convert.test_hf_gpt import capped_and_whole, check_capped
    from zoo.convert.bert import zoo_bert_config
    from zoo.models.bert import layer_specs
    from zoo.models.gpt import ParallelOptions

    shares = [0, 0.75]
    for names, decoder in ((["pretraining"], True), (["cls", "sentence"], False)):
        pairs = [(str(hf_dirs[n]), str(zoo_dirs[n])) for n in names]
        (layers,) = {len(layer_specs(cfg, ParallelOptions(), head))
                     for _, cfg, head in (zoo_bert_config(zoo_dirs[n]) for n in names)}
        result = dist_run(2, capped_and_whole, pairs, 2, shares, batch=3, seq=24)[0]
        check_capped(result, pairs, shares, layers=layers - decoder, vocab_modules=1 + decoder)


def test_verify_notices_a_wrong_weight(hf_dirs, zoo_dirs, tmp_path, dist_run):
    """Q, K and V rows shifted by one head in one block's fused QKV (still the right shape): verify reports it."""
    d = 64 // 4
    tensors = ((k, t.roll(d, dims=0) if k == "1.attention.qkv.weight" else t)
               for k, t in io.iter_tensors(zoo_dirs["cls"]))
    family, config = io.read_config(zoo_dirs["cls"])
    io.write_model_folder(tmp_path / "bad", family, config, tensors)
    (bad,) = dist_run(4, verify_cases, [(str(hf_dirs["cls"]), str(tmp_path / "bad"))], 2, 2)[0]
    assert bad > 1e-2


def verify_command(argv):
    """``launch/convert.py``'s main on this rank, its stdout captured; the pool's process group is kept (the command
    tears it down when it ends, as a launched process exits right after)."""
    import contextlib
    import io as text_io
    from unittest import mock

    out = text_io.StringIO()
    with mock.patch("zoo.parallel.topology.destroy_model_parallel", lambda: None), contextlib.redirect_stdout(out):
        rc = main(argv)
    return rc, out.getvalue()


def test_verify_command_prints_max_abs_diff_last(hf_dirs, zoo_dirs, dist_run):
    """``launch/convert.py verify --tp 2 --pp 2`` on 4 ranks: rank 0 prints max_abs_diff=<float> as its last line."""
    argv = ["verify", "--hf", str(hf_dirs["pretraining"]), "--zoo", str(zoo_dirs["pretraining"]), "--tp", "2",
            "--pp", "2"]
    (rc, out), *others = dist_run(4, verify_command, argv)
    assert rc == 0 and all(r[0] == 0 and "max_abs_diff" not in r[1] for r in others), (rc, out, others)
    lines = out.strip().splitlines()
    m = re.fullmatch(r"max_abs_diff=(\S+)", lines[-1])
    assert m, lines[-3:]
    assert float(m.group(1)) < TOL


# ---------------------------------------------------------------------------------------------------------------
# Round trips through the command line
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,dtype,shard", [("mlm", None, None), ("cls", None, "40KB"), ("pretraining", "bf16", None),
                                              ("sentence", None, None)])
def test_round_trip_bit_exact(name, dtype, shard, hf_dirs, tmp_path, capsys):
    import transformers

    src, zoo, out = hf_dirs[name], tmp_path / "zoo", tmp_path / "hf"
    extra = (["--dtype", dtype] if dtype else []) + (["--max-shard-size", shard] if shard else [])
    assert run_cli(capsys, "hf-to-zoo", "--src", src, "--out", zoo, *extra)[0] == 0
    assert run_cli(capsys, "zoo-to-hf", "--src", zoo, "--out", out, *extra)[0] == 0
    if shard:  # both folders sharded, with an index
        assert (zoo / io.INDEX_FILE).is_file() and (out / "model.safetensors.index.json").is_file()
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "vocab.txt", "README.md"} <= \
        {p.name for p in out.iterdir()}

    original, exported = hf_tensors(src), hf_tensors(out)
    assert sorted(exported) == sorted(original)
    want = torch.bfloat16 if dtype == "bf16" else torch.float32
    for key, t in original.items():
        assert exported[key].dtype == want and torch.equal(exported[key], t.to(want)), key

    meta = json.loads((out / "config.json").read_text())
    assert meta["architectures"] == [ARCHS[name]]
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok("the lazy dogs").input_ids == transformers.AutoTokenizer.from_pretrained(src)("the lazy dogs").input_ids
    batch = tok(["the quick brown fox jumps", "the lazy dog"], padding=True, return_tensors="pt")
    assert batch["attention_mask"][1, -1] == 0  # the second row ends in padding
    auto = {"mlm": transformers.AutoModelForMaskedLM, "cls": transformers.AutoModelForSequenceClassification,
            "pretraining": transformers.AutoModelForPreTraining, "sentence": transformers.AutoModel}[name]
    a = auto.from_pretrained(src, dtype=want).eval()
    b, info = auto.from_pretrained(out, output_loading_info=True)
    assert type(b).__name__ == ARCHS[name] and b.dtype == want
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    if name == "cls":
        assert b.config.id2label == LABELS and b.config.label2id == {v: k for k, v in LABELS.items()}
    with torch.no_grad():
        for x, y in zip(a(**batch).to_tuple(), b.eval()(**batch).to_tuple()):
            assert torch.equal(x, y)


def test_sentence_embedding_folders_import(hf_dirs, zoo_dirs, tmp_path, caplog):
    """A sentence-transformers folder imports as its BertModel (pooler kept), saying what it leaves behind; the old
    layout with the model in 0_Transformer/ gives the same tensors."""
    caplog.set_level(logging.INFO, logger="zoo.convert")
    zoo = hf_to_zoo_bert(hf_dirs["sentence"], tmp_path / "zoo")
    assert re.search(r"sentence-transformers folder; importing its BertModel only, not 1_Pooling/, modules\.json, "
                     r"sentence_bert_config\.json", caplog.text), caplog.text
    assert {"tokenizer.json", "vocab.txt"} <= {p.name for p in zoo.iterdir()}
    assert "modules.json" not in {p.name for p in zoo.iterdir()}
    reference = dict(io.iter_tensors(zoo_dirs["sentence"]))
    assert "3.pooler.dense.weight" in reference
    old = tmp_path / "old"
    shutil.copytree(hf_dirs["sentence"], old / "0_Transformer")
    shutil.move(old / "0_Transformer" / "modules.json", old / "modules.json")
    modules = json.loads((old / "modules.json").read_text())
    modules[0]["path"] = "0_Transformer"
    (old / "modules.json").write_text(json.dumps(modules))
    again = dict(io.iter_tensors(hf_to_zoo_bert(old, tmp_path / "zoo-old")))
    assert sorted(again) == sorted(reference) and all(torch.equal(again[k], reference[k]) for k in reference)


def test_old_names_and_other_heads(hf_dirs, zoo_dirs, tmp_path, caplog, capsys):
    """As bert-base-uncased ships: LayerNorm gamma/beta, a position_ids buffer, the tied decoder copy and the
    pretraining pooler and NSP head under BertForMaskedLM. The same zoo tensors come out, the dropped ones named
    in a log line; a tensor no BERT class knows is refused."""
    caplog.set_level(logging.INFO, logger="zoo.convert")
    legacy = tmp_path / "legacy"
    shutil.copytree(hf_dirs["mlm"], legacy)
    state = {re.sub(r"LayerNorm\.weight$", "LayerNorm.gamma", re.sub(r"LayerNorm\.bias$", "LayerNorm.beta", k)): t
             for k, t in load_file(legacy / "model.safetensors").items()}
    pretraining = load_file(hf_dirs["pretraining"] / "model.safetensors")
    state.update({k: pretraining[k] for k in pretraining if "pooler" in k or "seq_relationship" in k})
    state["bert.embeddings.position_ids"] = torch.arange(64)[None]
    state["cls.predictions.decoder.weight"] = state["bert.embeddings.word_embeddings.weight"].clone()
    save_file(state, legacy / "model.safetensors", metadata={"format": "pt"})
    converted = dict(io.iter_tensors(hf_to_zoo_bert(legacy, tmp_path / "zoo")))
    reference = dict(io.iter_tensors(zoo_dirs["mlm"]))
    assert sorted(converted) == sorted(reference) and all(torch.equal(converted[k], reference[k]) for k in reference)
    assert re.search(r"4 tensor\(s\) of another BERT head dropped, as BertForMaskedLM drops them when loading: "
                     r"bert\.pooler\.dense\.bias", caplog.text), caplog.text
    # A config without "architectures" (model_type bert alone): the class is what the tensors hold.
    anonymous = edited_copy(hf_dirs["cls"], tmp_path / "anonymous", architectures=None)
    assert zoo_bert_config(hf_to_zoo_bert(anonymous, tmp_path / "zoo-anonymous"))[::2] == ("bert-classifier",
                                                                                            "classification")
    state["bert.encoder.layer.0.attention.self.rel_scale"] = torch.ones(4)
    save_file(state, legacy / "model.safetensors", metadata={"format": "pt"})
    assert_error(capsys, r"1 tensor\(s\) the BertForMaskedLM table does not use, e\.g\. "
                 r"\['bert\.encoder\.layer\.0\.attention\.self\.rel_scale'\]", "hf-to-zoo", "--src", legacy, "--out",
                 tmp_path / "zoo2")


# ---------------------------------------------------------------------------------------------------------------
# Bad input: one line each
# ---------------------------------------------------------------------------------------------------------------


def test_bad_input(hf_dirs, zoo_dirs, tmp_path, capsys):
    from zoo.models.gpt import GPTConfig

    out = tmp_path / "out"
    gpt_zoo = io.write_model_folder(tmp_path / "gpt-zoo", "gpt", GPTConfig.from_preset("tiny").to_dict(),
                                    iter([("0.weight", torch.zeros(1))]))
    with pytest.raises(ConvertError, match=r"gpt-zoo holds a checkpoint of another family \('gpt'\); expected one "
                       r"of bert, bert-classifier"):
        zoo_to_hf_bert(gpt_zoo, out)
    gpt_hf = edited_copy(hf_dirs["mlm"], tmp_path / "gpt-hf", architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ConvertError, match="architecture GPT2LMHeadModel is a checkpoint of another family \\(gpt\\)"):
        hf_to_zoo_bert(gpt_hf, out)
    supported = "supported: " + ", ".join(registry.names("transformers"))  # every registered class, in order
    token_cls = edited_copy(hf_dirs["cls"], tmp_path / "token-cls", architectures=["BertForTokenClassification"])
    assert_error(capsys, f"architecture BertForTokenClassification is not supported; {supported}$", "hf-to-zoo",
                 "--src", token_cls, "--out", out)
    relu = edited_copy(hf_dirs["mlm"], tmp_path / "relu", hidden_act="relu")
    assert_error(capsys, "BertForMaskedLM: hidden_act 'relu' is not supported", "hf-to-zoo", "--src", relu,
                 "--out", out)
    untied = edited_copy(hf_dirs["mlm"], tmp_path / "untied", tie_word_embeddings=False)
    assert_error(capsys, "tie_word_embeddings=False is not supported", "hf-to-zoo", "--src", untied, "--out", out)
    relative = edited_copy(hf_dirs["cls"], tmp_path / "relative", position_embedding_type="relative_key")
    assert_error(capsys, "position_embedding_type 'relative_key' is not supported", "hf-to-zoo", "--src", relative,
                 "--out", out)
    shape = edited_copy(hf_dirs["cls"], tmp_path / "shape", intermediate_size=256)
    assert_error(capsys, r"tensor bert\.encoder\.layer\.0\.intermediate\.dense\.weight: checkpoint has shape "
                 r"\(128, 64\), config\.json implies \(256, 64\)", "hf-to-zoo", "--src", shape, "--out", out)
    pickled = tmp_path / "pickled"
    shutil.copytree(hf_dirs["sentence"], pickled)
    torch.save(load_file(pickled / "model.safetensors"), pickled / "pytorch_model.bin")
    (pickled / "model.safetensors").unlink()
    assert_error(capsys, r"pickle checkpoint .*--allow-pickle", "hf-to-zoo", "--src", pickled, "--out", out)
    assert run_cli(capsys, "hf-to-zoo", "--src", pickled, "--out", tmp_path / "from-pickle", "--allow-pickle")[0] == 0
    # verify: the HF side must be the class of the zoo folder's head, of the same size; layouts named up front.
    _, cfg, head = zoo_bert_config(zoo_dirs["mlm"])
    with pytest.raises(ConvertError, match="is a BertForSequenceClassification; the zoo folder's head 'mlm' exports "
                       "as BertForMaskedLM"):
        check_bert_hf(hf_dirs["cls"], cfg, head)
    with pytest.raises(ConvertError, match="a checkpoint of another family \\(gpt\\)"):
        check_bert_hf(gpt_hf, cfg, head)
    with pytest.raises(ConvertError, match="is a BertForMaskedLM, a checkpoint of another family \\(bert\\) than the "
                       "zoo folder's \\(gpt\\)"):
        check_hf(hf_dirs["mlm"], GPTConfig.from_preset("tiny"))
    cfg.hidden_size, cfg.num_attention_heads = 32, 2
    with pytest.raises(ConvertError, match="are different models: hidden_size 64 vs 32"):
        check_bert_hf(hf_dirs["mlm"], cfg, head)
    assert_error(capsys, "num_attention_heads 4 is not divisible by tp 3", "verify", "--hf", hf_dirs["mlm"], "--zoo",
                 zoo_dirs["mlm"], "--tp", "3")
    assert_error(capsys, "num_hidden_layers 2 is smaller than pp 3", "verify", "--hf", hf_dirs["cls"], "--zoo",
                 zoo_dirs["cls"], "--pp", "3")
    # A zoo folder lacking a tensor its head needs.
    tensors = ((k, t) for k, t in io.iter_tensors(zoo_dirs["cls"]) if k != "3.classifier.bias")
    io.write_model_folder(tmp_path / "badzoo", *io.read_config(zoo_dirs["cls"]), tensors)
    assert_error(capsys, r"tensor 3\.classifier\.bias is missing from", "zoo-to-hf", "--src", tmp_path / "badzoo",
                 "--out", out)
    assert not out.exists() and not list(tmp_path.glob(".*tmp"))  # nothing half-written

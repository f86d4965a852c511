"""HuggingFace <-> zoo for Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE: logits and routing equal at every (tp, pp, ep)
layout, round trips bit-exact in both expert layouts, fine-tuning at ep2 x tp2 exports a better HF model.

Four small random HF models (hidden 32, 2 layers, 4 experts; a Qwen2-MoE with its gated shared expert, tied
embeddings and a dense first layer; a Qwen3-MoE with head_dim 12 != 32/4 and a dense second layer; sliding windows
of 5 tokens in Mixtral, Qwen2-MoE (layer 0) and Qwen3-MoE, so every check runs past them) are saved once
per module with ``save_pretrained`` in both layouts transformers writes (one tensor per expert, and fused with
``save_original_format=False``) and imported with ``hf_to_zoo``. ``verify`` runs in one 4-rank gloo pool, one task
per layout verifying all four, against transformers' own models; one torchrun run checks the command end to end.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.convert.test_hf_gpt import assert_error, randomize_, run_cli, save_tokenizer
from tests.mains import run_main
from tests.training.test_finetune import response_loss, reverse_rows
from zoo.convert import io, registry

ROOT = Path(__file__).resolve().parents[2]
VOCAB, EOS, TOL = 300, 0, 1e-4
# (tp, pp, ep, ep_spans_tp); the last: 4 EP ranks (one expert each) on dp 2, the EP groups taking in the TP ranks
LAYOUTS = [(1, 1, 1, False), (2, 1, 1, False), (1, 2, 1, False), (1, 1, 2, False), (2, 1, 2, False),
           (2, 1, 4, True)]
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, rms_norm_eps=1e-6, num_experts_per_tok=2, bos_token_id=EOS,
              eos_token_id=EOS, tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
LAYOUT_NAMES = ("per-expert", "fused")


WINDOW = 5  # shorter than verify's 16 tokens and the generations below: the windows bite


def hf_model(name: str, window: int | None = WINDOW):
    """The tiny model of ``name``; Mixtral's window on every layer, Qwen2-MoE's on layer 0 (its layer_types derived
    from use_sliding_window: the even layers below max_window_layers), Qwen3-MoE's on every layer; OLMoE has none.
    ``window=None``: without."""
    from transformers import (
        MixtralConfig,
        MixtralForCausalLM,
        OlmoeConfig,
        OlmoeForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    if name == "mixtral":
        return MixtralForCausalLM(MixtralConfig(**COMMON, intermediate_size=48, num_local_experts=4,
                                                sliding_window=window))
    if name == "qwen2-moe":  # layer 0 dense (decoder_sparse_step 2), layer 1 sparse with the gated shared expert
        return Qwen2MoeForCausalLM(Qwen2MoeConfig(
            **{**COMMON, "tie_word_embeddings": True}, intermediate_size=64, moe_intermediate_size=24,
            shared_expert_intermediate_size=40, num_experts=4, decoder_sparse_step=2, norm_topk_prob=False,
            use_sliding_window=window is not None, sliding_window=window))
    if name == "qwen3-moe":  # layer 1 dense (mlp_only_layers), q/k RMSNorm per head, head_dim 12
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(
            **COMMON, head_dim=12, intermediate_size=64, moe_intermediate_size=24, num_experts=4, mlp_only_layers=[1],
            norm_topk_prob=True, use_sliding_window=window is not None, sliding_window=window))
    return OlmoeForCausalLM(OlmoeConfig(**COMMON, intermediate_size=48, num_experts=4, norm_topk_prob=False,
                                        pad_token_id=None))


NAMES = ("mixtral", "qwen2-moe", "qwen3-moe", "olmoe")


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """{(name, layout): folder}: each model saved both ways, the per-expert folder with a tokenizer."""
    root = tmp_path_factory.mktemp("hf-moe")
    out = {}
    for i, name in enumerate(NAMES):
        torch.manual_seed(i)
        model = hf_model(name).eval()
        randomize_(model, i)
        for layout in LAYOUT_NAMES:
            folder = root / name / layout
            model.save_pretrained(folder, save_original_format=layout == "per-expert")
            out[name, layout] = folder
        save_tokenizer(out[name, "per-expert"])
    return out


@pytest.fixture(scope="module")
def zoo_dirs(hf_dirs, tmp_path_factory):
    from zoo.convert.gpt import hf_to_zoo

    root = tmp_path_factory.mktemp("zoo-moe")
    return {key: hf_to_zoo(folder, root / "-".join(key)) for key, folder in hf_dirs.items()}


def tensors(folder: Path) -> dict:
    return {k: t for f in sorted(Path(folder).glob("*.safetensors")) for k, t in load_file(f).items()}


# ---------------------------------------------------------------------------------------------------------------
# Import: both layouts, streaming
# ---------------------------------------------------------------------------------------------------------------


def test_layouts_on_disk_and_import_alike(hf_dirs, zoo_dirs):
    """transformers wrote the two layouts this adapter expects, and both import to the same zoo tensors."""
    per_expert, fused = tensors(hf_dirs["mixtral", "per-expert"]), tensors(hf_dirs["mixtral", "fused"])
    assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in per_expert
    assert fused["model.layers.1.mlp.experts.gate_up_proj"].shape == (4, 2 * 48, 32)
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in tensors(hf_dirs["olmoe", "per-expert"])
    for name in NAMES:
        a, b = tensors(zoo_dirs[name, "per-expert"]), tensors(zoo_dirs[name, "fused"])
        assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a), name
        assert io.read_config(zoo_dirs[name, "per-expert"]) == io.read_config(zoo_dirs[name, "fused"])
    qwen2 = io.read_config(zoo_dirs["qwen2-moe", "fused"])[1]
    assert (qwen2["decoder_sparse_step"], qwen2["shared_expert_gate"], qwen2["qkv_bias"]) == (2, True, True)
    assert "2.mlp.experts.gate_up_proj" in tensors(zoo_dirs["qwen2-moe", "fused"])  # block 1 sparse,
    assert "1.mlp.fc1.weight" in tensors(zoo_dirs["qwen2-moe", "fused"])  # block 0 dense
    # the windows: Mixtral's and Qwen3-MoE's on every layer, Qwen2-MoE's where its derived layer_types say
    assert qwen2["sliding_window"] == WINDOW and qwen2["layer_types"] == ["sliding_attention", "full_attention"]
    for name in ("mixtral", "qwen3-moe"):
        config = io.read_config(zoo_dirs[name, "fused"])[1]
        assert config["sliding_window"] == WINDOW and "layer_types" not in config, name


def test_conversions_hold_one_layer_of_experts_at_a_time(hf_dirs, zoo_dirs, tmp_path, monkeypatch):
    """Every read of the import and of the export touches one block's tensors at most (so one layer's experts),
    never all layers' experts together."""
    from zoo.convert import gpt, reader, writer

    reads = []
    hf_read = reader.HFCheckpoint.read
    monkeypatch.setattr(reader.HFCheckpoint, "read", lambda self, keys: reads.append(list(keys)) or
                        hf_read(self, keys))
    zoo_read = writer.read_safetensors
    monkeypatch.setattr(writer, "read_safetensors", lambda path, keys: reads.append(list(keys)) or
                        zoo_read(path, keys))
    gpt.hf_to_zoo(hf_dirs["mixtral", "per-expert"], tmp_path / "zoo")
    gpt.zoo_to_hf(tmp_path / "zoo", tmp_path / "hf")
    layer = re.compile(r"^(?:model\.layers\.(\d+)\.|(\d+)\.(?:attention|mlp|input_norm|post_attention_norm))")
    for keys in reads:
        assert len({m.group(1) or m.group(2) for k in keys if (m := layer.match(k))}) <= 1, keys
    assert sum(any(".experts." in k for k in keys) for keys in reads) >= 4  # 2 layers, in and out


def test_an_expert_parallel_rank_reads_only_its_experts(zoo_dirs):
    """io.load_model's reader asks safetensors for this EP rank's rows of an expert tensor, nothing else."""
    from zoo.models.moe import GroupedExperts

    asked = []

    class Recording:
        def __init__(self, handle):
            self.handle = handle

        def get_slice(self, key):
            sl = self.handle.get_slice(key)

            class Slice:
                get_shape = sl.get_shape

                def __getitem__(self, index):
                    asked.append(index)
                    return sl[index]

            return Slice()

    experts = GroupedExperts(4, 32, 48, swiglu=True, ep_rank=1, ep_size=2, init_method=torch.nn.init.zeros_,
                             output_init_method=torch.nn.init.zeros_)
    path = zoo_dirs["mixtral", "fused"] / "model.safetensors"
    with safe_open(path, "pt") as f:
        mine = io._local_slice(Recording(f), "1.mlp.experts.gate_up_proj", experts.gate_up_proj, 0, 1, 1, 2)
    assert asked == [slice(2, 4)]
    assert torch.equal(mine, load_file(path)["1.mlp.experts.gate_up_proj"][2:4])


# ---------------------------------------------------------------------------------------------------------------
# verify at every layout (one pool task each), and that it notices a wrong router
# ---------------------------------------------------------------------------------------------------------------


def verify_cases(pairs, tp, pp, ep, ep_spans_tp=False):
    from zoo.convert.verify import verify_report

    return [verify_report(hf, zoo, tp, pp, ep=ep, ep_spans_tp=ep_spans_tp) for hf, zoo in pairs]


def swapped_router(zoo: Path, dst: Path) -> Path:
    """The zoo folder with two rows of block 1's router swapped: every tensor the right shape, experts misrouted."""
    def edit(name, t):
        return (name, t[[1, 0, 2, 3]]) if name == "1.mlp.router.weight" else (name, t)

    _, config = io.read_config(zoo)
    return io.write_model_folder(dst, "gpt", config, (edit(k, t) for k, t in io.iter_tensors(zoo)))


def test_verify_every_layout(hf_dirs, zoo_dirs, tmp_path, dist_run):
    """Zoo folders imported from either layout against transformers' model of the per-expert folder, at each
    (tp, pp, ep[, spanning tp]) on 4 ranks (dp = 4 / (tp x pp)); at the first layout also a folder with a misrouted
    block."""
    bad = swapped_router(zoo_dirs["mixtral", "fused"], tmp_path / "bad")
    for n, (tp, pp, ep, spans) in enumerate(LAYOUTS):
        layout = LAYOUT_NAMES[n % 2]
        pairs = [(str(hf_dirs[name, "per-expert"]), str(zoo_dirs[name, layout])) for name in NAMES]
        if n == 0:
            pairs.append((str(hf_dirs["mixtral", "per-expert"]), str(bad)))
        per_rank = dist_run(4, verify_cases, pairs, tp, pp, ep, spans)
        assert all(r == per_rank[0] for r in per_rank)  # every rank returns rank 0's result
        for name, report in zip(NAMES, per_rank[0]):
            where = f"{name} at tp={tp} pp={pp} ep={ep}" + (" spanning tp" if spans else "")
            assert report.max_abs_diff < TOL, f"{where}: max |logit diff| {report.max_abs_diff}"
            assert report.router_topk_agreement == 1.0, f"{where}: router agreement {report.router_topk_agreement}"
        if n == 0:
            wrong = per_rank[0][-1]
            assert wrong.max_abs_diff > 1e-2 and wrong.router_topk_agreement < 0.95, wrong


@pytest.mark.parametrize("layout", [[], ["--tp", "2", "--ep-spans-tp"]], ids=["ep2", "ep2-spans-tp2"])
def test_verify_command_ep2(layout, hf_dirs, zoo_dirs, dist_run):
    """launch/convert.py verify --ep 2 --max-memory 1KB on two processes (its main in the 2-rank pool as torchrun runs
    it, tests/mains.py; each rank's experts streamed one layer at a time, transformers' model offloaded to disk), also
    with the EP group spanning a TP group of 2: the agreement line, then max_abs_diff=<float> last."""
    (code, stdout, stderr), _ = dist_run(2, run_main, "zoo.convert.cli:main", [
        "verify", "--hf", hf_dirs["qwen2-moe", "fused"], "--zoo", zoo_dirs["qwen2-moe", "per-expert"], "--ep", "2",
        "--max-memory", "1KB", *layout])
    assert code == 0, stdout + stderr
    lines = stdout.strip().splitlines()
    head = "tp=2 pp=1 ep=2 (spans tp)" if layout else "tp=1 pp=1 ep=2"
    assert lines[-3] == f"{head} tol=0.0001 ok" and lines[-2] == "router_topk_agreement=1.0000", lines[-3:]
    assert lines[-4] == "hf modules (accelerate device_map, cpu <= 1KB): disk 1; zoo: one layer at a time"
    m = re.fullmatch(r"max_abs_diff=(\S+)", lines[-1])
    assert m and float(m.group(1)) < TOL, lines[-1]


# ---------------------------------------------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
@pytest.mark.parametrize("name", NAMES)
def test_round_trip_bit_exact_and_same_generation(name, layout, hf_dirs, zoo_dirs, tmp_path, capsys):
    """HF -> zoo -> HF in the source's layout (zoo-to-hf's default, or --fused-experts) gives every tensor back
    bit for bit under its own name; transformers loads the export and generates what the original generates."""
    from transformers import AutoModelForCausalLM

    src, out = hf_dirs[name, layout], tmp_path / "hf"
    flags = ["--fused-experts"] if layout == "fused" else []
    assert run_cli(capsys, "zoo-to-hf", "--src", zoo_dirs[name, layout], "--out", out, *flags)[0] == 0
    original, exported = tensors(src), tensors(out)
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[k], t) for k, t in original.items())
    a = AutoModelForCausalLM.from_pretrained(src).eval()
    b = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(a) is type(b) and a.config.to_diff_dict() | {"transformers_version": 0} == \
        b.config.to_diff_dict() | {"transformers_version": 0}
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ga = a.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=EOS)
        gb = b.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=EOS)
    assert ga.shape[1] > ids.shape[1] and torch.equal(ga, gb)


# ---------------------------------------------------------------------------------------------------------------
# Bad input: one line each, exit 2
# ---------------------------------------------------------------------------------------------------------------


def test_bad_input(hf_dirs, zoo_dirs, tmp_path, capsys):
    out = tmp_path / "out"
    assert_error(capsys, r"^error: num_experts 4 is not divisible by ep 3; use an ep that divides it: 1, 2 or 4$",
                 "verify", "--hf", hf_dirs["olmoe", "per-expert"], "--zoo", zoo_dirs["olmoe", "fused"], "--ep", "3")

    fused = shutil.copytree(hf_dirs["mixtral", "fused"], tmp_path / "fused")
    state = load_file(fused / "model.safetensors")
    for key in ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
        state[key] = state[key][:3].clone()  # expert 3 left out
    save_file(state, fused / "model.safetensors", metadata={"format": "pt"})
    assert_error(capsys, r"tensor model\.layers\.1\.mlp\.experts\.(gate_up|down)_proj holds 3 experts but "
                 r"config\.json's num_local_experts is 4; the checkpoint lacks experts", "hf-to-zoo", "--src", fused,
                 "--out", out)

    per_expert = shutil.copytree(hf_dirs["qwen3-moe", "per-expert"], tmp_path / "per-expert")
    state = {k: t for k, t in load_file(per_expert / "model.safetensors").items() if ".experts.2." not in k}
    save_file(state, per_expert / "model.safetensors", metadata={"format": "pt"})
    assert_error(capsys, r"layer 0 lacks expert\(s\) \[2\] of num_experts 4", "hf-to-zoo", "--src", per_expert,
                 "--out", out)

    deepseek = shutil.copytree(hf_dirs["mixtral", "per-expert"], tmp_path / "deepseek")
    meta = json.loads((deepseek / "config.json").read_text())
    (deepseek / "config.json").write_text(json.dumps({**meta, "architectures": ["DeepseekV3ForCausalLM"],
                                                      "model_type": "deepseek_v3"}))
    assert_error(capsys, r"architecture DeepseekV3ForCausalLM is not supported; supported: "
                 + ", ".join(registry.names("transformers")) + "$",
                 "hf-to-zoo", "--src", deepseek, "--out", out)

    jitter = shutil.copytree(hf_dirs["mixtral", "fused"], tmp_path / "jitter")
    (jitter / "config.json").write_text(json.dumps({**meta, "router_jitter_noise": 0.1}))
    assert_error(capsys, r"router_jitter_noise 0\.1 is not supported .* set it to 0 in config\.json", "hf-to-zoo",
                 "--src", jitter, "--out", out)

    zero_window = shutil.copytree(hf_dirs["qwen2-moe", "fused"], tmp_path / "zero-window")
    qwen_meta = json.loads((zero_window / "config.json").read_text())
    (zero_window / "config.json").write_text(json.dumps({**qwen_meta, "use_sliding_window": False}))
    assert_error(capsys, r"layer_types has 'sliding_attention' layers but use_sliding_window is false", "hf-to-zoo",
                 "--src", zero_window, "--out", out)

    _, config = io.read_config(zoo_dirs["mixtral", "fused"])
    sigmoid = io.write_model_folder(tmp_path / "sigmoid", "gpt", {**config, "scoring_func": "sigmoid"},
                                    io.iter_tensors(zoo_dirs["mixtral", "fused"]))
    assert_error(capsys, r"matches no HF architecture: as MixtralForCausalLM .* it needs softmax routing",
                 "zoo-to-hf", "--src", sigmoid, "--out", out)
    assert not out.exists()


# ---------------------------------------------------------------------------------------------------------------
# Fine-tuning at ep2 x tp2 from the HF folder, judged by transformers on the export
# ---------------------------------------------------------------------------------------------------------------


def finetune_rank(argv):
    """``launch/finetune.py`` on this pool rank; the pool owns torch.distributed, so the run's grid is built on it
    and left for the pool to release (the command would tear the world down)."""
    from contextlib import contextmanager

    from zoo.finetune import gpt
    from zoo.parallel.topology import initialize_model_parallel

    @contextmanager
    def on_the_pool(cfg):
        yield initialize_model_parallel(cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.ep)

    run_group = gpt.process_group
    gpt.process_group = on_the_pool
    try:
        return gpt.main([str(a) for a in argv])
    finally:
        gpt.process_group = run_group


def test_finetune_ep2_tp2_exports_a_better_hf_model(hf_dirs, tmp_path, dist_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from zoo.data.tokenizer import train_bpe_tokenizer

    rows = reverse_rows(64)
    data = tmp_path / "reverse.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    hf = tmp_path / "qwen2-moe"
    shutil.copytree(hf_dirs["qwen2-moe", "per-expert"], hf)
    train_bpe_tokenizer([r["prompt"] + r["response"] for r in rows], VOCAB, hf)
    out = tmp_path / "sft"
    argv = ["--init", hf, "--data", data, "--tp", "2", "--ep", "2", "--out", out, "--steps", "16",
            "--eval-interval", "0", "--no-sample", "--set", "training.seq_length=24", "training.micro_batch_size=8",
            "training.global_batch_size=16", "training.lr=5e-3", "training.warmup_steps=2", "training.log_interval=10",
            "training.save=false"]  # ep > 1: no DeepSpeed checkpoints yet; the model is exported all the same
    assert dist_run(4, finetune_rank, argv) == [0, 0, 0, 0]

    original = AutoModelForCausalLM.from_pretrained(hf).eval()
    tuned = AutoModelForCausalLM.from_pretrained(out / "hf").eval()
    tok = AutoTokenizer.from_pretrained(out / "hf")
    assert type(tuned).__name__ == "Qwen2MoeForCausalLM" and tok.eos_token_id == EOS
    a, b = original.state_dict(), tuned.state_dict()
    assert a.keys() == b.keys() and not torch.equal(a["model.layers.1.mlp.experts.gate_up_proj"],
                                                    b["model.layers.1.mlp.experts.gate_up_proj"])
    before, after = response_loss(original, tok, rows), response_loss(tuned, tok, rows)
    assert math.isfinite(after) and after < 0.8 * before, (before, after)
    ids = torch.tensor([tok(rows[0]["prompt"]).input_ids])
    assert tuned.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=EOS).shape[1] > ids.shape[1]


def test_lora_finetune_ep2_exports_an_adapter_peft_loads(hf_dirs, tmp_path, dist_run):
    """LoRA on a Mixtral's attention and on every expert (an adapter per expert), trained at ep 2: zoo-to-peft writes
    the per-expert adapters peft converts on load, and ``PeftModel`` on the original HF model gives the logits of
    zoo's model with the trained adapters applied (one process)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from zoo.convert.cli import main as convert
    from zoo.data.tokenizer import train_bpe_tokenizer
    from zoo.models.gpt import GPTConfig, ParallelOptions, layer_specs
    from zoo.models.lora import LoraConfig, apply_lora
    from zoo.models.specs import SpecSequential

    rows = reverse_rows(32)
    data = tmp_path / "reverse.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    hf = tmp_path / "mixtral"
    shutil.copytree(hf_dirs["mixtral", "per-expert"], hf)
    train_bpe_tokenizer([r["prompt"] + r["response"] for r in rows], VOCAB, hf)
    out = tmp_path / "sft"
    argv = ["--init", hf, "--data", data, "--ep", "2", "--out", out, "--steps", "3", "--eval-interval", "0",
            "--no-sample", "--set", "training.seq_length=24", "training.micro_batch_size=8",
            "training.global_batch_size=16", "training.lr=1e-2", "training.save=false", "finetune.lora.r=4",
            "finetune.lora.alpha=8", "finetune.lora.targets=[qkv, dense, experts]"]
    assert dist_run(2, finetune_rank, argv) == [0, 0]

    meta = json.loads((out / "model" / "config.json").read_text())
    model = SpecSequential(layer_specs(GPTConfig.from_dict(meta["config"]), ParallelOptions()))
    apply_lora(model, LoraConfig.from_dict(meta["lora"]))
    io.load_model(out / "model", model)
    assert convert(["zoo-to-peft", "--src", str(out / "model"), "--out", str(tmp_path / "adapter"),
                    "--base", str(hf)]) == 0
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(hf), tmp_path / "adapter").eval()
    ids = torch.randint(1, VOCAB, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model.eval()(ids)[..., :VOCAB]
        torch.testing.assert_close(peft_model(ids).logits, ours, rtol=0, atol=1e-4)
        plain = AutoModelForCausalLM.from_pretrained(hf).eval()(ids).logits
    assert (ours - plain).abs().max() > 1e-3, "the trained adapters must change the model"

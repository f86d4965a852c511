"""launch/plan.py against published figures: Megatron's Table 1 (arXiv 2104.04473), released checkpoints'
parameter counts, transformers' own models, DeepSpeed's stage partitioning, and the layouts Megatron chose."""

import json
import random
from pathlib import Path

import pytest

from zoo.models.gpt import GPTConfig
from zoo.plan import Job, Layout, PlanError, best, estimate, get_gpu, plan
from zoo.plan.cli import main
from zoo.plan.estimate import partition_balanced, spec_params, stages

ROOT = Path(__file__).resolve().parents[2]

# Table 1 of Narayanan et al. 2021: parameters (billions), heads, hidden, layers, tp, pp, GPUs, batch, TFLOP/s
TABLE_1 = [(1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
           (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
           (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
           (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
           (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163)]


def megatron_gpt(heads, hidden, layers, **kw):
    """The paper's models: GPT-2 blocks, V = 51200, s = 2048, dropout 0.1 (Megatron-LM's defaults then)."""
    return GPTConfig(vocab_size=51200, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                     max_position_embeddings=2048, hidden_dropout=0.1, attention_dropout=0.1, **kw)


@pytest.mark.parametrize("row", TABLE_1, ids=[f"{r[0]}B" for r in TABLE_1])
def test_table_1_parameter_counts(row):
    billions, heads, h, layers = row[:4]
    assert round(megatron_gpt(heads, h, layers).num_parameters() / 1e9, 1) == billions


# Released checkpoints (their model cards / config.json; GPT-2's tied head counted once).
PUBLISHED = {"gpt2-124m": 124_439_808, "gpt2-355m": 354_823_168, "gpt2-774m": 774_030_080,
             "gpt2-1.5b": 1_557_611_200, "llama-1b": 1_235_814_400, "llama-7b": 6_738_415_616,
             "mistral-7b": 7_248_023_552}


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_preset_parameter_counts(preset):
    """Equal to the published count and to transformers' own model of the same config (built on the meta
    device, so no memory is spent); the per-rank counts of every (tp, pp) add up to it."""
    import torch
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
    )

    c = GPTConfig.from_preset(preset)
    assert c.num_parameters() == PUBLISHED[preset]
    if preset.startswith("gpt2"):
        hf = GPT2LMHeadModel, GPT2Config(n_embd=c.hidden_size, n_layer=c.num_hidden_layers,
                                         n_head=c.num_attention_heads)
    else:
        cls, cfg = (MistralForCausalLM, MistralConfig) if preset.startswith("mistral") else (LlamaForCausalLM,
                                                                                             LlamaConfig)
        hf = cls, cfg(vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers,
                      num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                      intermediate_size=c.intermediate_size, tie_word_embeddings=c.tie_word_embeddings)
    with torch.device("meta"):
        model = hf[0](hf[1])
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED[preset]
    # every rank's share adds up to it, plus what layouts store more than once: padded vocabulary rows, the
    # last stage's copy of a tied embedding, and the tensors replicated over TP (norms, output biases, positions)
    h, L = c.hidden_size, c.num_hidden_layers
    norm = (2 if c.normalization == "layernorm" else 1) * h
    positions = c.max_position_embeddings * h if c.position_embedding_type == "learned" else 0
    for tp in (1, 2, 4):
        for pp in (1, 4):
            copies = 2 if pp > 1 and c.tie_word_embeddings else 1  # of the embedding module
            vocab_rows = (c.padded_vocab_size(tp) - c.vocab_size) * h * (1 if c.tie_word_embeddings else 2)
            extra = vocab_rows + (copies - 1) * c.padded_vocab_size(tp) * h
            replicated = (2 * L + 1) * norm + 2 * L * c.add_bias * h
            extra += (tp - 1) * replicated + (tp * copies - 1) * positions
            assert sum(st.dense for st in stages(c, tp, pp)) * tp == c.num_parameters() + extra, (tp, pp)


def test_partition_is_deepspeeds():
    from deepspeed.runtime.utils import partition_balanced as deepspeed_partition

    rng = random.Random(0)
    for _ in range(40):
        weights = [rng.choice([0, 1, 5, 100, 1000]) for _ in range(rng.randint(2, 30))]
        parts = rng.randint(1, 8)
        assert partition_balanced(weights, parts) == deepspeed_partition(weights, parts), (weights, parts)
    c = GPTConfig.from_preset("tiny")
    assert partition_balanced([d for d, _ in spec_params(c, 2)], 2) == \
        deepspeed_partition([d for d, _ in spec_params(c, 2)], 2)


@pytest.mark.parametrize("row", TABLE_1, ids=[f"{r[0]}B" for r in TABLE_1])
def test_table_1_throughput_within_15_percent(row):
    """Their layout (tp, pp, GPUs, batch, full recomputation, their attention kernel that stores the s x s
    scores); micro batch and ZeRO take their best value; one set of A100 constants for all ten rows."""
    billions, heads, h, layers, tp, pp, gpus, batch, published = row
    job = Job(megatron_gpt(heads, h, layers), gpus, 2048, batch, attention="unfused")
    winner = best(plan(job, get_gpu("a100-80g"), {"tp": tp, "pp": pp, "recompute": "full", "sp": False}),
                  job, get_gpu("a100-80g"))
    assert abs(winner.tflops_per_gpu / published - 1) < 0.15, (winner.tflops_per_gpu, published)
    assert 0 < winner.mfu < winner.tflops_per_gpu / 312


def test_gpt3_175b_on_1024_a100_is_megatrons_layout():
    job = Job(megatron_gpt(96, 12288, 96), 1024, 2048, 1536)
    winner = best(plan(job, get_gpu("a100-80g")), job, get_gpu("a100-80g"))
    assert winner.layout.tp == 8 and winner.layout.pp >= 8, winner.layout


def test_1b_on_8_gpus_needs_no_pipeline():
    job = Job(GPTConfig.from_preset("llama-1b"), 8, 2048, 256)
    assert best(plan(job, get_gpu("h100")), job, get_gpu("h100")).layout.pp == 1


def test_memory_follows_the_zero_rules():
    """Mixed precision with Adam, as DeepSpeed holds it: without ZeRO (FP16_UnfusedOptimizer) 2 + (2 + 4) + 12
    bytes per parameter; ZeRO-1 partitions the fp32 masters and moments, ZeRO-2 the gradients too, ZeRO-3 the
    parameters (all but the tensors of <= 1e5 elements); each adds the fp32 copy of the gradient partition."""
    c = GPTConfig.from_preset("llama-7b")
    job = Job(c, 8, 1024, 64)
    gpu = get_gpu("h200")
    stage = stages(c, 1, 1)[0]
    n, small = stage.dense, stage.persistent
    mem = {z: estimate(job, Layout(dp=8, zero=z, micro_batch=8), gpu).memory for z in range(4)}  # 1 micro-batch
    assert (mem[0]["params"], mem[0]["grads"], mem[0]["optimizer"]) == (2 * n, 6 * n, 12 * n)
    assert (mem[1]["params"], mem[1]["grads"], mem[1]["optimizer"]) == (2 * n, 2 * n + 4 * n / 8, 12 * n / 8)
    assert mem[2]["grads"] == 6 * n / 8 and mem[3]["params"] == 2 * n / 8 + 2 * small
    assert 0 < small < n / 1000  # norms only: every matrix of a 7B model is partitioned
    assert mem[3]["activations"] == mem[0]["activations"]
    assert mem[1]["buffers"] - mem[0]["buffers"] == 500_000_000 * 2  # the bf16 reduction bucket: 7B > its 5e8 cap


def test_json_only_and_write_config(tmp_path, capsys):
    """--only pins the named fields; --json rows hold the promised keys; --write-config is a run config that
    zoo's own loader accepts for that many processes."""
    out = tmp_path / "plan.yaml"
    rc = main(["--model", "gpt2-355m", "--gpu", "a100-40g", "--gpus", "8", "--global-batch", "64",
               "--seq-length", "1024", "--only", "tp=2,recompute=full", "--json", "--write-config", str(out)])
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)
    keys = {"tp", "pp", "dp", "zero", "micro_batch", "recompute", "sp", "params", "memory_per_gpu_gb", "fits",
            "step_time_s", "tflops_per_gpu", "mfu"}
    assert rows and all(keys <= set(r) and r["tp"] == 2 and r["recompute"] == "full" and r["fits"] for r in rows)
    assert rows[0]["params"] == 354_823_168
    assert [r["step_time_s"] for r in rows] == sorted(r["step_time_s"] for r in rows)

    from zoo.training.config import load, validate

    cfg = load(out)
    validate(cfg, 8)
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.zero_stage) == (2, rows[0]["pp"], rows[0]["zero"])
    assert cfg.training.micro_batch_size == rows[0]["micro_batch"] and cfg.global_batch_size == 64
    assert cfg.parallel.activation_checkpointing and cfg.training.seq_length == 1024


def test_fused_loss_is_priced_where_zoo_runs_it(tmp_path, capsys):
    """--fused-cross-entropy: the last stage keeps no [tokens, V] logits (fp32 softmax, logits and their gradient
    around the loss) but the head's gradients and one chunk of logits, in every layout (ZeRO-3's too); --write-config
    turns it on in the run config."""
    from dataclasses import replace

    from zoo.plan.estimate import fused_chunk_tokens

    gpu, config = get_gpu("a100-80g"), GPTConfig.from_preset("gpt2-124m")
    job, fused_job = (Job(config, 8, 1024, 64, fused_cross_entropy=f) for f in (False, True))
    vocab, h, tokens = config.padded_vocab_size(2) // 2, config.hidden_size, 4 * 1024
    # two stages: the fp32 softmax [tokens, V/tp] and two micro-batches' logits in the pipe buffers go (bf16); the
    # head's weight gradient (fp32) and two micro-batches' head inputs come
    lay = Layout(tp=2, pp=2, dp=2, zero=1, micro_batch=4)
    plain, fused = estimate(job, lay, gpu), estimate(fused_job, replace(lay, fused_ce=True), gpu)
    saved = tokens * vocab * 4 + 2 * tokens * vocab * 2 - 4 * vocab * h - 2 * tokens * h * 2
    assert plain.stage_memory[-1] - fused.stage_memory[-1] == pytest.approx(saved)
    assert plain.stage_memory[0] == fused.stage_memory[0]
    # one stage: the logits and their fp32 gradient around the loss shrink to one chunk's
    lay = Layout(tp=2, pp=1, dp=4, zero=2, micro_batch=4)
    plain, fused = estimate(job, lay, gpu), estimate(fused_job, replace(lay, fused_ce=True), gpu)
    chunk = fused_chunk_tokens(config, 2, gpu)
    assert 0 < chunk < tokens
    assert plain.memory["buffers"] - fused.memory["buffers"] == pytest.approx((tokens - chunk) * vocab * (2 + 4))
    rows = plan(fused_job, gpu)
    assert all(e.layout.fused_ce for e in rows) and {e.layout.zero for e in rows} == {0, 1, 2, 3}

    out = tmp_path / "plan.yaml"
    assert main(["--model", "gpt2-355m", "--gpu", "a100-40g", "--gpus", "8", "--global-batch", "64",
                 "--seq-length", "1024", "--only", "zero=1", "--fused-cross-entropy", "--write-config", str(out)]) == 0
    assert "fused LM head + loss" in capsys.readouterr().out
    from zoo.training.config import load, validate

    cfg = load(out)
    validate(cfg, 8)
    assert cfg.training.fused_cross_entropy and cfg.parallel.zero_stage == 1


@pytest.mark.parametrize("args,message", [
    (["--gpu", "a100-81g", "--gpus", "8", "--global-batch", "8"], "unknown GPU 'a100-81g'"),
    (["--model", "llama-7b", "--gpu", "a100-40g", "--gpus", "1", "--global-batch", "8"], "no layout of 1 x a100-40g"),
    (["--model", "gpt2-124m", "--gpus", "8", "--global-batch", "12", "--only", "tp=1,pp=1,cp=1"],
     "--only tp=1,pp=1,cp=1"),
    (["--model", "tiny", "--gpus", "64", "--global-batch", "6"], "global batch 6 is not divisible"),
    (["--model", "nope", "--gpus", "8", "--global-batch", "8"], "neither a zoo GPT preset"),
    (["--gpus", "8", "--global-batch", "8", "--only", "tp=two"], "tp must be an integer"),
])
def test_bad_input_is_one_line(capsys, args, message):
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_model_from_folders(tmp_path):
    """A HF folder's config.json and a zoo folder give the same model as the preset."""
    from transformers import LlamaConfig

    from zoo.plan.cli import model_config

    c = GPTConfig.from_preset("tiny-llama")
    LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers,
                num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                intermediate_size=c.intermediate_size, max_position_embeddings=c.max_position_embeddings,
                rms_norm_eps=c.norm_eps, tie_word_embeddings=False).save_pretrained(tmp_path / "hf")
    (tmp_path / "zoo").mkdir()
    (tmp_path / "zoo/config.json").write_text(json.dumps({"zoo_format": 1, "family": "gpt", "config": c.to_dict()}))
    for folder in ("hf", "zoo"):
        got, _ = model_config(str(tmp_path / folder), [])
        assert got.num_parameters() == c.num_parameters()
    assert model_config("tiny-llama", ["num_hidden_layers=2"])[0].num_hidden_layers == 2


def test_table_and_why_not(capsys):
    assert main(["--model", "llama-7b", "--gpu", "a100-40g", "--gpus", "8", "--global-batch", "64", "--top", "3",
                 "--why-not"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "layouts fit" in lines[0] and "tokens/s" in lines[1]
    assert [line.split()[0] for line in lines[3:6]] == ["1", "2", "3"]
    assert "layouts do not fit" in lines[7] and int(lines[7].split()[0]) > 0
    assert len(lines) == 11 and all("needs" in line and "> 40.0 GiB" in line for line in lines[8:11])


def test_cluster_yaml(tmp_path, capsys):
    """A cluster file overrides a known GPU's fields; more memory per GPU fits layouts the base GPU cannot."""
    from zoo.plan import load_cluster

    path = tmp_path / "mine.yaml"
    path.write_text("base: a100-40g\nmemory_gb: 160\ninter_node_gbps: 100\n")
    gpu = load_cluster(path)
    assert (gpu.memory_gb, gpu.inter_node_gbps, gpu.peak_tflops) == (160, 100, 312.0)
    job = Job(GPTConfig.from_preset("llama-7b"), 1, 2048, 8)
    assert best(plan(job, gpu), job, gpu).fits
    with pytest.raises(PlanError, match="no layout of 1 x a100-40g"):
        best(plan(job, get_gpu("a100-40g")), job, get_gpu("a100-40g"))
    path.write_text("base: a100-40g\nmemory: 160\n")
    assert main(["--cluster", str(path), "--gpus", "8", "--global-batch", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert "unknown field(s) ['memory']" in err and len(err.splitlines()) == 1


def test_context_parallel_layouts(tmp_path):
    """cp splits every sequence: half the activations per rank at cp 2, the same FLOPs per step; the written
    config of a cp layout is one zoo's own loader accepts."""
    import yaml

    from zoo.plan.cli import run_config
    from zoo.training.config import load, validate

    c = GPTConfig.from_preset("tiny-llama")
    job = Job(c, 4, 128, 8, dtype="fp32")
    gpu = get_gpu("h100")
    one, two = (estimate(job, Layout(tp=2, dp=2 // cp, cp=cp, zero=1, micro_batch=2), gpu) for cp in (1, 2))
    assert abs(two.memory["activations"] / one.memory["activations"] - 0.5) < 0.02
    assert two.params == one.params and two.row()["cp"] == 2
    rows = plan(job, gpu, {"cp": 2, "tp": 2})
    assert rows and all(r.layout.cp == 2 and r.layout.dp == 1 for r in rows)
    path = tmp_path / "cp.yaml"
    path.write_text(run_config(rows[0], job, "tiny-llama"))
    cfg = load(path)
    validate(cfg, 4)
    assert (cfg.parallel.cp, cfg.parallel.tp, cfg.dp) == (2, 2, 1) and yaml.safe_load(path.read_text())


def test_weight_average_is_priced_and_written(tmp_path):
    """``--ema-decay``: 4 bytes per parameter the rank holds (in fp32 ZeRO 0-2 that is the rank's parameter bytes,
    which tests/plan/test_memory_model.py holds to DeepSpeed's measured ones; at ZeRO-3 of its partitions, 1/dp of
    the stage's), and the written config trains with it."""
    from zoo.plan.cli import run_config
    from zoo.training.config import load, validate

    c = GPTConfig.from_preset("tiny-llama")
    plain, averaged = Job(c, 4, 128, 8, dtype="fp32"), Job(c, 4, 128, 8, dtype="fp32", ema=True)
    gpu = get_gpu("h100")
    for lay in (Layout(tp=2, dp=2, zero=1, micro_batch=2), Layout(pp=2, dp=2, zero=0, micro_batch=2),
                Layout(dp=4, zero=2, micro_batch=2)):
        a, b = estimate(plain, lay, gpu), estimate(averaged, lay, gpu)
        assert b.memory["optimizer"] - a.memory["optimizer"] == a.memory["params"]
        assert [s2 - s1 for s1, s2 in zip(a.stage_memory, b.stage_memory)] == \
            [4 * (st.dense + st.expert) for st in stages(c, lay.tp, lay.pp)]
    lay = Layout(dp=4, zero=3, micro_batch=2)
    a, b = estimate(plain, lay, gpu), estimate(averaged, lay, gpu)
    assert b.stage_memory[0] - a.stage_memory[0] == 4 * stages(c, 1, 1)[0].dense / 4
    rows = plan(averaged, gpu)
    assert rows and any(r.layout.zero == 3 for r in rows)
    path = tmp_path / "ema.yaml"
    path.write_text(run_config(rows[0], averaged, "tiny-llama", ema_decay=0.999))
    cfg = load(path)
    validate(cfg, 4)
    assert cfg.training.ema_decay == 0.999


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama", "tiny-moe-shared"])
def test_every_layout_the_planner_offers_is_one_zoo_runs(tmp_path, preset):
    """Every candidate layout of 8 GPUs (tp, pp, cp, ep, ZeRO, SP, recompute, micro batch, the fused loss), written
    as a run config, passes zoo's own validation for 8 processes: the planner never proposes what zoo refuses."""
    from zoo.plan.cli import run_config
    from zoo.plan.search import candidates
    from zoo.training.config import ConfigError, load, validate

    job = Job(GPTConfig.from_preset(preset), 8, 128, 16, dtype="fp32", fused_cross_entropy=True)
    gpu = get_gpu("h100")
    refused, count = [], 0
    for lay in candidates(job, gpu):
        path = tmp_path / "layout.yaml"
        path.write_text(run_config(estimate(job, lay, gpu), job, preset))
        count += 1
        try:
            validate(load(path, ["data.source=synthetic"]), 8)
        except ConfigError as e:
            refused.append(f"{lay}: {e}")
    assert count > 50 and not refused, refused[:5]


def test_ep_spanning_tp_is_offered_and_priced():
    """EP groups spanning TP: offered as ep = tp x a divisor of dp (beside ep inside dp), written with
    parallel.ep_spans_tp; the experts' ZeRO partitions go over the ranks holding the same experts, dp x tp / ep of
    them (dp / ep without folding), which is all their memory changes at the same ep: E / ep experts per rank."""
    from zoo.plan.search import candidates

    c = GPTConfig.from_preset("tiny-moe")
    job = Job(c, 8, 128, 16, dtype="bf16")
    gpu = get_gpu("h100")
    offered = {(lay.tp, lay.dp, lay.ep, lay.ep_spans_tp) for lay in candidates(job, gpu)}
    assert {(2, 4, 2, True), (2, 4, 4, True), (2, 4, 8, True), (2, 2, 4, True), (2, 4, 4, False)} <= offered
    assert not any(spans and (tp == 1 or ep % tp) for tp, _, ep, spans in offered)
    folded, inside = (estimate(job, Layout(tp=2, dp=4, ep=4, zero=1, micro_batch=1, ep_spans_tp=spans), gpu)
                      for spans in (True, False))
    experts = stages(c, 2, 1, 4)[0].expert  # per rank: E / 4 experts, either way
    assert experts > 0 and folded.memory["params"] == inside.memory["params"]
    # ZeRO-1, bf16 with Adam: 12 bytes of fp32 master and moments per partitioned parameter; 2 EDP ranks vs 1
    assert inside.memory["optimizer"] - folded.memory["optimizer"] == 12 * experts - 12 * experts / 2
    assert "ep_spans_tp=true" in folded.layout.describe()


def test_sandwich_norms_are_held_and_saved_as_zoo_does():
    """Gemma 2's sandwich placement: four norms per block. The planner's per-rank parameters are the built model's
    (padded vocabulary included), and the activations the two extra norms save for backward, as measured
    (zoo.training.memory) on one block against the same block with pre-norms, are the planner's difference."""
    import torch

    from zoo.models.gpt import layer_specs
    from zoo.models.specs import SpecSequential
    from zoo.plan.estimate import block_activation_bytes
    from zoo.training.memory import activations_held

    b, s, measured, predicted = 2, 16, {}, {}
    for placement in ("pre", "sandwich"):
        c = GPTConfig.from_preset("tiny-llama", norm_placement=placement)
        torch.manual_seed(0)
        model = SpecSequential(layer_specs(c))
        assert sum(st.dense for st in stages(c, 1, 1)) == sum(p.numel() for p in model.parameters())
        block = model._funcs[1]
        x = torch.randn(b, s, c.hidden_size, requires_grad=True)
        with activations_held(block) as live:
            block(x).sum().backward()
        measured[placement] = live.peak
        predicted[placement] = block_activation_bytes(c, 1, 1, False, "fp32", b * s, s)
    extra, expected = measured["sandwich"] - measured["pre"], predicted["sandwich"] - predicted["pre"]
    assert expected > 0 and abs(extra / expected - 1) < 0.05, (extra, expected)


def test_windowed_attention_is_priced_by_its_window():
    """A sliding-window layer's attention costs s x W, not s^2 / 2: ``attended_keys`` is the mean number of keys a
    query sees under the window's mask (the definition, zoo.models.attention: i - W < j <= i), and a windowed model's
    compute per token barely grows with the sequence where the full model's grows with it."""
    from zoo.plan.estimate import attended_keys

    for s, w in [(16, 4), (16, 15), (1000, 37)]:
        c = GPTConfig.from_preset("tiny-llama", sliding_window=w)
        pairs = sum(1 for i in range(s) for j in range(s) if i - w < j <= i)
        assert attended_keys(c, 0, s) * s == pytest.approx(pairs, rel=1e-12), (s, w)
    for w in (None, 16, 40):  # no window, or one as long as the sequence: the causal half, as flash kernels do
        assert attended_keys(GPTConfig.from_preset("tiny-llama", sliding_window=w), 0, 16) == 8

    gpu = get_gpu("h100")

    def compute_per_token(window, s):
        c = GPTConfig.from_preset("mistral-7b", sliding_window=window, max_position_embeddings=65536)
        e = estimate(Job(config=c, gpus=8, seq_length=s, global_batch=8), Layout(tp=8, dp=1, micro_batch=1,
                                                                                   recompute="full"), gpu)
        return e.time["compute"] / (8 * s)

    full = compute_per_token(None, 32768) / compute_per_token(None, 16384)
    windowed = compute_per_token(4096, 32768) / compute_per_token(4096, 16384)
    assert full > 1.2 and 1 <= windowed < 1.01, (full, windowed)
    assert compute_per_token(4096, 32768) < compute_per_token(None, 32768)
    assert compute_per_token(32768, 32768) == compute_per_token(None, 32768)  # a window that cannot bind
    # the attention core alone (one block's executed FLOPs): 2 (W - W (W - 1) / 2s) / s of the full layer's
    from zoo.plan.estimate import _block_cost

    s, attn = 32768, {}
    for w in (None, 4096):
        c = GPTConfig.from_preset("mistral-7b", sliding_window=w, max_position_embeddings=65536)
        attn[w] = _block_cost(c, 0, Layout(tp=8), Job(config=c, gpus=8, seq_length=s, global_batch=8), gpu)[1]
    assert attn[4096] / attn[None] == pytest.approx((4096 - 4096 * 4095 / (2 * s)) / (s / 2), rel=1e-12)
def test_tp_above_the_kv_heads_is_offered():
    """tiny-llama's 2 kv heads: tp 4 replicates each over 2 ranks (zoo.parallel.layers.GroupedQKVLinear), so it is
    offered (the layouts test above runs its configs through zoo's validation); tp 8 does not divide the 4 query
    heads. The replicated k/v rows cost a rank 2 d h per block beyond a quarter of the q rows."""
    from zoo.plan.estimate import block_tensors
    from zoo.plan.search import candidates

    c = GPTConfig.from_preset("tiny-llama")
    offered = {lay.tp for lay in candidates(Job(c, 8, 128, 16, dtype="bf16"), get_gpu("h100"))}
    assert offered == {1, 2, 4}
    d, h = c.head_dim, c.hidden_size
    assert block_tensors(c, 0, 4)[0][:2] == [c.num_attention_heads * d * h // 4, 2 * d * h]


def test_lora_flag_prices_the_adapters_and_writes_finetune_lora(tmp_path, capsys):
    """--lora R: the same model's LoRA run of rank R holds far less per GPU than its full fine-tune (a frozen base:
    no gradients or optimizer state for it), and --write-config carries finetune.lora, which validates."""
    base = ["--model", "llama-7b", "--gpu", "a100-80g", "--gpus", "8", "--global-batch", "64", "--seq-length", "2048",
            "--only", "tp=1,pp=1,zero=1,recompute=full", "--json"]
    rows = {}
    for name, extra in (("full", []), ("lora", ["--lora", "16", "--write-config", str(tmp_path / "plan.yaml")])):
        assert main([*base, *extra]) == 0
        rows[name] = json.loads(capsys.readouterr().out)[0]
    assert rows["lora"]["memory_per_gpu_gb"] < 0.5 * rows["full"]["memory_per_gpu_gb"], rows
    from zoo.training.config import load

    cfg = load(tmp_path / "plan.yaml")
    assert cfg.finetune.lora == {"r": 16, "alpha": 32.0, "dropout": 0.0, "targets": ["qkv", "dense", "fc1", "fc2"],
                                 "dora": False, "rslora": False}
    assert main([*base, "--lora", "-1"]) == 2 and "--lora must be a positive rank" in capsys.readouterr().err

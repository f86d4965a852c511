"""Run-config parsing, validation (one clear line per problem, before any process group) and the DeepSpeed JSON."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zoo.training.config import ConfigError, deepspeed_config, load, validate

ROOT = Path(__file__).resolve().parents[2]
TINY, LLAMA, MOE = (ROOT / f"configs/gpt/{name}.yaml" for name in ("tiny", "tiny-llama", "tiny-moe"))


def _validate(path, overrides, world=1, **kw):
    return validate(load(path, overrides), world, **kw)


BAD = [
    (TINY, ["parallel.tp=3"], 3, r"^num_attention_heads 4 is not divisible by tp 3; use a tp that divides it$"),
    # tp above the kv heads replicates them (tests/training/test_kv_replication_layouts.py) where it is a multiple
    (LLAMA, ["parallel.tp=2", "model.num_attention_heads=6", "model.head_dim=16", "model.num_key_value_heads=3"], 2,
     r"^num_key_value_heads 3 and tp 2: one must divide the other \(tp > kv heads replicates each kv head over "
     r"tp / kv heads ranks\); use a tp that divides 3 or a multiple of it$"),
    (TINY, ["parallel.pp=8"], 8, r"^num_hidden_layers 4 is smaller than pp 8; every pipeline stage needs"),
    (TINY, ["parallel.pp=2", "parallel.zero_stage=2"], 2,
     r"^ZeRO stage 2 does not work with pipeline parallelism \(pp=2\); use zero_stage 0 or 1 with pp > 1"),
    (TINY, ["training.global_batch_size=10", "training.micro_batch_size=4"], 1,
     r"^global batch 10 is not divisible by micro batch 4 x dp 1 = 4; global batch = micro batch x gradient"),
    (TINY, ["training.global_batch_size=16", "training.micro_batch_size=4", "training.gradient_accumulation_steps=3"],
     1, r"^global batch 16 != micro batch 4 x gradient accumulation 3 x dp 1"),
    (TINY, ["parallel.tp=4"], 6, r"^world size 6 is not divisible by tp\*pp = 4 \(tp=4, pp=1\)"),
    (TINY, ["parallel.sequence_parallel=true"], 1, r"^parallel.sequence_parallel needs tp > 1"),
    (TINY, ["training.seq_length=512"], 1, r"^training.seq_length 512 exceeds the model's max_position_embeddings 128"),
    (TINY, ["training.lr=fast"], 1, r"^training.lr must be a float, got 'fast'$"),
    (TINY, ["training.lr=0"], 1, r"^training.lr must be a positive number \(the peak learning rate, e.g. 3e-4\)"),
    (TINY, ["training.batch=4"], 1, r"^unknown key\(s\) \['batch'\] in section 'training'"),
    (TINY, ["model.num_layers=4"], 1, r"^model: GPTConfig: unknown field\(s\) \['num_layers'\]"),
    (TINY, ["model.preset=gpt5"], 1, r"^model: unknown GPT preset 'gpt5'; presets: "),
    (TINY, ["model.family=rnn"], 1, r"^model: model.family 'rnn' is not known; families: "
                                    r"\['bert', 'bert-classifier', 'gpt', "),
    (TINY, ["data.source=web"], 1, r"^data.source 'web' is not available for GPT; supported: \['embedded', "),
    (TINY, ["training.init_from=/nonexistent/model"], 1, r"^training.init_from: "),
    # Mixture of experts and expert parallelism.
    (MOE, ["parallel.ep=3"], 3, r"^num_experts 8 is not divisible by ep 3; use an ep that divides it$"),
    (MOE, ["model.num_experts_per_tok=9"], 1,
     r"^model: GPTConfig: num_experts_per_tok \(top-k\) 9 must be between 1 and num_experts 8$"),
    (MOE, ["parallel.tp=2", "parallel.ep=4"], 4,
     r"^ep 4 does not divide the data-parallel size 2 \(world size 4 / tp\*pp 2\); expert-parallel groups are "
     r"carved out of the data-parallel ranks: pick ep in \[1, 2\] or launch a multiple of tp\*pp\*ep = 8 processes, "
     r"or set parallel.ep_spans_tp: true or --ep-spans-tp \(EP groups over the TP ranks too\)$"),
    (TINY, ["parallel.ep_spans_tp=true"], 1, r"^parallel.ep_spans_tp needs a mixture-of-experts model "),
    (MOE, ["parallel.tp=2", "parallel.ep=3", "parallel.ep_spans_tp=true"], 4,
     r"^ep 3 is not a multiple of tp 2: with parallel.ep_spans_tp each EP group holds whole TP groups; pick ep in "
     r"\[2, 4\]$"),
    (MOE, ["model.n_group=3", "model.topk_group=1"], 1, r"^model: GPTConfig: n_group 3 does not divide num_experts 8$"),
    (MOE, ["parallel.zero_stage=3", "parallel.ep=2"], 2,
     r"^ZeRO stage 3 does not work with expert parallelism \(ep=2; DeepSpeed refuses its MoE layers under ZeRO-3\); "
     r"use parallel.zero_stage 1 or 2, or ep 1 \(ZeRO-3 then partitions the experts like any weight\)$"),
    (TINY, ["parallel.ep=2"], 2, r"^parallel.ep 2 needs a mixture-of-experts model \(model.num_experts > 0"),
    (MOE, ["parallel.ep=0"], 1, r"^parallel.ep must be a positive integer, got 0$"),
    # Context parallelism: one line per problem, before any process group.
    (TINY, ["parallel.cp=0"], 1, r"^parallel.cp must be a positive integer, got 0$"),
    (TINY, ["parallel.cp=2", "parallel.cp_algorithm=zigzag"], 2,
     r"^parallel.cp_algorithm must be one of \['ulysses', 'ring'\], got 'zigzag'$"),
    (TINY, ["parallel.cp=2", "parallel.tp=2"], 6,
     r"^world size 6 is not divisible by tp\*cp\*pp = 4 \(tp=2, cp=2, pp=1\); launch a multiple of 4 processes$"),
    (TINY, ["parallel.cp=4", "training.seq_length=30"], 4,
     r"^sequence length 30 is not divisible by 4 = cp at cp=4; use a sequence length that is a multiple of 4$"),
    (TINY, ["parallel.cp=2", "parallel.cp_algorithm=ring", "training.seq_length=34"], 2,
     r"^sequence length 34 is not divisible by 4 = 2\*cp at cp=2 \(ring: 2 chunks per rank"),
    (TINY, ["parallel.cp=4", "parallel.tp=2"], 8,
     r"^Ulysses splits the 2 query heads \(of one TP rank\) over cp=4 ranks and 4 does not divide 2; use a cp that "
     r"divides it or cp_algorithm='ring'$"),
    (TINY, ["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true", "training.seq_length=34"], 4,
     r"^training.seq_length 34 / cp 2 = 17 positions per CP rank are not divisible by tp 2, which sequence "
     r"parallelism needs$"),
    (TINY, ["parallel.cp=2", "parallel.cp_algorithm=ring", "model.attention_dropout=0.1"], 2,
     r"^ring attention has no attention dropout \(attention_dropout=0.1\); set model.attention_dropout=0 or "
     r"parallel.cp_algorithm=ulysses$"),
    (TINY, ["parallel.cp=2", "parallel.ep=2", "model.preset=tiny-moe"], 2,
     r"^ep 2 does not divide the data-parallel size 1 \(world size 2 / tp\*pp 1 / cp 2\); expert-parallel groups "),
    (ROOT / "configs/bert/tiny.yaml", ["parallel.cp=2"], 2,
     r"^context parallelism \(cp=2\) is for the gpt family, not 'bert'; use cp=1"),
    (ROOT / "configs/unet/segmentation.yaml", ["parallel.cp=2"], 2,
     r"^context parallelism \(cp=2\) is for the gpt family, not 'unet-segmentation'; use cp=1"),
]


@pytest.mark.parametrize("path,overrides,world,message", BAD, ids=[m[:40] for *_, m in BAD])
def test_bad_config_gives_one_line(path, overrides, world, message):
    with pytest.raises(ConfigError, match=message) as e:
        _validate(path, overrides, world)
    assert "\n" not in str(e.value)


def test_fp16_where_the_device_refuses_it():
    with pytest.raises(ConfigError, match=r"^fp16 is not supported on this device \(\w+\); "
                                          r"use training.precision: bf16$"):
        _validate(TINY, ["training.precision=fp16"], fp16_supported=False, bf16_supported=True)


def test_fp16_refused_on_this_machine_when_its_accelerator_says_so():
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().is_fp16_supported():
        pytest.skip("this accelerator supports fp16")
    with pytest.raises(ConfigError, match=r"^fp16 is not supported on this device \(cpu\)"):
        _validate(TINY, ["training.precision=fp16"])


def test_derived_batch_numbers_and_deepspeed_json():
    cfg = load(LLAMA, ["parallel.tp=2", "parallel.pp=2", "parallel.zero_stage=1", "training.global_batch_size=32",
                       "parallel.sequence_parallel=true"])
    validate(cfg, 8)
    assert (cfg.dp, cfg.gradient_accumulation_steps, cfg.global_batch_size) == (2, 2, 32)  # micro batch 8
    ds = deepspeed_config(cfg)
    assert ds["train_batch_size"] == 32 == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * 2
    assert ds["zero_optimization"]["stage"] == 1
    assert ds["pipeline"] == {"pipe_partitioned": False, "grad_partitioned": False}
    # ZeRO's reduction bucket: the rank's parameters, at most DeepSpeed's default 5e8 (what it allocates, always)
    assert "reduce_bucket_size" not in ds["zero_optimization"]
    assert deepspeed_config(cfg, rank_parameters=123_457)["zero_optimization"]["reduce_bucket_size"] == 123_457
    assert deepspeed_config(cfg, rank_parameters=7 * 10**9)["zero_optimization"]["reduce_bucket_size"] == 5 * 10**8
    cfg.parallel.zero_stage = 0  # no ZeRO, no bucket
    assert "reduce_bucket_size" not in deepspeed_config(cfg, rank_parameters=123_457)["zero_optimization"]


def test_expert_parallel_run_config():
    cfg = load(MOE, ["parallel.ep=2", "parallel.zero_stage=2", "training.global_batch_size=32", "training.save=false"])
    model = validate(cfg, 4)
    assert (cfg.dp, cfg.parallel.ep, model.num_experts) == (4, 2, 8)
    assert model.router_aux_loss_coef > 0, "the shipped MoE job trains with its load-balancing loss"
    zero = deepspeed_config(cfg)["zero_optimization"]
    assert zero == {"stage": 2, "contiguous_gradients": True, "reduce_scatter": True}  # DeepSpeed's MoE ZeRO asserts


def test_context_parallel_batch_numbers_and_deepspeed_json():
    """8 ranks at tp=2, cp=2: dp=2 replicas; zoo's global batch counts samples once, DeepSpeed's counts them on each
    of its dp x cp = 4 data-parallel ranks."""
    cfg = load(LLAMA, ["parallel.tp=2", "parallel.cp=2", "training.micro_batch_size=2", "training.global_batch_size=8"])
    validate(cfg, 8)
    assert (cfg.dp, cfg.gradient_accumulation_steps, cfg.global_batch_size) == (2, 2, 8)
    ds = deepspeed_config(cfg)
    assert ds["train_batch_size"] == 16 == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * 4


@pytest.mark.parametrize("flags,error", [
    (["--tp", "3"], "error: world size 1 is not divisible by tp*pp = 3 (tp=3, pp=1); launch a multiple of 3 processes"),
    (["--cp", "2"], "error: world size 1 is not divisible by tp*cp*pp = 2 (tp=1, cp=2, pp=1); launch a multiple of 2 "
                    "processes"),
], ids=["tp", "cp"])
def test_cli_refuses_before_starting_anything(tmp_path, flags, error):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(ROOT / "launch/train.py"), *flags, "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [error]
    assert not out.exists(), "a refused run writes nothing"


@pytest.mark.parametrize("path", sorted((ROOT / "configs/unet").glob("*.yaml")), ids=lambda p: p.name)
def test_unet_configs_validate_and_build_their_data(path):
    """Every shipped U-Net config validates, and its data gives the model's input size; the flow example's
    images hold one large shape each and its pairs carry float timesteps."""
    from zoo.training.families import get_family

    cfg = load(path, [])
    model_cfg = validate(cfg, 1)
    data = get_family(cfg.model.family).build_data(cfg, model_cfg, None)
    sample = data.train[0]
    image = sample[0][0] if cfg.model.family == "unet-diffusion" else sample[0]
    assert tuple(image.shape[-2:]) == tuple(model_cfg.sizes)
    if cfg.training.objective == "flow":
        assert sample[0][1].dtype == torch.float32 and 0 < float(sample[0][1]) < 1000
        shapes = data.train.images.shapes(0)
        assert len(shapes) == 1 and shapes[0].radius >= 0.25 * model_cfg.sizes[0]

"""Generation: the KV cache reproduces the full forward, greedy decoding equals transformers' ``generate``, TP
ranks agree with each other and with one process, and the command line works end to end.

The models are the small HF/zoo pairs of ``test_gpt_vs_transformers`` (random weights moved off their init, so
logits are O(1) and a wrong position or mask cannot hide).
"""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

from tests.models.test_gpt_vs_transformers import ROPE_SCALINGS, VOCAB, gpt2_pair, llama_pair, load_from_hf
from zoo.generate.gpt import main
from zoo.models import gpt as gpt_module
from zoo.models.generate import Generator, SamplingOptions, sample_next
from zoo.models.gpt import GPTConfig, ParallelOptions, layer_specs, rope_inv_freq, rope_table
from zoo.models.specs import SpecSequential

STEP_ATOL = 1e-5

PAIRS = {
    "gpt2": lambda: gpt2_pair(),
    "llama-gqa": lambda: llama_pair(False, 2, ROPE_SCALINGS["llama3"]),  # untied head, 2 query heads per kv head
}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def loaded(pair: str):
    hf, model, cfg, table = PAIRS[pair]()
    if pair == "gpt2":
        # With random weights the LayerNorm biases dominate every hidden state and greedy decoding repeats one
        # token whatever the prompt; without them the continuation depends on the prompt and the positions.
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if ".ln_" in name and name.endswith(".bias"):
                    p.zero_()
    load_from_hf(model, hf, table, cfg)
    return hf, model, cfg


def prompt_ids(batch: int, seq: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def unpadded_tensors(model):
    """The model's parameters as a model folder stores them: vocabulary rows past vocab_size dropped."""
    return [(n, p.detach()[: getattr(p, "unpadded_size", None)]) for n, p in model.named_parameters()]


# ---------------------------------------------------------------------------------------------------------------
# RoPE table
# ---------------------------------------------------------------------------------------------------------------


def test_rope_table_is_the_formula_and_shared():
    cfg = GPTConfig.from_preset("tiny-llama", rope_scaling=dict(ROPE_SCALINGS["llama3"]))
    cos, sin = rope_table(cfg, 10, "cpu", torch.float32)
    assert cos.shape == (cfg.max_position_embeddings, cfg.head_dim)
    angles = torch.outer(torch.arange(cfg.max_position_embeddings).float(), rope_inv_freq(cfg))
    angles = torch.cat([angles, angles], dim=-1)
    assert torch.equal(cos, angles.cos()) and torch.equal(sin, angles.sin())
    assert rope_table(cfg, 20, "cpu", torch.float32)[0] is cos  # computed once, shared by every layer
    assert rope_table(cfg, 200, "cpu", torch.float32)[0].shape[0] == 200  # longer than the config: grows


def test_state_dict_has_no_buffers():
    """The RoPE table and the KV cache live outside the state dict: its keys are exactly the parameters."""
    for preset in ("tiny", "tiny-llama"):
        model = SpecSequential(layer_specs(GPTConfig.from_preset(preset)))
        assert list(model.state_dict()) == [n for n, _ in model.named_parameters()]


def test_table_made_in_inference_mode_still_trains():
    """A table first built during generation (inference mode) must not be an inference tensor, or a later
    training step could not save it for backward."""
    gpt_module._ROPE_TABLES.clear()
    model = SpecSequential(layer_specs(GPTConfig.from_preset("tiny-llama", num_hidden_layers=1)))
    ids = prompt_ids(1, 8) % 512
    with torch.inference_mode():
        model(ids)
    model(ids).float().pow(2).mean().backward()
    assert model.get_parameter("1.attention.qkv.weight").grad.abs().max() > 0


# ---------------------------------------------------------------------------------------------------------------
# KV cache == full forward
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pair", list(PAIRS))
def test_cached_step_logits_equal_full_forward(pair):
    _, model, cfg = loaded(pair)
    gen = Generator(model)
    seq = prompt_ids(2, 24)
    with torch.no_grad():
        full = model(seq)[..., :VOCAB]  # [b, s, V]: the training forward, no cache
    caches = gen.new_caches(2, seq.shape[1])
    with torch.inference_mode():
        # The prompt in two chunks (the second sees a non-empty cache: explicit causal mask), then one token a step.
        chunks = [(0, 6), (6, 10)] + [(t, t + 1) for t in range(10, seq.shape[1])]
        for start, stop in chunks:
            got = gen.logits(seq[:, start:stop], caches)
            diff = (got - full[:, stop - 1]).abs().max().item()
            assert diff < STEP_ATOL, (start, stop, diff)
    assert caches[0].length == seq.shape[1]
    assert full.abs().max() > 1.0  # logits worth comparing


@pytest.mark.parametrize("pair", list(PAIRS))
def test_left_padded_batch_rows_equal_alone(pair):
    _, model, cfg = loaded(pair)
    gen = Generator(model)
    short, long = prompt_ids(1, 5, seed=2)[0], prompt_ids(1, 9, seed=3)[0]
    ids = torch.stack([torch.cat([torch.zeros(4, dtype=torch.long), short]), long])
    mask = torch.tensor([[0] * 4 + [1] * 5, [1] * 9])
    batch = gen.generate(ids, max_new_tokens=12, attention_mask=mask).new_tokens
    alone = [gen.generate(p[None], max_new_tokens=12).new_tokens[0] for p in (short, long)]
    assert torch.equal(batch[0], alone[0]) and torch.equal(batch[1], alone[1])
    uncached = gen.generate(ids, max_new_tokens=12, attention_mask=mask, use_cache=False).new_tokens
    assert torch.equal(uncached, batch)


# ---------------------------------------------------------------------------------------------------------------
# Greedy == transformers
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pair", list(PAIRS))
def test_greedy_equals_transformers_generate(pair):
    hf, model, cfg = loaded(pair)
    ids = prompt_ids(2, 7, seed=4)
    eos = hf.generation_config.eos_token_id
    with torch.no_grad():
        theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                             eos_token_id=eos, pad_token_id=eos)
    ours = Generator(model).generate(ids, max_new_tokens=20, eos_token_id=eos, pad_token_id=eos)
    assert ours.tokens.shape == theirs.shape
    assert torch.equal(ours.tokens, theirs)
    assert min(len(set(row.tolist())) for row in ours.new_tokens) > 3  # not a degenerate repetition


def test_padded_vocab_is_never_chosen():
    """Make the LM head's padding rows win every argmax; generation must still pick real tokens."""
    _, model, cfg = loaded("llama-gqa")
    head = model.get_parameter(f"{cfg.num_hidden_layers + 2}.linear.weight")
    with torch.no_grad():
        noise = torch.randn(head.shape[0] - VOCAB, head.shape[1], generator=torch.Generator().manual_seed(0))
        head[VOCAB:] = 100 * noise
        assert model(prompt_ids(1, 6))[0, -1].argmax() >= VOCAB  # the padding would win without the cut
    gen = Generator(model)
    for sampling in (SamplingOptions(), SamplingOptions(greedy=False, temperature=5.0, seed=1)):
        out = gen.generate(prompt_ids(2, 6), max_new_tokens=10, sampling=sampling).new_tokens
        assert out.max() < VOCAB


# ---------------------------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------------------------


def test_sampling_options():
    _, model, cfg = loaded("llama-gqa")
    gen = Generator(model)
    ids = prompt_ids(2, 6, seed=5)

    def run(**kw):
        return gen.generate(ids, max_new_tokens=16, sampling=SamplingOptions(**kw)).new_tokens

    greedy = run()
    assert torch.equal(run(greedy=False, top_k=1, seed=3), greedy)
    assert torch.equal(run(greedy=False, top_p=1e-6, seed=3), greedy)
    hot = run(greedy=False, temperature=1.5, seed=7)
    assert torch.equal(run(greedy=False, temperature=1.5, seed=7), hot)  # reproducible
    assert not torch.equal(run(greedy=False, temperature=1.5, seed=8), hot)  # and actually random
    assert not torch.equal(hot, greedy)


def test_top_k_and_top_p_supports():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    logits = probs.log()
    g = torch.Generator().manual_seed(0)

    def support(**kw):
        draws = [sample_next(logits, SamplingOptions(greedy=False, **kw), g).item() for _ in range(300)]
        return set(draws)

    assert support() == {0, 1, 2, 3}
    assert support(top_k=2) == {1, 3}
    assert support(top_p=0.75) == {1, 3}  # 0.5 + 0.3 is the smallest set reaching 0.75
    assert support(top_p=0.85) == {1, 2, 3}
    assert support(top_k=3, top_p=0.5) == {1}


def test_refusals():
    from deepspeed.pipe import PipelineModule

    with pytest.raises(ValueError, match="pp=1"):
        Generator(PipelineModule.__new__(PipelineModule))
    sp = SpecSequential(layer_specs(GPTConfig.from_preset("tiny"), ParallelOptions(sequence_parallel=True)))
    with pytest.raises(ValueError, match="sequence parallelism"):
        Generator(sp)
    with pytest.raises(ValueError, match="top_p"):
        SamplingOptions(greedy=False, top_p=0.0)


# ---------------------------------------------------------------------------------------------------------------
# Tensor parallelism
# ---------------------------------------------------------------------------------------------------------------

SAMPLED = dict(greedy=False, temperature=1.0, top_k=50, top_p=0.9, seed=11)


def generate_from_folder(folder, tp, ids, max_new_tokens):
    """Load the folder at (tp, pp=1) in this process; greedy and sampled tokens."""
    from tests.parallel.helpers import grid_for
    from zoo.convert.io import load_model, read_config

    grid = grid_for(tp)
    cfg = GPTConfig.from_dict(read_config(folder)[1])
    model = SpecSequential(layer_specs(cfg, ParallelOptions()), base_seed=99).eval()  # every value from the folder
    load_model(folder, model, None if grid is None else grid.tp_group)
    gen = Generator(model)
    greedy = gen.generate(ids, max_new_tokens=max_new_tokens).tokens
    sampled = gen.generate(ids, max_new_tokens=max_new_tokens, sampling=SamplingOptions(**SAMPLED)).tokens
    return greedy, sampled


@pytest.mark.parametrize("pair", list(PAIRS))
def test_tp2_equals_tp1(pair, tmp_path, dist_run):
    from zoo.convert.io import write_model_folder

    _, model, cfg = loaded(pair)
    folder = str(tmp_path / "model")
    write_model_folder(folder, "gpt", cfg.to_dict(), unpadded_tensors(model))
    ids = prompt_ids(2, 6, seed=6)
    greedy1, sampled1 = generate_from_folder(folder, 1, ids, 16)
    assert not torch.equal(greedy1, sampled1)
    ranks = dist_run(2, generate_from_folder, folder, 2, ids, 16)
    for greedy2, sampled2 in ranks:
        assert torch.equal(greedy2, greedy1)
        assert torch.equal(sampled2, sampled1)


# ---------------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------------

SENTENCES = ["the cat sat on the mat.", "a dog ran in the park.", "the bird sang a song in the tree.",
             "we went to the market and bought some bread."] * 3


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    """A run folder whose model/ is a zoo model folder with a trained BPE tokenizer beside the weights."""
    from zoo.convert.io import write_model_folder
    from zoo.data.tokenizer import train_bpe_tokenizer

    root = tmp_path_factory.mktemp("gen")
    tok = train_bpe_tokenizer(SENTENCES, 300, root / "tokenizer")
    cfg = GPTConfig.from_preset("tiny-llama", vocab_size=len(tok), num_hidden_layers=2, max_position_embeddings=32)
    model = SpecSequential(layer_specs(cfg))
    write_model_folder(root / "run" / "model", "gpt", cfg.to_dict(), unpadded_tensors(model),
                       tokenizer_dir=root / "tokenizer")
    return root


def run_main(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def test_main_end_to_end(model_folder):
    folder = str(model_folder / "run" / "model")
    rc, out, err = run_main(["--ckpt", folder, "--prompt", "the cat", "--max-new-tokens", "8", "--greedy"])
    assert rc == 0, err
    assert out.startswith("the cat") and len(out.strip()) > len("the cat")
    assert "tokens/s" in err
    # The run folder works too, and sampling options and a batch of two prompts.
    rc, out2, err = run_main(["--ckpt", str(model_folder / "run"), "--prompt", "the cat", "--prompt", "a dog ran",
                              "--max-new-tokens", "8", "--temperature", "0.9", "--top-k", "20", "--top-p", "0.95",
                              "--seed", "3"])
    assert rc == 0, err
    lines = out2.splitlines()
    assert lines[0].startswith("the cat") and lines[-1].startswith("a dog ran")


def main_in_worker(argv):
    return run_main(argv)


def test_main_tp2_equals_tp1(model_folder, dist_run):
    argv = ["--ckpt", str(model_folder / "run"), "--prompt", "the bird", "--max-new-tokens", "8"]
    rc, out1, _ = run_main(argv)
    assert rc == 0
    (rc0, out0, err0), (rc1, out_1, _) = dist_run(2, main_in_worker, argv + ["--tp", "2"])
    assert (rc0, rc1) == (0, 0), err0
    assert out0 == out1 and out_1 == ""  # rank 0 prints, the same text as one process


@pytest.mark.parametrize("case, match", [
    ("missing", "does not exist"),
    ("no-tokenizer", "no tokenizer files"),
    ("long-prompt", "longer than the model's max_position_embeddings"),
    ("greedy-and-temperature", "--greedy cannot be combined"),
])
def test_main_bad_input(model_folder, tmp_path, case, match):
    from zoo.convert.io import write_model_folder

    folder = str(model_folder / "run" / "model")
    argv = ["--ckpt", folder, "--prompt", "the cat"]
    if case == "missing":
        argv[1] = str(tmp_path / "nope")
    elif case == "no-tokenizer":
        cfg = GPTConfig.from_preset("tiny", num_hidden_layers=1)
        argv[1] = str(write_model_folder(tmp_path / "bare", "gpt", cfg.to_dict(),
                                         unpadded_tensors(SpecSequential(layer_specs(cfg)))))
    elif case == "long-prompt":
        argv[3] = "the cat sat on the mat. " * 20
    else:
        argv += ["--greedy", "--temperature", "0.5"]
    rc, out, err = run_main(argv)
    assert rc == 2 and out == ""
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and match in errors[0], err

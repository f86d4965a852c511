"""Gemma 2's block features in zoo's GPT (``norm_weight_offset``, ``norm_placement="sandwich"``,
``activation="geglu"``, ``embedding_multiplier``, ``final_logit_softcapping``, with the attention variants):
the logits equal transformers' Gemma2 (eager attention) on the same weights, greedy generation equals HF's, the
fused LM head + loss refuses the final soft-cap in one line when the model is built, and a tiny Gemma-2-like model
trains the same in every layout as in one process (fp32, 1e-5 relative, 3 steps): tp2 + SP, pp2, dp2 under ZeRO-2
(tests/training/test_gpt_layouts.py's runs) and cp2 with Ulysses and ring attention (test_cp_layouts.py's runs).
"""

from __future__ import annotations

import pytest
import torch

from tests.convert.test_hf_gpt import hf_gemma2, randomize_
from tests.models.test_gpt_vs_transformers import load_from_hf
from tests.training import test_attention_layouts as attention_layouts
from tests.training import test_cp_layouts as cp_layouts
from tests.training import test_gpt_layouts as gpt_layouts
from zoo.convert.hf.gemma2 import table, to_zoo
from zoo.models.generate import Generator
from zoo.models.gpt import GPTConfig, ParallelOptions, layer_specs
from zoo.models.specs import SpecSequential

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

# The Gemma 2 block on the tiny Llama of the layout tests (h = 64: embeddings times 8), its head tied as Gemma's.
GEMMA = ["model.norm_weight_offset=1.0", "model.norm_placement=sandwich", "model.activation=geglu",
         "model.embedding_multiplier=8.0", "model.final_logit_softcapping=2.0", "model.tie_word_embeddings=true"]
LAYOUTS = ["tp2-sp", "pp2", "dp2-zero2", "cp2-ulysses", "cp2-ring"]
_reference = {}


def gemma_pair(seed: int = 0):
    """A random HF Gemma 2 (tests/convert/test_hf_gpt.py's tiny one) and zoo's GPT with the same weights."""
    torch.manual_seed(seed)
    hf = hf_gemma2().eval()
    randomize_(hf, seed)
    cfg = to_zoo(hf.config)
    model = SpecSequential(layer_specs(cfg, ParallelOptions())).eval()
    load_from_hf(model, hf, table(cfg), cfg)
    return hf, model, cfg


def test_logits_equal_transformers_gemma2():
    hf, model, cfg = gemma_pair()
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))  # 24 > window 5
    with torch.no_grad():
        theirs, ours = hf(ids).logits, model(ids)[..., : cfg.vocab_size]
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)
    assert ours.abs().max() > 1.0 and ours.abs().max() < cfg.final_logit_softcapping  # capped, worth comparing


def test_greedy_generation_equals_transformers_gemma2():
    hf, model, cfg = gemma_pair(seed=2)
    ids = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    ours = Generator(model).generate(ids, max_new_tokens=8, eos_token_id=None, pad_token_id=0)
    assert torch.equal(ours.tokens, theirs)


def test_fused_cross_entropy_refuses_the_final_soft_cap():
    cfg = GPTConfig.from_preset("tiny-llama", final_logit_softcapping=30.0)
    with pytest.raises(ValueError, match="final_logit_softcapping is not supported with the fused LM head"):
        layer_specs(cfg, ParallelOptions(fused_cross_entropy=True))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gemma_like_model_trains_alike(dist_run, tmp_path_factory, layout):
    """Window + soft-caps + query scale (test_attention_layouts' settings) with Gemma's block on top."""
    cp = layout.startswith("cp")
    extra = [*(attention_layouts.CP if cp else attention_layouts.DENSE), *GEMMA]
    if cp:
        if "cp" not in _reference:
            _reference["cp"] = dist_run(1, cp_layouts.train_case, "llama", extra,
                                        str(tmp_path_factory.mktemp("ref")))[0]
        expected = _reference["cp"]
        world, overrides = cp_layouts.LAYOUTS[layout]
        runs = dist_run(world, cp_layouts.train_case, "llama", overrides + extra, str(tmp_path_factory.mktemp(layout)))
    else:
        expected = gpt_layouts.layout_run(dist_run, "llama", "single", extra)[0][0]
        runs = gpt_layouts.layout_run(dist_run, "llama", layout, extra)[0]
    for rank_losses in runs:
        torch.testing.assert_close(torch.tensor(rank_losses), torch.tensor(expected), rtol=1e-5, atol=0)
    assert expected[-1] < expected[0], f"the reference run must learn: {expected}"

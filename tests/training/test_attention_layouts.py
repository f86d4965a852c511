"""A GPT with sliding windows (shorter than the sequence, mixed with full layers), logit soft-capping and a query
scale other than 1/sqrt(d) trains the same model in every layout as in one process (fp32, 1e-5 relative, 3 steps):
tp2 with sequence parallelism, pp2 and dp2 under ZeRO-2 (the runs of tests/training/test_gpt_layouts.py, 32 tokens,
window 8), cp2 with Ulysses and with ring attention (the runs of tests/training/test_cp_layouts.py, 256 tokens,
window 48: shorter than a ring chunk of 64, so the ring skips whole blocks and cuts others to their corner).
"""

from __future__ import annotations

import pytest
import torch

from tests.training import test_cp_layouts as cp_layouts
from tests.training import test_gpt_layouts as gpt_layouts

LAYER_TYPES = "model.layer_types=[sliding_attention,full_attention,sliding_attention,sliding_attention]"
VARIANT = [LAYER_TYPES, "model.attn_logit_softcapping=1.0", "model.query_pre_attn_scalar=24"]
DENSE = [*VARIANT, "model.sliding_window=8"]
CP = [*VARIANT, "model.sliding_window=48", "training.steps=3"]

_cp_reference = {}


def layout_and_reference(dist_run, tmp_path_factory, layout: str, extra: list, cache: dict, key="cp") -> tuple:
    """``(every rank's losses at layout, the one-process losses)`` of the tiny Llama with ``extra``: a cp layout
    through test_cp_layouts' runs (its one-process reference made once, kept in ``cache[key]``), any other through
    test_gpt_layouts' cached runs."""
    if not layout.startswith("cp"):
        return (gpt_layouts.layout_run(dist_run, "llama", layout, extra)[0],
                gpt_layouts.layout_run(dist_run, "llama", "single", extra)[0][0])
    if key not in cache:
        cache[key] = dist_run(1, cp_layouts.train_case, "llama", extra, str(tmp_path_factory.mktemp("ref")))[0]
    world, overrides = cp_layouts.LAYOUTS[layout]
    return (dist_run(world, cp_layouts.train_case, "llama", overrides + extra, str(tmp_path_factory.mktemp(layout))),
            cache[key])


def assert_trains_alike(runs, expected) -> None:
    """Every rank's losses are the one process's (1e-5 relative), and the reference run learns."""
    for rank_losses in runs:
        torch.testing.assert_close(torch.tensor(rank_losses), torch.tensor(expected), rtol=1e-5, atol=0)
    assert expected[-1] < expected[0], f"the reference run must learn: {expected}"


@pytest.mark.parametrize("layout", ["tp2-sp", "pp2", "dp2-zero2"])
def test_windowed_capped_model_trains_alike(dist_run, layout):
    expected = gpt_layouts.layout_run(dist_run, "llama", "single", DENSE)[0][0]
    for rank_losses in gpt_layouts.layout_run(dist_run, "llama", layout, DENSE)[0]:
        torch.testing.assert_close(torch.tensor(rank_losses), torch.tensor(expected), rtol=1e-5, atol=0)
    assert expected[-1] < expected[0], f"the reference run must learn: {expected}"


@pytest.mark.parametrize("layout", ["cp2-ulysses", "cp2-ring"])
def test_windowed_capped_model_trains_alike_under_context_parallelism(dist_run, tmp_path_factory, layout):
    if "ref" not in _cp_reference:
        _cp_reference["ref"] = dist_run(1, cp_layouts.train_case, "llama", CP, str(tmp_path_factory.mktemp("ref")))[0]
    expected = _cp_reference["ref"]
    world, overrides = cp_layouts.LAYOUTS[layout]
    for rank_losses in dist_run(world, cp_layouts.train_case, "llama", overrides + CP,
                                str(tmp_path_factory.mktemp(layout))):
        torch.testing.assert_close(torch.tensor(rank_losses), torch.tensor(expected), rtol=1e-5, atol=0)
    assert len(expected) == 3 and expected[-1] < expected[0], f"the reference run must learn: {expected}"

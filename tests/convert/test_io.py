"""The layout-free model folder: written from any layout, read into any layout, bit-exact, only local slices."""

import json

import pytest
import torch

from zoo.convert.io import CheckpointError, iter_tensors, load_model, read_config, save_model, write_model_folder


def build(preset, tp, pp, seed=7, **overrides):
    """The tiny model at (tp, pp) in this worker: returns (module, grid)."""
    from zoo.models.gpt import GPTConfig, GPTLoss, ParallelOptions, layer_specs
    from zoo.models.specs import SpecSequential, build_pipeline
    from zoo.parallel.topology import initialize_model_parallel

    cfg = GPTConfig.from_preset(preset, vocab_size=500, **overrides)  # 500: padded to 512 -> padding rows exist
    grid = initialize_model_parallel(tp, pp)
    specs = layer_specs(cfg, ParallelOptions())
    if pp > 1:
        return build_pipeline(specs, grid, loss_fn=GPTLoss(cfg), base_seed=seed), grid, cfg
    return SpecSequential(specs, base_seed=seed), grid, cfg


def save_case(preset, tp, pp, folder):
    module, grid, cfg = build(preset, tp, pp)
    save_model(folder, module, grid, "gpt", cfg.to_dict())
    return True


def load_case(preset, tp, pp, folder):
    """Load the folder into (tp, pp), then write it back out from that layout to folder + '-again'."""
    module, grid, cfg = build(preset, tp, pp, seed=99)  # a different init: every value must come from the folder
    load_model(folder, module, grid.tp_group)
    save_model(folder + "-again", module, grid, "gpt", cfg.to_dict())
    return True


def reference_tensors(preset):
    """The tp=1 model built with the seed, vocabulary rows past vocab_size dropped (the expected folder)."""
    module, grid, cfg = build(preset, 1, 1)
    out = {}
    for name, p in module.named_parameters():
        rows = getattr(p, "unpadded_size", None)
        out[name] = p.detach()[:rows] if rows else p.detach()
    return out


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_save_tp2pp2_load_every_layout(preset, tmp_path, dist_run):
    folder = str(tmp_path / "model")
    dist_run(4, save_case, preset, 2, 2, folder)
    family, config = read_config(folder)
    assert family == "gpt" and config["vocab_size"] == 500
    expected = reference_tensors(preset)
    saved = dict(iter_tensors(folder))
    assert sorted(saved) == sorted(expected)
    for name in expected:  # the tp=2 x pp=2 model is the tp=1 model sliced: gathered back it is equal, bit for bit
        assert torch.equal(saved[name], expected[name]), name
    for world, tp, pp in [(1, 1, 1), (2, 2, 1), (2, 1, 2), (4, 2, 2)]:
        dist_run(world, load_case, preset, tp, pp, folder)
        again = dict(iter_tensors(folder + "-again"))
        assert sorted(again) == sorted(saved)
        for name in saved:
            assert torch.equal(again[name], saved[name]), f"{name} after a round trip through tp={tp} pp={pp}"


def test_bad_folders(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        read_config(tmp_path / "nope")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(CheckpointError, match="hf-to-zoo"):
        read_config(tmp_path / "hf")
    module, grid, cfg = build("tiny", 1, 1)
    # A model of another shape: the first tensor whose shape differs is named with both shapes.
    tensors = [(n, torch.zeros(3, 3)) if "qkv.weight" in n else (n, p.detach()[: getattr(p, "unpadded_size", None)])
               for n, p in module.named_parameters()]
    write_model_folder(tmp_path / "bad", "gpt", cfg.to_dict(), tensors)
    with pytest.raises(CheckpointError, match=r"tensor 1\.attention\.qkv\.weight: checkpoint has shape \(3, 3\)"):
        load_model(tmp_path / "bad", module)
    write_model_folder(tmp_path / "partial", "gpt", cfg.to_dict(), tensors[:2])
    with pytest.raises(CheckpointError, match="lacks"):
        load_model(tmp_path / "partial", module)
    assert not list(tmp_path.glob(".*tmp"))  # no staging folders left behind

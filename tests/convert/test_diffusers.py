"""diffusers UNet2DModel <-> zoo's diffusion U-Net, checked against diffusers itself.

Small UNet2DModels with random weights (GroupNorm affines and biases randomized too) are saved with
``save_pretrained``, imported, and run in zoo at tp=1 and tp=2: outputs must equal diffusers' to 1e-5. Exporting
back must reproduce every tensor bit for bit, in a folder ``UNet2DModel.from_pretrained`` loads.
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.parallel.helpers import grid_for
from zoo.convert import io
from zoo.convert.unet import (
    ConvertError,
    diffusers_config_to_zoo,
    export_unet2d,
    import_unet2d,
    key_table,
    verify_unet2d,
    zoo_config_to_diffusers,
)
from zoo.models.specs import SpecSequential
from zoo.models.unet import DiffusionUNetConfig, layer_specs, num_parameters

WEIGHTS = "diffusion_pytorch_model.safetensors"

CONFIGS = {
    "tiny": DiffusionUNetConfig.from_preset("tiny"),
    # DDPM CIFAR-10's options (one head per block, asymmetric downsampling padding, cos/sin order, eps) made small.
    "ddpm-like": DiffusionUNetConfig.from_preset(
        "ddpm-32", block_out_channels=(16, 32, 32), down_block_types=("DownBlock2D", "AttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "AttnUpBlock2D", "UpBlock2D"), norm_num_groups=8, sample_size=16),
    # The remaining options zoo implements: own time-embedding width, centring, mid-block scale, no mid attention,
    # attention in every up block, one channel count tp 2 splits into straddling GroupNorm groups (12 / 2 = 6).
    "options": DiffusionUNetConfig(
        sample_size=8, in_channels=2, out_channels=1, block_out_channels=(12, 24), layers_per_block=1,
        down_block_types=("AttnDownBlock2D", "DownBlock2D"), up_block_types=("AttnUpBlock2D", "AttnUpBlock2D"),
        norm_num_groups=3, attention_head_dim=6, time_embedding_dim=40, center_input_sample=True,
        mid_block_scale_factor=2.0, add_attention=False, norm_eps=1e-6),
}


def _diffusers():
    """Imported on use, so the gloo workers that import this module for tp_load_case skip diffusers' import (~3 s)."""
    return pytest.importorskip("diffusers")


def diffusers_model(cfg: DiffusionUNetConfig, seed: int = 0):
    diffusers = _diffusers()
    torch.manual_seed(seed)
    model = diffusers.UNet2DModel.from_config(zoo_config_to_diffusers(cfg)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norms start at ones/zeros and biases are small: make every tensor matter
                base = 1.0 if name.endswith("norm1.weight") or "norm" in name and name.endswith("weight") else 0.0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=g))
    return model


def batch(cfg: DiffusionUNetConfig):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, cfg.in_channels, cfg.sample_size, cfg.sample_size, generator=g)
    return x, torch.tensor([5, 871])


def saved(tmp_path, name):
    cfg = CONFIGS[name]
    model = diffusers_model(cfg)
    model.save_pretrained(tmp_path / "hf")
    x, t = batch(cfg)
    with torch.no_grad():
        expected = model(x, t).sample
    return cfg, model, expected


@pytest.mark.parametrize("name", list(CONFIGS))
def test_import_matches_diffusers_and_export_is_bit_exact(tmp_path, name):
    cfg, model, expected = saved(tmp_path, name)
    import_unet2d(tmp_path / "hf", tmp_path / "zoo")
    family, stored = io.read_config(tmp_path / "zoo")
    assert family == "unet-diffusion" and DiffusionUNetConfig.from_dict(stored) == cfg

    zoo_model = SpecSequential(layer_specs(cfg)).eval()
    io.load_model(tmp_path / "zoo", zoo_model)
    with torch.no_grad():
        got = zoo_model(batch(cfg))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert verify_unet2d(tmp_path / "hf", tmp_path / "zoo") < 1e-5

    export_unet2d(tmp_path / "zoo", tmp_path / "back")
    original, back = load_file(tmp_path / "hf" / WEIGHTS), load_file(tmp_path / "back" / WEIGHTS)
    assert sorted(back) == sorted(original)
    for key in original:
        assert torch.equal(back[key], original[key]), key
    reloaded, info = _diffusers().UNet2DModel.from_pretrained(tmp_path / "back", output_loading_info=True)
    assert not any(info.values()), info
    assert reloaded.config.block_out_channels == model.config.block_out_channels
    with torch.no_grad():
        assert torch.equal(reloaded.eval()(*batch(cfg)).sample, expected)


def test_default_unet2dmodel_and_ddpm_preset_map_every_tensor():
    """UNet2DModel's own defaults (built on the meta device) and the DDPM CIFAR-10 shape: every diffusers tensor has
    a row, and the parameter counts agree."""
    diffusers = _diffusers()
    for cfg_in in (None, DiffusionUNetConfig.from_preset("ddpm-32")):
        with torch.device("meta"):
            model = diffusers.UNet2DModel() if cfg_in is None else \
                diffusers.UNet2DModel.from_config(zoo_config_to_diffusers(cfg_in))
        cfg = diffusers_config_to_zoo(dict(model.config))
        hf_keys = {k for row in key_table(cfg) for k in row.hf}
        assert hf_keys == set(model.state_dict())
        assert num_parameters(cfg) == sum(p.numel() for p in model.parameters())
    assert num_parameters(DiffusionUNetConfig.from_preset("ddpm-32")) == 35_746_307  # google/ddpm-cifar10-32
    with pytest.warns(UserWarning, match=r"ignoring config field\(s\) \['resnet_num_groups'\]"):
        diffusers_config_to_zoo({**zoo_config_to_diffusers(CONFIGS["tiny"]), "resnet_num_groups": 8})


def test_pipeline_folder_and_deprecated_attention_names(tmp_path):
    """A pipeline folder (model in unet/) whose attention uses the pre-Attention names query/key/value/proj_attn."""
    cfg, model, expected = saved(tmp_path, "tiny")
    pipe = tmp_path / "pipe"
    (pipe / "unet").mkdir(parents=True)
    (pipe / "model_index.json").write_text(json.dumps({"_class_name": "DDPMPipeline"}))
    (pipe / "unet" / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    old = {".to_q.": ".query.", ".to_k.": ".key.", ".to_v.": ".value.", ".to_out.0.": ".proj_attn."}
    tensors = {}
    for key, value in load_file(tmp_path / "hf" / WEIGHTS).items():
        for new, name in old.items():
            key = key.replace(new, name)
        tensors[key] = value
    assert any(".query." in k for k in tensors)
    save_file(tensors, str(pipe / "unet" / WEIGHTS))
    import_unet2d(pipe, tmp_path / "zoo")
    zoo_model = SpecSequential(layer_specs(cfg)).eval()
    io.load_model(tmp_path / "zoo", zoo_model)
    with torch.no_grad():
        torch.testing.assert_close(zoo_model(batch(cfg)), expected, rtol=0, atol=1e-5)


def test_refusals_are_one_line(tmp_path):
    cfg, model, _ = saved(tmp_path, "tiny")
    hf = tmp_path / "hf"
    meta = json.loads((hf / "config.json").read_text())
    tensors = load_file(hf / WEIGHTS)

    def folder(name, config=None, weights=None, pickle=False):
        path = tmp_path / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps(meta if config is None else config))
        if pickle:
            (path / "diffusion_pytorch_model.bin").write_bytes(b"not read")
        else:
            save_file(tensors if weights is None else weights, str(path / WEIGHTS))
        return path

    key = "down_blocks.0.resnets.0.conv1.weight"
    cases = [
        (folder("cond", {**meta, "_class_name": "UNet2DConditionModel"}),
         "model class UNet2DConditionModel is not supported; zoo converts UNet2DModel only"),
        (folder("fourier", {**meta, "time_embedding_type": "fourier"}),
         "DiffusionUNetConfig: time_embedding_type='fourier' is not supported (zoo implements the sinusoidal "
         "(positional) embedding only); use 'positional'"),
        (folder("missing", weights={k: v for k, v in tensors.items() if k != key}),
         f"tensor {key} is missing from {tmp_path / 'missing'}"),
        (folder("extra", weights={**tensors, "class_embedding.weight": torch.zeros(2, 2)}),
         f"{tmp_path / 'extra'}: 1 tensor(s) the UNet2DModel table does not use, e.g. ['class_embedding.weight']; "
         f"the model has a feature zoo does not convert"),
        (folder("shape", {**meta, "in_channels": 4}),
         f"tensor(s) conv_in.weight in {tmp_path / 'shape'} have shape(s) [(32, 3, 3, 3)]; config.json implies "
         f"(32, 4, 3, 3) for 0.conv_in.weight"),
        (folder("pickle", pickle=True),
         f"{tmp_path / 'pickle'} holds only a pickle checkpoint (diffusion_pytorch_model.bin), which can run code "
         f"when loaded; re-save it as safetensors (UNet2DModel.from_pretrained(...).save_pretrained(...))"),
        (tmp_path / "nowhere", f"diffusers folder {tmp_path / 'nowhere'} does not exist"),
    ]
    for src, message in cases:
        with pytest.raises(ConvertError) as info:
            import_unet2d(src, tmp_path / "out")
        assert str(info.value) == message
    assert not (tmp_path / "out").exists(), "a refused import must write nothing"

    io.write_model_folder(tmp_path / "seg", "unet-segmentation", {"classes": 3}, iter([("0.w", torch.zeros(1))]))
    with pytest.raises(ConvertError, match="holds a 'unet-segmentation' model; this converter exports the "
                                           "unet-diffusion family"):
        export_unet2d(tmp_path / "seg", tmp_path / "out")


# ---- an imported checkpoint in a tp=2 model --------------------------------------------------------------------

def tp_load_case(name, folder, expected):
    grid = grid_for(2)
    cfg = CONFIGS[name]
    model = SpecSequential(layer_specs(cfg)).eval()
    io.load_model(folder, model, grid.tp_group)
    assert any(getattr(p, "tensor_model_parallel", False) for p in model.parameters())
    with torch.no_grad():
        torch.testing.assert_close(model(batch(cfg)), expected, rtol=0, atol=1e-5)
    return True


def test_tp2_model_loads_an_import_and_matches_diffusers(dist_run, tmp_path):
    """The "options" model: straddling GroupNorm groups (12 channels / 3 groups over 2 ranks), heads split 1 + 1."""
    _, _, expected = saved(tmp_path, "options")
    import_unet2d(tmp_path / "hf", tmp_path / "zoo")
    assert all(dist_run(2, tp_load_case, "options", str(tmp_path / "zoo"), expected))

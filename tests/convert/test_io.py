"""The layout-free model folder: written from any layout, read into any layout, bit-exact, only local slices."""

import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from zoo.convert.io import (
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointError,
    ShardedWriter,
    iter_tensors,
    load_model,
    read_config,
    save_model,
    write_model_folder,
)


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


def mixed_tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "w.fp32": torch.randn(6, 5, generator=g),
        "w.bf16": torch.randn(7, 3, generator=g).to(torch.bfloat16),
        "ids.int64": torch.randint(-10**12, 10**12, (5,), generator=g),
        "w.fp16": torch.randn(3, 3, generator=g).to(torch.float16),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "transposed": torch.randn(4, 9, generator=g).t(),  # not contiguous: stored as its values
        "mask.bool": torch.tensor([True, False, True]),
        "odd.int8": torch.arange(-3, 4, dtype=torch.int8),  # 7 bytes: what follows must still be aligned
    }


@pytest.mark.parametrize("max_bytes", [10**9, 100], ids=["one-file", "sharded"])
def test_sharded_writer_matches_save_file(tmp_path, max_bytes):
    """Streamed to disk tensor by tensor, the files hold what safetensors' own save_file stores, bit for bit."""
    tensors = mixed_tensors()
    writer = ShardedWriter(tmp_path, prefix="part", max_shard_bytes=max_bytes)
    for name, t in tensors.items():
        writer.add(name, t)
    mapping = writer.close()
    assert sorted(mapping) == sorted(tensors)
    assert writer.total_bytes == sum(t.numel() * t.element_size() for t in tensors.values())
    files = sorted(set(mapping.values()))
    assert len(files) == 1 if max_bytes > 10**6 else len(files) > 2
    assert sorted(p.name for p in tmp_path.iterdir()) == files  # the temporary data files are gone
    save_file({k: t.contiguous() for k, t in tensors.items()}, str(tmp_path / "ref.st"), metadata={"format": "pt"})
    with safe_open(tmp_path / "ref.st", "pt") as ref:
        for fname in files:
            raw = (tmp_path / fname).read_bytes()
            n = struct.unpack("<Q", raw[:8])[0]
            assert n % 8 == 0 and raw[8:8 + n].rstrip(b" ").endswith(b"}")  # the data starts 8-aligned
            header = json.loads(raw[8:8 + n])
            assert header.pop("__metadata__") == {"format": "pt"}
            end = 0
            for info in sorted(header.values(), key=lambda i: i["data_offsets"]):  # packed, each at its alignment
                begin, stop = info["data_offsets"]
                assert begin == end and begin % {"I64": 8, "F32": 4, "BF16": 2, "F16": 2}.get(info["dtype"], 1) == 0
                end = stop
            assert 8 + n + end == len(raw)
            with safe_open(tmp_path / fname, "pt") as f:
                assert f.metadata() == {"format": "pt"}
                for key in f.keys():
                    assert mapping[key] == fname
                    got, want = f.get_tensor(key), ref.get_tensor(key)
                    assert got.dtype == want.dtype and got.shape == want.shape, key
                    assert torch.equal(got.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8)), key
    dup = ShardedWriter(tmp_path, prefix="dup")
    dup.add("a", torch.ones(1))
    with pytest.raises(ValueError, match="written twice"):
        dup.add("a", torch.ones(1))


def test_write_model_folder_extra_files_and_shards(tmp_path):
    tensors = mixed_tensors()
    folder = write_model_folder(tmp_path / "m", "gpt", {"x": 1}, tensors.items(), max_shard_bytes=64,
                                extra_files={"generation_config.json": '{"eos_token_id": 0}', "notes.bin": b"\x00\x01"})
    assert (folder / INDEX_FILE).is_file() and not (folder / SINGLE_FILE).exists()
    assert json.loads((folder / "generation_config.json").read_text()) == {"eos_token_id": 0}
    assert (folder / "notes.bin").read_bytes() == b"\x00\x01"
    back = dict(iter_tensors(folder))
    assert sorted(back) == sorted(tensors)
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t), k
    single = write_model_folder(tmp_path / "one", "gpt", {"x": 1}, tensors.items())
    assert (single / SINGLE_FILE).is_file() and not (single / INDEX_FILE).exists()
    for bad in ("../escape.json", "sub/file.json", "config.json", "model.safetensors"):
        with pytest.raises(ValueError, match="extra file"):
            write_model_folder(tmp_path / "bad", "gpt", {}, [], extra_files={bad: "x"})
    assert not (tmp_path / "bad").exists() and not list(tmp_path.glob(".*"))


def test_sharded_writer_copies_by_hand_where_the_kernel_cannot(tmp_path, monkeypatch):
    """``os.copy_file_range`` may fail part way (or not exist): the copy goes on through a buffer, same file."""
    import os

    real = os.copy_file_range

    def flaky(src, dst, count, offset_src=None, offset_dst=None):
        if flaky.calls:
            raise OSError(18, "Invalid cross-device link")
        flaky.calls += 1
        return real(src, dst, min(count, 5), offset_src, offset_dst)

    flaky.calls = 0
    tensors = mixed_tensors()
    for folder, patch in ((tmp_path / "kernel", False), (tmp_path / "by-hand", True)):
        if patch:
            monkeypatch.setattr(os, "copy_file_range", flaky)
        folder.mkdir()
        writer = ShardedWriter(folder)
        for name, t in tensors.items():
            writer.add(name, t)
        writer.close()
    assert flaky.calls == 1
    assert (tmp_path / "kernel" / "model-00001.safetensors").read_bytes() == \
        (tmp_path / "by-hand" / "model-00001.safetensors").read_bytes()


def build_moe(ep, seed=7):
    """tiny-moe (with the balancing bias) at dp = ep = world size, tp = pp = 1: (module, grid-like, config, ep
    group)."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from zoo.models.gpt import GPTConfig, ParallelOptions, layer_specs
    from zoo.models.specs import SpecSequential
    from zoo.parallel.topology import initialize_model_parallel

    cfg = GPTConfig.from_preset("tiny-moe", vocab_size=500, moe_expert_bias=True)
    grid = initialize_model_parallel(1, 1)
    ep_group = dist.new_group(list(range(dist.get_world_size()))) if ep > 1 else None
    module = SpecSequential(layer_specs(cfg, ParallelOptions(ep_group=ep_group)), base_seed=seed)
    with torch.no_grad():  # a bias the seed does not give (the buffer starts at zero)
        for name, buf in module.named_buffers():
            if name.endswith("expert_bias"):
                buf.copy_(torch.linspace(-1, 1, buf.numel()) + seed)
    view = SimpleNamespace(tp_group=grid.tp_group, dp_rank=grid.dp_rank, pp_rank=grid.pp_rank, ep_group=ep_group)
    return module, view, cfg, ep_group


def moe_save_case(ep, folder):
    module, view, cfg, _ = build_moe(ep)
    save_model(folder, module, view, "gpt", cfg.to_dict())
    return True


def moe_load_case(ep, folder):
    """Load into ep ranks (another seed), return this rank's experts and bias, and write the folder back out."""
    module, view, cfg, ep_group = build_moe(ep, seed=99)
    load_model(folder, module, view.tp_group, ep_group)
    save_model(folder + "-again", module, view, "gpt", cfg.to_dict())
    return {n: t.detach().clone() for n, t in module.state_dict().items() if "experts" in n or "expert_bias" in n}


def test_moe_experts_are_saved_whole_and_loaded_per_expert_parallel_rank(tmp_path, dist_run):
    folder = str(tmp_path / "moe")
    dist_run(2, moe_save_case, 2, folder)  # written from ep=2: every expert gathered
    ref_module, _, _, _ = build_moe(1)
    expected = {n: t.detach() for n, t in ref_module.state_dict().items()}
    saved = dict(iter_tensors(folder))
    assert sorted(saved) == sorted(expected)
    for name, value in saved.items():  # the ep=2 model is the ep=1 model with its experts split: equal bit for bit
        rows = value.shape[0]
        assert torch.equal(value, expected[name][:rows]), name
    assert any(n.endswith("expert_bias") for n in saved) and any("experts.gate_up_proj" in n for n in saved)
    for rank, local in enumerate(dist_run(2, moe_load_case, 2, folder)):
        for name, value in local.items():
            full = saved[name]
            if "experts." in name:  # rank r holds experts [r E/2, (r+1) E/2)
                n = full.shape[0] // 2
                assert torch.equal(value, full[rank * n:(rank + 1) * n]), name
            else:
                assert torch.equal(value, full), name
    again = dict(iter_tensors(folder + "-again"))
    assert sorted(again) == sorted(saved) and all(torch.equal(again[n], saved[n]) for n in saved)
    dist_run(1, moe_load_case, 1, folder)  # and into one process: every expert
    again = dict(iter_tensors(folder + "-again"))
    assert all(torch.equal(again[n], saved[n]) for n in saved)


def test_large_tensors_are_read_in_chunks_exactly(tmp_path):
    """``_read_in_chunks`` (tensors over COPY_CHUNK_BYTES, a few rows per open of the file) fills each kind of
    local part as the one-pass read does, and as the full tensor cut by hand: a padded vocabulary split over TP, a
    column split with stride 2 (fused [gate; up]), a row split, experts of one expert-parallel rank, a bias."""
    from zoo.convert import io
    from zoo.parallel.layers import set_tensor_model_parallel_attributes, shard_master_weight

    g = torch.Generator().manual_seed(0)
    full = {"vocab": torch.randn(500, 8, generator=g), "fused": torch.randn(16, 6, generator=g),
            "rows": torch.randn(5, 12, generator=g), "experts": torch.randn(4, 3, 2, generator=g),
            "bias": torch.randn(7, generator=g, dtype=torch.float64)}
    save_file(full, tmp_path / "t.safetensors")
    tp, rank = 2, 1
    padded = torch.cat([full["vocab"], torch.zeros(12, 8)])  # 512 rows
    expected = {"vocab": shard_master_weight(padded, 0, rank, tp),
                "fused": shard_master_weight(full["fused"], 0, rank, tp, stride=2),
                "rows": shard_master_weight(full["rows"], 1, rank, tp), "experts": full["experts"][2:4],
                "bias": full["bias"].float()}
    params = {name: torch.full_like(value, float("nan")) for name, value in expected.items()}
    for name, (dim, stride) in {"vocab": (0, 1), "fused": (0, 2), "rows": (1, 1)}.items():
        set_tensor_model_parallel_attributes(params[name], dim, stride)
    params["vocab"].unpadded_size = 500
    params["experts"].expert_parallel = True
    for name, param in params.items():
        io._read_in_chunks(tmp_path / "t.safetensors", name, param, rank, tp, 1, 2, chunk_bytes=20)
        with safe_open(tmp_path / "t.safetensors", "pt") as f:
            one_pass = io._local_slice(f, name, param, rank, tp, 1, 2)
        assert torch.equal(param, expected[name]) and torch.equal(param, one_pass.to(param.dtype)), name


def test_row_reader_reads_exactly_the_rows_asked_for(tmp_path):
    """``RowReader`` (plain file reads, no memory map) returns the stored rows for runs and gaps, each dtype, in a
    reused buffer or fresh; rows outside the tensor and a truncated file are refused with the tensor named."""
    from zoo.convert.io import RowReader

    g = torch.Generator().manual_seed(0)
    full = {"f32": torch.randn(50, 6, generator=g), "bf16": torch.randn(9, 2, 3, generator=g).bfloat16(),
            "i64": torch.arange(40).reshape(20, 2), "mask": torch.rand(7, 5, generator=g) > 0.5}
    path = tmp_path / "t.safetensors"
    save_file(full, path)
    for key, value in full.items():
        reader = RowReader(path, key)
        assert reader.shape == tuple(value.shape) and reader.dtype == value.dtype
        for rows in ([0], [1, 2, 3, 6], list(range(value.shape[0])), [value.shape[0] - 1], []):
            got = reader.read(rows)
            assert got.shape == (len(rows), *value.shape[1:]) and torch.equal(got, value[rows]), (key, rows)
    reader = RowReader(path, "f32")
    first = reader.read(range(10, 20), reuse=True).clone()
    second = reader.read(range(0, 4), reuse=True)  # the same buffer, a shorter view of it
    assert torch.equal(first, full["f32"][10:20]) and torch.equal(second, full["f32"][:4])
    with pytest.raises(IndexError, match="outside tensor f32"):
        reader.read([49, 50])
    save_file({"f32": full["f32"]}, tmp_path / "one.safetensors")
    (tmp_path / "cut.safetensors").write_bytes((tmp_path / "one.safetensors").read_bytes()[:-8])
    with pytest.raises(CheckpointError, match="ends inside tensor f32"):
        RowReader(tmp_path / "cut.safetensors", "f32").read([49])


def test_local_row_blocks_are_the_shard_in_blocks(tmp_path, monkeypatch):
    """``local_row_blocks`` yields this TP rank's rows of a padded vocabulary in blocks of the asked size (the
    padding past the stored rows as one block of zeros); together they are the rank's shard of the padded table."""
    from zoo.convert import io
    from zoo.parallel.layers import set_tensor_model_parallel_attributes, shard_master_weight

    full = torch.randn(500, 8, generator=torch.Generator().manual_seed(1))
    write_model_folder(tmp_path / "m", "gpt", {}, iter([("emb", full)]))
    padded = torch.cat([full, torch.zeros(12, 8)])  # 512 rows over tp 2: rank 1's last 12 are padding
    for rank in (0, 1):
        monkeypatch.setattr(io, "group_rank_and_size", lambda group, rank=rank: (rank, 2))
        param = torch.empty(256, 8, device="meta")
        set_tensor_model_parallel_attributes(param, 0, 1)
        param.unpadded_size = 500
        blocks = [block.clone() for block in  # a block is valid until the next one
                  io.local_row_blocks(tmp_path / "m", "emb", param, None, block_bytes=10 * 8 * 4)]
        assert max(len(b) for b in blocks) >= 10 and all(len(b) <= 10 for b in blocks if b.any())  # padding: 1
        assert torch.equal(torch.cat(blocks), shard_master_weight(padded, 0, rank, 2)), rank

"""tp larger than the key-value heads: each kv head replicated over the tp / nkv ranks that split its query heads
(zoo.parallel.layers.GroupedQKVLinear), checked against the same model in one process (tp 1, same seed): the loss,
every gradient (the replicated k/v rows summed over their ranks, so the replicas stay equal), the clipping norm
(the k/v rows counted once), and model folders (written at tp > nkv equal to the tp 1 folder, bit for bit; read
back into the same rows). Runs at tp 2 with one kv head (with and without SP) and tp 4 with two, in a 4-rank pool.
"""

from __future__ import annotations

import pytest
import torch

from zoo.models.gpt import GPTConfig

CONFIG = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
              max_position_embeddings=64, position_embedding_type="rope", normalization="rmsnorm",
              activation="swiglu", add_bias=False, qkv_bias=True, tie_word_embeddings=False, qk_norm="head")


def _model(cfg, tp, sp):
    from zoo.models.gpt import ParallelOptions, layer_specs
    from zoo.models.specs import SpecSequential
    from zoo.parallel.topology import initialize_model_parallel

    grid = initialize_model_parallel(tp, 1)
    torch.manual_seed(0)
    model = SpecSequential(layer_specs(cfg, ParallelOptions(tp_group=grid.tp_group, sequence_parallel=sp)))
    return grid, model


def _loss(cfg, model, grid):
    from zoo.models.gpt import GPTLoss

    ids = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    # qkv biases start at zero; give them values (a function of the stored row) so their rows are exercised
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "qkv" in name and "bias" in name:
                ranges = p.stored_rows[grid.tp_rank] if hasattr(p, "stored_rows") else [(0, p.numel())]
                p.copy_(torch.sin(0.37 * torch.cat([torch.arange(a, b) for a, b in ranges]).float()))
    loss = GPTLoss(cfg, grid.tp_group)(model(ids[:, :-1]), ids[:, 1:])
    loss.backward()
    return loss.detach()


def replicated_case(kv_heads, tp, sp, folder):
    from pathlib import Path

    from zoo.convert import io
    from zoo.parallel.grad_norm import clip_grad_norm_
    from zoo.parallel.layers import GroupedQKVLinear

    cfg = GPTConfig(**CONFIG, num_key_value_heads=kv_heads)
    folder = Path(folder)
    grid1, ref = _model(cfg, 1, False)
    ref_loss = _loss(cfg, ref, grid1)
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    ref_norm = clip_grad_norm_(ref.parameters(), 1e9, grid1)
    io.save_model(folder / "tp1", ref, grid1, "gpt", cfg.to_dict())
    grid, model = _model(cfg, tp, sp)
    loss = _loss(cfg, model, grid)
    out = {"loss": (loss - ref_loss).abs().item()}
    qkv = [m for m in model.modules() if isinstance(m, GroupedQKVLinear)]
    assert len(qkv) == cfg.num_hidden_layers
    worst = 0.0
    for name, p in model.named_parameters():
        if hasattr(p, "stored_rows"):
            full = ref_grads[io.stored_key(name, p)]
            mine = torch.cat([full[a:b] for a, b in p.stored_rows[grid.tp_rank]])
        elif getattr(p, "tensor_model_parallel", False):
            full = ref_grads[name]
            mine = full.chunk(tp, dim=p.partition_dim)[grid.tp_rank] if p.partition_stride == 1 else None
            if mine is None or name.endswith("fc1.weight"):
                continue  # strided (gate/up) shards: covered by the layout tests
            if getattr(p, "unpadded_size", None) is not None:
                continue  # vocabulary-padded
        else:
            mine = ref_grads[name]
        worst = max(worst, (p.grad - mine).abs().max().item())
    out["grad"] = worst
    from zoo.plan.estimate import block_tensors  # the planner's tensors of a block on one rank: these

    out["planned"] = sorted(block_tensors(cfg, 0, tp)[0]) == sorted(p.numel() for n, p in model.named_parameters()
                                                                     if n.startswith("1."))
    out["norm"] = abs(clip_grad_norm_(model.parameters(), 1e9, grid) - ref_norm) / ref_norm
    io.save_model(folder / f"tp{tp}", model, grid, "gpt", cfg.to_dict())
    same = True
    if grid.rank == 0:
        a, b = dict(io.iter_tensors(folder / "tp1")), dict(io.iter_tensors(folder / f"tp{tp}"))
        same = sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    out["folder"] = same
    _, fresh = _model(cfg, tp, sp)
    io.load_model(folder / "tp1", fresh, grid.tp_group)
    params = dict(model.named_parameters())
    # (vocabulary padding rows: zeros when read, drawn when built)
    out["diff"] = [n for n, p in fresh.named_parameters()
                   if getattr(p, "unpadded_size", None) is None and not torch.equal(p, params[n])]
    return out


@pytest.mark.parametrize("kv_heads,tp,sp", [(1, 2, False), (1, 2, True), (2, 4, False), (1, 4, True)])
def test_replicated_kv_heads_compute_the_one_process_model(dist_run, tmp_path, kv_heads, tp, sp):
    for rank, out in enumerate(dist_run(4, replicated_case, kv_heads, tp, sp, str(tmp_path))):
        assert out["loss"] < 1e-6 and out["grad"] < 1e-6 and out["norm"] < 1e-6, (rank, out)
        assert out["folder"] and not out["diff"] and out["planned"], (rank, out["diff"], out["planned"])


def test_layouts_that_cannot_replicate_are_refused_in_one_line():
    cfg = GPTConfig(**CONFIG, num_key_value_heads=2)
    cfg.check_layout(4)  # a multiple of the kv heads
    with pytest.raises(ValueError, match=r"^num_key_value_heads 2 and tp 3: one must divide the other"):
        GPTConfig(**{**CONFIG, "num_attention_heads": 6, "hidden_size": 48}, num_key_value_heads=2).check_layout(3)
    with pytest.raises(ValueError, match=r"^num_attention_heads 4 is not divisible by tp 8"):
        cfg.check_layout(8)
    full = GPTConfig(**{**CONFIG, "qk_norm": "full"}, num_key_value_heads=2)
    with pytest.raises(ValueError, match=r"^qk_norm 'full' is not supported with tp 4 > num_key_value_heads 2"):
        full.check_layout(4)


def test_verify_names_the_kv_rule_and_the_layouts_that_work():
    from zoo.convert.gpt import layout_problem

    cfg = GPTConfig(**{**CONFIG, "num_attention_heads": 12, "head_dim": 16}, num_key_value_heads=4)
    assert layout_problem(cfg, 8, 1).startswith("tp 8 does not divide num_attention_heads 12; ")
    assert layout_problem(cfg, 12, 1) is None  # replicated: 3 ranks per kv head
    assert layout_problem(cfg, 6, 1) == ("tp 6 does not divide num_key_value_heads 4 (nor is a multiple of it); tp "
                                         "must divide num_attention_heads 12 and intermediate_size 96, and divide or "
                                         "be a multiple of num_key_value_heads 4: use 1, 2, 4 or 12")
    full = GPTConfig(**{**CONFIG, "qk_norm": "full"}, num_key_value_heads=2)
    assert layout_problem(full, 4, 1) == ("tp 4 does not divide num_key_value_heads 2 (qk_norm 'full' needs tp <= kv "
                                          "heads); tp must divide num_attention_heads 4 and intermediate_size 96, and "
                                          "divide or be a multiple of num_key_value_heads 2 (at most it: qk_norm "
                                          "'full'): use 1 or 2")


def test_generation_with_the_kv_cache_at_tp2_equals_tp1(tmp_path, dist_run):
    """One kv head at tp 2: each rank caches its group's (replicated) kv head; greedy and sampled tokens as at tp 1."""
    from tests.models.test_generate import generate_from_folder
    from zoo.convert import io
    from zoo.models.gpt import ParallelOptions, layer_specs
    from zoo.models.specs import SpecSequential

    cfg = GPTConfig(**CONFIG, num_key_value_heads=1)
    model = SpecSequential(layer_specs(cfg, ParallelOptions()))
    folder = str(tmp_path / "model")
    io.write_model_folder(folder, "gpt", cfg.to_dict(),
                          ((n, io.full_param(t, None)) for n, t in io.model_tensors(model).items()))
    ids = torch.randint(0, cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(6))
    greedy1, sampled1 = generate_from_folder(folder, 1, ids, 12)
    for greedy2, sampled2 in dist_run(2, generate_from_folder, folder, 2, ids, 12):
        assert torch.equal(greedy2, greedy1) and torch.equal(sampled2, sampled1)


def subgroups_case():
    import torch.distributed as dist

    from zoo.parallel.topology import LayoutError, initialize_model_parallel, tensor_parallel_subgroup

    grid = initialize_model_parallel(4, 1)
    pair = tensor_parallel_subgroup(grid.tp_group, 2)
    try:
        grid.tp_subgroup(3)
        refused = None
    except LayoutError as e:
        refused = str(e)
    return (dist.get_process_group_ranks(pair), tensor_parallel_subgroup(grid.tp_group, 4) is grid.tp_group,
            tensor_parallel_subgroup(grid.tp_group, 1), [size for size, _, _ in grid.tp_subgroups()], refused)


def test_tp_subgroups_are_runs_of_consecutive_tp_ranks(dist_run):
    for rank, (pair, whole, none, sizes, refused) in enumerate(dist_run(4, subgroups_case)):
        assert pair == [rank // 2 * 2, rank // 2 * 2 + 1] and whole and none is None and sizes == [2]
        assert refused == "no TP subgroup of 3 ranks: 3 does not divide tp 4"

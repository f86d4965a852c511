"""Plain and pipelined models built from the same specs: same parameters (count and names) and same loss."""

import torch
from deepspeed.accelerator import get_accelerator

from tests.parallel.helpers import grid_for
from zoo.models.gpt import GPTConfig, GPTLoss, layer_specs
from zoo.models.specs import SpecSequential, build_pipeline


def _batch(cfg):
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, cfg.vocab_size, (2, 17), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def plain_case(preset):
    cfg = GPTConfig.from_preset(preset)
    model = SpecSequential(layer_specs(cfg), base_seed=7)
    ids, labels = _batch(cfg)
    loss = GPTLoss(cfg)(model(ids), labels).item()
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}, loss


def pipeline_case(preset, partition_method):
    """Forward through a 2-stage PipelineModule by hand: stage 0 sends its output to stage 1."""
    import torch.distributed as dist

    grid = grid_for(1, 2)
    cfg = GPTConfig.from_preset(preset)
    module = build_pipeline(layer_specs(cfg), grid, loss_fn=GPTLoss(cfg), base_seed=7,
                            partition_method=partition_method)
    ids, labels = _batch(cfg)
    device = get_accelerator().current_device_name()
    hidden = torch.empty(2, 16, cfg.hidden_size, device=device)
    with torch.no_grad():
        if grid.is_first_stage:
            dist.send(module(ids.to(device)).contiguous(), dst=grid.pp_ranks[1])
            loss = None
        else:
            dist.recv(hidden, src=grid.pp_ranks[0])
            loss = GPTLoss(cfg)(module(hidden), labels.to(device)).item()
    params = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    kinds = sorted({type(m).__name__ for m in module.forward_funcs if isinstance(m, torch.nn.Module)})
    return params, loss, kinds


def _check(dist_run, preset, partition_method):
    plain_params, plain_loss = plain_case(preset)
    stages = dist_run(2, pipeline_case, preset, partition_method)
    merged = {}
    for params, _, _ in stages:
        merged.update(params)  # the tied embedding appears on both stages under the same key
    assert merged == plain_params
    cfg = GPTConfig.from_preset(preset)
    padding = (cfg.padded_vocab_size() - cfg.vocab_size) * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    assert sum(torch.Size(s).numel() for s in merged.values()) == cfg.num_parameters() + padding
    torch.testing.assert_close(stages[1][1], plain_loss, rtol=1e-6, atol=0)
    return stages


def test_gpt2_plain_and_pipeline_agree(dist_run):
    _check(dist_run, "tiny", "parameters")


def test_llama_plain_and_pipeline_agree_partitioned_by_block_type(dist_run):
    stages = _check(dist_run, "tiny-llama", "type:GPTBlock")
    # type:GPTBlock balances the blocks: 2 per stage; the embedding sits with the first, the head with the last.
    assert stages[0][2] == ["GPTBlock", "GPTEmbedding"]
    assert stages[1][2] == ["GPTBlock", "GPTFinalNorm", "GPTLMHead"]

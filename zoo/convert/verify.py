"""A zoo model folder computes what its HuggingFace original computes, at any (tp, pp) layout.

    python launch/convert.py verify --hf HF --zoo DIR
    torchrun --nproc_per_node 4 launch/convert.py verify --hf HF --zoo DIR --tp 2 --pp 2

Every rank builds its part of the zoo model at (tp, pp), reads its slices of the folder (``io.load_model``) and
runs a fixed, seeded batch of token ids; pipeline stages pass activations with ``zoo.parallel.pipe_forward``, the
last stage gathers the vocab-sharded logits over TP and cuts the padding, and global rank 0 compares them with
transformers' logits on the same ids (fp32 on both sides). As torchtitan checks its converters: by logits.
"""

from __future__ import annotations

import torch

from zoo.convert import io
from zoo.convert.hf_gpt import (
    ConvertError,
    HFCheckpoint,
    gpt_config,
    gpt_config_from_hf,
    read_hf_config,
    resolve_hf_folder,
)
from zoo.models.gpt import GPTConfig, GPTLoss, ParallelOptions, layer_specs
from zoo.parallel.shards import gather_objects, global_rank
from zoo.parallel.topology import initialize_model_parallel

# Fields that make two GPTs different models (others, e.g. eps or RoPE settings, show up as a logit difference).
STRUCTURE = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "intermediate_size", "position_embedding_type", "normalization", "activation", "add_bias",
             "tie_word_embeddings")


def _either(values: list[int]) -> str:
    values = [str(v) for v in values]
    return values[0] if len(values) == 1 else f"{', '.join(values[:-1])} or {values[-1]}"


def layout_problem(cfg: GPTConfig, tp: int, pp: int) -> str | None:
    """One line saying why (tp, pp) cannot hold this model and which values can, or None."""
    if tp < 1 or pp < 1:
        return f"tp and pp must be positive, got tp {tp} pp {pp}"
    split = {"num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
             "intermediate_size": cfg.intermediate_size}  # what tensor parallelism cuts
    bad = [(name, n) for name, n in split.items() if n % tp]
    if bad:
        ok = [t for t in range(1, cfg.num_key_value_heads + 1) if all(n % t == 0 for n in split.values())]
        name, n = bad[0]
        return (f"tp {tp} does not divide {name} {n}; tp must divide num_attention_heads {cfg.num_attention_heads}, "
                f"num_key_value_heads {cfg.num_key_value_heads} and intermediate_size {cfg.intermediate_size}: "
                f"use {_either(ok)}")
    if pp > cfg.num_hidden_layers:
        return (f"pp {pp} exceeds num_hidden_layers {cfg.num_hidden_layers}; every pipeline stage needs a block: "
                f"use pp <= {cfg.num_hidden_layers}")
    return None


def check_zoo(zoo, tp: int, pp: int) -> GPTConfig:
    """The zoo folder's config, and whether (tp, pp) can hold it; checked on every rank before any process group."""
    try:
        family, meta = io.read_config(zoo)
    except io.CheckpointError as e:
        raise ConvertError(str(e)) from None
    if family != "gpt":
        raise ConvertError(f"{zoo} holds a {family!r} model; this verifier compares gpt models")
    cfg = gpt_config(meta)
    problem = layout_problem(cfg, tp, pp)
    if problem:
        raise ConvertError(problem)
    return cfg


def check_hf(hf, cfg: GPTConfig, *, allow_pickle: bool = False):
    """The HF folder (resolved), checked to be a supported model of the same structure as ``cfg``."""
    folder = resolve_hf_folder(hf, allow_pickle=allow_pickle)
    arch, hf_cfg = read_hf_config(folder)
    HFCheckpoint(folder, allow_pickle)  # refuses a pickle checkpoint without allow_pickle
    theirs = gpt_config_from_hf(arch, hf_cfg)
    for name in STRUCTURE:
        if getattr(theirs, name) != getattr(cfg, name):
            raise ConvertError(f"{hf} and the zoo folder are different models: {name} {getattr(theirs, name)} vs "
                               f"{getattr(cfg, name)}")
    return folder


def token_ids(cfg: GPTConfig, batch: int = 2, seq: int = 16, seed: int = 0) -> torch.Tensor:
    """The fixed batch ``[batch, seq]``: seeded, within the vocabulary and the position table."""
    seq = min(seq, cfg.max_position_embeddings)
    return torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


def zoo_logits(zoo, cfg: GPTConfig, tp: int, pp: int, ids: torch.Tensor) -> torch.Tensor | None:
    """``[b, s, vocab_size]`` fp32 logits of the zoo folder at (tp, pp) on global rank 0; None elsewhere."""
    from deepspeed.accelerator import get_accelerator

    from zoo.models.specs import SpecSequential, build_pipeline
    from zoo.parallel.mappings import gather_from_tensor_model_parallel_region
    from zoo.parallel.pipe_forward import move_tensor, pipeline_forward

    device = get_accelerator().current_device_name()
    grid = initialize_model_parallel(tp, pp)
    specs = layer_specs(cfg, ParallelOptions(tp_group=grid.tp_group))
    module = build_pipeline(specs, grid, loss_fn=GPTLoss(cfg, grid.tp_group)) if pp > 1 else SpecSequential(specs)
    io.load_model(zoo, module, grid.tp_group)
    module.to(device).eval()
    with torch.no_grad():
        out = pipeline_forward(module, ids.to(device), grid, device)  # [b, s, V_padded / tp] on the last stage
        if out is not None:
            out = gather_from_tensor_model_parallel_region(out, grid.tp_group)[..., : cfg.vocab_size].float()
    last = grid.topology.get_rank(pipe=pp - 1, data=0, model=0)
    logits = move_tensor(out if grid.rank == last else None, last, 0, device)
    return None if logits is None else logits.cpu()


def hf_logits(folder, ids: torch.Tensor, *, allow_pickle: bool = False) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, use_safetensors=not allow_pickle,
                                                 trust_remote_code=False).eval()
    with torch.no_grad():
        return model(ids).logits.float()


def verify(hf, zoo, tp: int = 1, pp: int = 1, *, batch: int = 2, seq: int = 16, seed: int = 0,
           allow_pickle: bool = False) -> float:
    """max |zoo logits - HF logits| on the fixed batch. Collective: every rank of a world of tp x pp (x dp)
    processes calls it (a plain process is a world of one); every rank returns the same value."""
    cfg = check_zoo(zoo, tp, pp)
    initialize_model_parallel(tp, pp)  # a world size that tp x pp does not divide is refused here, on every rank
    # Only rank 0 runs transformers; its verdict on the HF side reaches every rank, so all stop together.
    folder, problem = None, None
    if global_rank() == 0:
        try:
            folder = check_hf(hf, cfg, allow_pickle=allow_pickle)
        except ConvertError as e:
            problem = str(e)
    problem = gather_objects(problem)[0]
    if problem:
        raise ConvertError(problem)
    ids = token_ids(cfg, batch, seq, seed)
    ours = zoo_logits(zoo, cfg, tp, pp, ids)
    diff = None
    if global_rank() == 0:
        theirs = hf_logits(folder, ids, allow_pickle=allow_pickle)
        # Shapes match after check_hf; a mismatch here must not leave the other ranks waiting.
        diff = (ours - theirs).abs().max().item() if theirs.shape == ours.shape else float("inf")
    return gather_objects(diff)[0]

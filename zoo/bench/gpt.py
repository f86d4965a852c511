"""Training throughput of zoo's GPT against HuggingFace ``transformers`` on the same model, in one process.

    python launch/benchmark.py                                   # both styles, small CPU-sized models
    python launch/benchmark.py --style llama --steps 20
    python launch/benchmark.py --style moe                       # Mixtral-like mixture of experts
    python launch/benchmark.py --preset gpt2-124m --dtype bf16 --batch-size 8 --seq-length 1024   # on a GPU

For each style the two models have the same shape and parameter count:

- GPT-2 style: zoo's learned-position / LayerNorm / GELU(tanh) / biased / tied model against ``GPT2LMHeadModel``
  (``activation_function="gelu_new"``, every dropout 0);
- Llama style: zoo's RoPE / RMSNorm / SwiGLU / bias-free / GQA model against ``LlamaForCausalLM``;
- MoE style: the Llama style with every MLP a mixture of ``--experts`` SwiGLU experts, top-``--experts-per-token``
  softmax routing renormalised (Mixtral's), against ``MixtralForCausalLM`` with its default (eager) experts, and
  again with transformers' ``grouped_mm`` experts implementation where torch has ``grouped_mm`` (CPU too).
  Router losses are off on both sides (same work); FLOPs count the active experts only.

Both train on the same batch ``[b, s]`` (inputs and next-token labels of one random token sequence), with the same
dtype (parameters cast to it; fp32 on CPU), the same optimizer (``torch.optim.AdamW``, fused where the device
has the kernel) and the same step: zero grads, forward, loss, backward, optimizer step.
HF attention is ``sdpa``, as zoo calls ``F.scaled_dot_product_attention``; HF's loss is its own
``ForCausalLMLoss`` fed the already shifted labels (``shift_labels``), so both average over the same b*s tokens.

Timing: warm-up steps first, then N timed steps with the accelerator synchronised around each; the two models'
steps are interleaved (and their order alternated), so load from other processes hits both alike. Reported:
median step time, tokens/s = b*s / median, the median CPU time of the process per step (steadier than wall time
on a shared CPU), TFLOP/s from :func:`zoo.training.metrics.training_flops_per_token`
(no recomputation; the same count for both, since the models are the same), MFU where the device's peak is
known, and the peak memory of one step: parameters + optimizer state + the most the step allocates on top
(accelerator allocator statistics; on CPU the profiler's allocation events).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

STYLES = ("gpt2", "llama", "moe")  # "both": gpt2 and llama
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# The CPU-sized default model (both styles): under a minute for everything on 2 idle cores, a few when shared.
DEFAULT_SIZE = dict(hidden_size=256, layers=4, heads=4, seq_length=256, batch_size=4, vocab_size=8192)
DEFAULT_EXPERTS, DEFAULT_EXPERTS_PER_TOKEN = 8, 2
PRESET_SEQ_LENGTH, PRESET_BATCH_SIZE = 1024, 8


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="launch/benchmark.py",
        description="Training tokens/s of zoo's GPT vs transformers' GPT2LMHeadModel / LlamaForCausalLM of the same "
                    "size, batch, dtype and optimizer, in one process.",
    )
    p.add_argument("--style", choices=[*STYLES, "both"], default=None,
                   help="model style (default: both = gpt2 and llama; with --preset, the preset's style)")
    p.add_argument("--preset", help="a zoo GPT preset (e.g. gpt2-124m, llama-1b); size flags override its fields. "
                                    f"Default batch/seq with a preset: {PRESET_BATCH_SIZE} x {PRESET_SEQ_LENGTH}")
    p.add_argument("--hidden-size", type=int, help=f"hidden size (default {DEFAULT_SIZE['hidden_size']})")
    p.add_argument("--layers", type=int, help=f"transformer blocks (default {DEFAULT_SIZE['layers']})")
    p.add_argument("--heads", type=int, help=f"attention (query) heads (default {DEFAULT_SIZE['heads']})")
    p.add_argument("--kv-heads", type=int, help="key/value heads, Llama style only (default: half the heads, "
                                                "grouped-query attention; GPT-2 is multi-head)")
    p.add_argument("--intermediate-size", type=int, help="MLP size, Llama style only (default: 2.75 h rounded up "
                                                         "to a multiple of 64; GPT-2 style uses 4 h)")
    p.add_argument("--experts", type=int, help=f"MoE style: experts per layer (default {DEFAULT_EXPERTS})")
    p.add_argument("--experts-per-token", type=int,
                   help=f"MoE style: experts each token is routed to (default {DEFAULT_EXPERTS_PER_TOKEN})")
    p.add_argument("--seq-length", type=int, help=f"tokens per sequence (default {DEFAULT_SIZE['seq_length']})")
    p.add_argument("--batch-size", type=int, help=f"sequences per step (default {DEFAULT_SIZE['batch_size']})")
    p.add_argument("--vocab-size", type=int, help=f"vocabulary (default {DEFAULT_SIZE['vocab_size']}; a multiple of "
                                                  "128 keeps zoo unpadded, so both models do the same work)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per model (default 10; the median is reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed warm-up steps per model (default 3)")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32",
                   help="parameter and compute dtype of both models (default fp32; bf16/fp16 for GPUs)")
    p.add_argument("--threads", type=int, default=None,
                   help=f"torch CPU threads (default: all cores available, here {_cores()})")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (default 1e-4)")
    p.add_argument("--seed", type=int, default=1234, help="seed of the weights and of the token batch")
    p.add_argument("--no-memory", action="store_true", help="skip the extra step that measures peak memory")
    p.add_argument("--no-compile", action="store_true",
                   help="eager models only (default: also both models with torch.compile on every block)")
    p.add_argument("--no-roofline", action="store_true",
                   help="skip measuring the rate of every GEMM shape the step runs (fraction_of_matmul)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel size, under torchrun with that many processes: zoo only (eager and "
                        "compiled), with the bytes each collective moves per step")
    p.add_argument("--gpu-suite", action="store_true",
                   help="the whole GPU set in one command: gpt2-124m and llama-1b in bf16 (eager and compiled, "
                        "against transformers) and, with 2 GPUs, gpt2-124m at --tp 2 under torchrun; results in "
                        "--out (default runs/bench-gpu)")
    p.add_argument("--out", default="runs/bench-gpu", help="--gpu-suite: where the JSON reports go")
    p.add_argument("--json", nargs="?", const="-", metavar="FILE",
                   help="end the output with one JSON line of tokens/s per style and model (zoo_eager, "
                        "zoo_compiled, hf_eager, hf_compiled, fraction_of_matmul); with FILE also write the whole "
                        "report there")
    return p


# ---------------------------------------------------------------------------------------------------------------
# Configurations: zoo's GPTConfig, and the transformers config of the same model
# ---------------------------------------------------------------------------------------------------------------


def _mixtral_like(cfg) -> bool:
    """Every MLP a routed mixture (softmax, renormalised top-k), nothing Mixtral lacks."""
    return (all(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)) and cfg.scoring_func == "softmax"
            and cfg.norm_topk_prob and cfg.routed_scaling_factor == 1.0 and cfg.n_group == 1
            and cfg.num_shared_experts == 0 and not cfg.moe_expert_bias and cfg.capacity_factor is None
            and cfg.qk_norm is None and not cfg.use_qkv_bias
            and cfg.head_dim == cfg.hidden_size // cfg.num_attention_heads)


def style_of(cfg) -> str:
    """'gpt2', 'llama' or 'moe' (Mixtral) for the canonical feature sets; a mix has no transformers twin."""
    gpt2 = ("learned", "layernorm", "gelu", True)
    llama = ("rope", "rmsnorm", "swiglu", False)
    features = (cfg.position_embedding_type, cfg.normalization, cfg.activation, cfg.add_bias)
    if cfg.num_experts > 0:
        if features == llama and _mixtral_like(cfg):
            return "moe"
        raise ValueError("the benchmark's MoE style is Mixtral's (Llama blocks, every MLP routed, softmax top-k "
                         "renormalised, no shared experts, groups, bias or capacity); transformers' "
                         "MixtralForCausalLM has no twin of this model")
    if features == gpt2 and cfg.num_key_value_heads == cfg.num_attention_heads and cfg.tie_word_embeddings:
        return "gpt2"
    if features == llama:
        return "llama"
    raise ValueError(f"the model {features} (position, norm, activation, bias) is neither GPT-2 style "
                     f"{gpt2} with tied embeddings and multi-head attention nor Llama style {llama}; "
                     "transformers has no model of the same shape to compare with")


def _llama_intermediate(h: int) -> int:
    return -(-int(2.75 * h) // 64) * 64  # tiny-llama's ratio (176 for h=64)


def zoo_config(style: str, args):
    """The GPTConfig to benchmark: a preset with overrides, or the flags' sizes on top of tiny / tiny-llama."""
    from zoo.models.gpt import GPTConfig

    overrides = dict(hidden_dropout=0.0, attention_dropout=0.0)
    for flag, name in (("hidden_size", "hidden_size"), ("layers", "num_hidden_layers"),
                       ("heads", "num_attention_heads"), ("vocab_size", "vocab_size")):
        value = getattr(args, flag)
        if value is None and args.preset is None:
            value = DEFAULT_SIZE[flag]
        if value is not None:
            overrides[name] = value
    if style == "moe":
        overrides.update(router_aux_loss_coef=0.0, router_z_loss_coef=0.0)  # as MixtralForCausalLM's default forward
        for flag, name, default in (("experts", "num_experts", DEFAULT_EXPERTS),
                                    ("experts_per_token", "num_experts_per_tok", DEFAULT_EXPERTS_PER_TOKEN)):
            value = getattr(args, flag)
            if value is not None or args.preset is None:
                overrides[name] = default if value is None else value
    if args.preset is None:
        base = {"gpt2": "tiny", "llama": "tiny-llama", "moe": "tiny-moe"}[style]
        seq = args.seq_length or DEFAULT_SIZE["seq_length"]
        overrides["max_position_embeddings"] = seq
        if style in ("llama", "moe"):
            heads = overrides["num_attention_heads"]
            overrides["num_key_value_heads"] = args.kv_heads or (heads // 2 if heads % 2 == 0 else heads)
            overrides["intermediate_size"] = args.intermediate_size or _llama_intermediate(overrides["hidden_size"])
        else:
            overrides["num_key_value_heads"] = overrides["num_attention_heads"]
            overrides["intermediate_size"] = 4 * overrides["hidden_size"]
    else:
        base = args.preset
        if style in ("llama", "moe"):
            if args.kv_heads is not None:
                overrides["num_key_value_heads"] = args.kv_heads
            if args.intermediate_size is not None:
                overrides["intermediate_size"] = args.intermediate_size
        elif "hidden_size" in overrides:
            overrides["intermediate_size"] = 4 * overrides["hidden_size"]
        if "num_attention_heads" in overrides and style == "gpt2":
            overrides["num_key_value_heads"] = overrides["num_attention_heads"]
    cfg = GPTConfig.from_preset(base, **overrides)
    if args.preset is not None and args.seq_length and args.seq_length > cfg.max_position_embeddings:
        cfg = GPTConfig.from_dict({**cfg.to_dict(), "max_position_embeddings": args.seq_length})
    if style_of(cfg) != style:
        raise ValueError(f"preset {args.preset!r} is {style_of(cfg)} style, not {style}")
    return cfg


def hf_config(cfg, experts_implementation: str | None = None):
    """The transformers config of the same model (same shape, eps, RoPE, tying; no dropout, no KV cache, sdpa)."""
    from transformers import GPT2Config, LlamaConfig, MixtralConfig

    special = dict(bos_token_id=cfg.vocab_size - 1, eos_token_id=cfg.vocab_size - 1)
    if style_of(cfg) == "gpt2":
        hf = GPT2Config(vocab_size=cfg.vocab_size, n_embd=cfg.hidden_size, n_layer=cfg.num_hidden_layers,
                        n_head=cfg.num_attention_heads, n_positions=cfg.max_position_embeddings,
                        n_inner=cfg.intermediate_size, activation_function="gelu_new",
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0,
                        layer_norm_epsilon=cfg.norm_eps, initializer_range=cfg.initializer_range,
                        tie_word_embeddings=True, use_cache=False, **special)
    else:
        rope = {"rope_type": "default"}
        if cfg.rope_scaling is not None:
            rope = dict(cfg.rope_scaling)
            rope["rope_type"] = rope.pop("type", None) or rope["rope_type"]
    if style_of(cfg) == "moe":
        hf = MixtralConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                           intermediate_size=cfg.expert_intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
                           num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                           max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.norm_eps,
                           rope_parameters={**rope, "rope_theta": cfg.rope_theta}, sliding_window=None,
                           num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                           output_router_logits=False, router_aux_loss_coef=0.0, router_jitter_noise=0.0,
                           tie_word_embeddings=cfg.tie_word_embeddings, attention_dropout=0.0,
                           initializer_range=cfg.initializer_range, use_cache=False, **special)
        if experts_implementation is not None:
            hf._experts_implementation = experts_implementation
    elif style_of(cfg) == "llama":
        hf = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                         intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
                         num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                         max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.norm_eps,
                         rope_parameters={**rope, "rope_theta": cfg.rope_theta},
                         tie_word_embeddings=cfg.tie_word_embeddings, attention_bias=False, mlp_bias=False,
                         attention_dropout=0.0, initializer_range=cfg.initializer_range, use_cache=False, **special)
    hf._attn_implementation = "sdpa"
    return hf


# ---------------------------------------------------------------------------------------------------------------
# The two trainees
# ---------------------------------------------------------------------------------------------------------------


class Trainee:
    """One model, its AdamW and the step ``zero_grad, forward + loss, backward, optimizer step``."""

    def __init__(self, impl: str, model: torch.nn.Module, loss_of, lr: float):
        self.impl, self.model, self.loss_of = impl, model, loss_of
        try:  # torch's fused kernel where the device has one (CPU too: 5x the default per-parameter loop there)
            self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
        except RuntimeError:
            self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        self.step_times: list[float] = []
        self.cpu_times: list[float] = []  # process CPU time of each timed step (all threads)
        self.losses: list[float] = []

    def step(self, ids, labels) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        return self.train_step(ids, labels)

    def train_step(self, ids, labels) -> torch.Tensor:
        """Forward + loss, backward, optimizer step (the gradients must be None or zero before)."""
        loss = self.loss_of(ids, labels)
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def timed_step(self, ids, labels, accel, record: bool) -> None:
        accel.synchronize()
        start, cpu_start = time.perf_counter(), time.process_time()
        loss = self.step(ids, labels)
        accel.synchronize()
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        if record:
            self.step_times.append(elapsed)
            self.cpu_times.append(cpu)
        self.losses.append(float(loss))

    def static_bytes(self) -> int:
        """Parameters and optimizer state, as held between steps (gradients are freed by zero_grad)."""
        seen, total = set(), 0
        tensors = list(self.model.parameters())
        for state in self.optimizer.state.values():
            tensors += [t for t in state.values() if torch.is_tensor(t)]
        for t in tensors:
            key = (t.device, t.data_ptr())
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
        return total


def build_zoo(cfg, device, dtype, seed: int, lr: float, fused_cross_entropy: bool = False) -> Trainee:
    from zoo.models.gpt import GPTLoss, ParallelOptions, layer_specs
    from zoo.models.specs import SpecSequential

    par = ParallelOptions(fused_cross_entropy=fused_cross_entropy)
    model = SpecSequential(layer_specs(cfg, par), base_seed=seed).to(device=device, dtype=dtype).train()
    loss_fn = GPTLoss(cfg)
    return Trainee("zoo", model, lambda ids, labels: loss_fn(model(ids), labels), lr)


def build_hf(cfg, device, dtype, seed: int, lr: float, experts_implementation: str | None = None) -> Trainee:
    from transformers import GPT2LMHeadModel, LlamaForCausalLM, MixtralForCausalLM

    hf_cfg = hf_config(cfg, experts_implementation)
    torch.manual_seed(seed)
    cls = {"gpt2": GPT2LMHeadModel, "llama": LlamaForCausalLM, "moe": MixtralForCausalLM}[style_of(cfg)]
    model = cls(hf_cfg).to(device=device, dtype=dtype).train()
    model.loss_type = "ForCausalLM"  # what it falls back to anyway, without a warning
    if model.config._attn_implementation != "sdpa":
        raise ValueError(f"transformers picked attention {model.config._attn_implementation!r}, not 'sdpa'")

    def loss_of(ids, labels):  # labels are already the next tokens: no shift inside HF's loss
        return model(input_ids=ids, labels=labels, shift_labels=labels, use_cache=False).loss

    impl = "transformers" if experts_implementation is None else f"transformers-{experts_implementation}"
    return Trainee(impl, model, loss_of, lr)


def hf_num_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() counts a tied weight once


def compiled(trainee: Trainee) -> Trainee:
    """The same trainee with every block compiled in place (``nn.Module.compile``, as ``training.compile``
    does for zoo): zoo's GPTBlock, transformers' GPT2Block / LlamaDecoderLayer / MixtralDecoderLayer. Embeddings,
    heads and losses stay eager on both sides, so the comparison is block for block."""
    names = ("GPTBlock", "GPT2Block", "LlamaDecoderLayer", "MixtralDecoderLayer")
    blocks = [m for m in trainee.model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(f"{trainee.impl}: no block to compile")
    for block in blocks:
        block.compile()
    trainee.impl += "-compiled"
    return trainee


# ---------------------------------------------------------------------------------------------------------------
# The roofline: what the step's GEMMs alone would take at the rates this device sustains for their shapes
# ---------------------------------------------------------------------------------------------------------------

def gemm_shapes(trainee: Trainee, ids, labels) -> dict:
    """``{(batch, m, n, k, a transposed, b transposed, dtype): calls}`` of every matrix product one training
    step runs (aten mm / addmm / bmm / baddbmm, plain, out= and in place; forward and backward), recorded by a
    dispatch mode around one extra, untimed eager step.

    A fused attention kernel (SDPA's flash / memory-efficient / cuDNN ops) runs its products inside: they are
    counted as the batched GEMMs they are, 2 forward (``Q K^T``, ``P V``) and 4 backward (``dV``, ``dP``, ``dQ``,
    ``dK``; not the flash backward's recomputed ``Q K^T``), one per query head. Under a causal mask only the
    products' unmasked share is work (``(s + 1) / 2s`` at ``s`` queries and keys), so those calls count that
    share: the roofline does not credit the step for half-masked work a kernel can skip."""
    from collections import Counter

    from zoo.compat.torch import dispatch_mode_class

    TorchDispatchMode = dispatch_mode_class()

    aten = torch.ops.aten
    # the out= and in-place forms too: zoo's fused cross entropy writes its input gradient with torch.mm(..., out=)
    # and accumulates its weight gradient over the chunks with addmm_
    two_d = {aten.mm.default: (0, 1), aten.mm.out: (0, 1), aten.addmm.default: (1, 2), aten.addmm.out: (1, 2),
             aten.addmm_.default: (1, 2)}
    three_d = {aten.bmm.default: (0, 1), aten.bmm.out: (0, 1), aten.baddbmm.default: (1, 2),
               aten.baddbmm.out: (1, 2), aten.baddbmm_.default: (1, 2)}
    shapes: Counter = Counter()

    def transposed(t: torch.Tensor) -> bool:
        return t.dim() >= 2 and t.stride(-2) == 1 and t.stride(-1) != 1

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            where = two_d.get(func) or three_d.get(func)
            if where is not None:
                a, b = args[where[0]], args[where[1]]
                batch = a.shape[0] if func in three_d else 1
                shapes[(batch, a.shape[-2], b.shape[-1], a.shape[-1], transposed(a), transposed(b),
                        str(a.dtype))] += 1
            elif func.overloadpacket in ATTENTION_KERNELS:
                shapes.update(attention_products(func, args, kwargs or {}))
            return func(*args, **(kwargs or {}))

    trainee.optimizer.zero_grad(set_to_none=True)
    with Record():
        trainee.train_step(ids, labels)
    trainee.optimizer.zero_grad(set_to_none=True)
    return dict(shapes)


# SDPA's fused kernels: forward ops, and their backward ops (the same names + "_backward")
ATTENTION_KERNELS = {getattr(torch.ops.aten, name) for base in (
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
    for name in (base, base + "_backward") if hasattr(torch.ops.aten, name)}


def causal_share(queries: int, keys: int) -> float:
    """The share of a ``[queries, keys]`` score matrix a causal mask leaves (SDPA's ``is_causal``: query i sees
    keys 0..i, the mask aligned top left)."""
    return sum(min(i + 1, keys) for i in range(queries)) / (queries * keys)


def attention_products(func, args, kwargs) -> dict:
    """``{gemm shape: calls}`` of the products one fused attention op runs (see ``gemm_shapes``)."""
    from zoo.compat.torch import op_argument_names

    named = dict(zip(op_argument_names(func), args)) | kwargs
    q, k = named["query"], named["key"]  # [b, heads, s, d] and [b, kv heads, s_kv, d]
    batch, s, s_kv, d = q.shape[0] * q.shape[1], q.shape[-2], k.shape[-2], q.shape[-1]
    dv = named["value"].shape[-1]
    share = causal_share(s, s_kv) if named.get("is_causal") else 1.0
    dtype = str(q.dtype)
    if not func.overloadpacket.__name__.endswith("_backward"):
        products = [(batch, s, s_kv, d, False, True, dtype),  # S = Q K^T
                    (batch, s, dv, s_kv, False, False, dtype)]  # O = P V
    else:
        products = [(batch, s_kv, dv, s, True, False, dtype),  # dV = P^T dO
                    (batch, s, s_kv, dv, False, True, dtype),  # dP = dO V^T
                    (batch, s, d, s_kv, False, False, dtype),  # dQ = dS K
                    (batch, s_kv, d, s, True, False, dtype)]  # dK = dS^T Q
    out: dict = {}
    for shape in products:
        out[shape] = out.get(shape, 0.0) + share
    return out


def _operand(rows: int, cols: int, transposed: bool, batch: int, dtype, device) -> torch.Tensor:
    shape = (cols, rows) if transposed else (rows, cols)
    t = torch.randn((batch, *shape) if batch > 1 else shape, dtype=dtype, device=device)
    return t.transpose(-1, -2) if transposed else t


def gemm_seconds(shape: tuple, device, accel, reps: int = 7) -> float:
    """Seconds of one product of this shape and layout here (``torch.mm`` / ``torch.bmm``): the fastest of
    ``reps`` (other processes only ever add time; the step it is compared with is a median)."""
    batch, m, n, k, ta, tb, dtype = shape
    dtype = getattr(torch, dtype.removeprefix("torch."))
    a, b = _operand(m, k, ta, batch, dtype, device), _operand(k, n, tb, batch, dtype, device)
    mm = torch.bmm if batch > 1 else torch.mm
    for _ in range(2):
        mm(a, b)
    times = []
    for _ in range(reps):
        accel.synchronize()
        start = time.perf_counter()
        mm(a, b)
        accel.synchronize()
        times.append(time.perf_counter() - start)
    return min(times)


def gemm_times(shapes: dict, device, accel) -> dict:
    """``{shape: seconds of one product}`` for every recorded shape (``gemm_seconds``)."""
    return {shape: gemm_seconds(shape, device, accel) for shape in shapes}


def roofline(shapes: dict, times: dict) -> tuple[float, float]:
    """``(seconds the step's GEMMs take at the measured rates ``times``, their FLOPs)``."""
    seconds = sum(calls * times[shape] for shape, calls in shapes.items())
    flops = sum(calls * 2 * b * m * n * k for (b, m, n, k, *_), calls in shapes.items())
    return seconds, flops


def square_gemm_flops(device, accel, dtype, size: int | None = None) -> float:
    """FLOP/s of a plain square GEMM of this dtype (1024 on a CPU, 8192 on an accelerator)."""
    size = size or (1024 if accel.device_name() == "cpu" else 8192)
    seconds = gemm_seconds((1, size, size, size, False, False, str(dtype)), device, accel, reps=7)
    return 2 * size**3 / seconds


# ---------------------------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------------------------


def _cpu_step_peak_bytes(trainee: Trainee, ids, labels) -> int | None:
    """The most one step allocates on top of what it starts with, from the profiler's CPU allocation events."""
    # Kineto writes "USDT: profiler_start/stop" lines to stderr around every profile on some CPUs (seen on a Zen 5);
    # level 6 silences its log while this runs: a failure here already means "no figure", not an error.
    previous = os.environ.get("KINETO_LOG_LEVEL")
    os.environ["KINETO_LOG_LEVEL"] = "6"
    try:
        from torch.profiler import ProfilerActivity, profile

        from zoo.compat.torch import cpu_allocations

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            trainee.train_step(ids, labels)
        events = cpu_allocations(prof)
    except Exception:  # private profiler API: no memory figure rather than no benchmark
        return None
    finally:
        if previous is None:
            os.environ.pop("KINETO_LOG_LEVEL", None)
        else:
            os.environ["KINETO_LOG_LEVEL"] = previous
    current = peak = 0
    for _, size in sorted(events, key=lambda e: e[0]):
        current += size
        peak = max(peak, current)
    return peak


def step_peak_memory_gb(trainee: Trainee, ids, labels, accel) -> float | None:
    """Peak memory of one training step of this model alone: parameters + optimizer state + the step's peak
    allocation on top (activations, gradients, optimizer temporaries). One extra, untimed step."""
    trainee.optimizer.zero_grad(set_to_none=True)
    gc.collect()
    static = trainee.static_bytes()
    if accel.device_name() == "cpu":
        extra = _cpu_step_peak_bytes(trainee, ids, labels)
        if extra is None:
            return None
    else:
        accel.synchronize()
        accel.reset_peak_memory_stats()
        base = accel.memory_allocated()
        trainee.train_step(ids, labels)
        accel.synchronize()
        extra = accel.max_memory_allocated() - base
    trainee.optimizer.zero_grad(set_to_none=True)
    return (static + extra) / 2**30


def run_interleaved(trainees: list[Trainee], ids, labels, accel, warmup: int, steps: int) -> None:
    """Warm-up then timed steps, one step of each model in turn, the order flipped every round."""
    for i in range(warmup + steps):
        order = trainees if i % 2 == 0 else trainees[::-1]
        for t in order:
            t.timed_step(ids, labels, accel, record=i >= warmup)


@dataclass
class Result:
    style: str
    impl: str
    params: int
    tokens_per_step: int
    step_time_s: float  # median
    cpu_time_s: float  # median process CPU time of a step (all threads)
    tokens_per_s: float
    tflops: float
    mfu: float | None
    peak_memory_gb: float | None
    loss_first: float
    loss_last: float
    step_times_s: list = field(default_factory=list)


@dataclass
class StyleReport:
    style: str
    config: dict
    zoo_params: int  # cfg.num_parameters(): the unpadded model, as a HF checkpoint counts it
    zoo_params_allocated: int  # zoo's tensors, padded vocabulary included
    hf_params: int
    results: list = field(default_factory=list)
    roofline: dict | None = None  # the step's GEMMs at this device's measured rates (gemm_shapes, roofline)

    @property
    def ratio(self) -> float:
        zoo, hf = (next(r for r in self.results if r.impl == impl) for impl in ("zoo", "transformers"))
        return zoo.tokens_per_s / hf.tokens_per_s

    def tokens_per_s(self, impl: str) -> float | None:
        return next((r.tokens_per_s for r in self.results if r.impl == impl), None)

    def summary(self) -> dict:
        """The ``--json`` line's entry of this style."""
        return {"zoo_eager": self.tokens_per_s("zoo"), "zoo_compiled": self.tokens_per_s("zoo-compiled"),
                "hf_eager": self.tokens_per_s("transformers"),
                "hf_compiled": self.tokens_per_s("transformers-compiled"),
                "fraction_of_matmul": None if self.roofline is None else self.roofline["fraction_of_matmul"]}


def batch_shape(args, cfg) -> tuple[int, int]:
    if args.preset is None:
        return args.batch_size or DEFAULT_SIZE["batch_size"], args.seq_length or DEFAULT_SIZE["seq_length"]
    return args.batch_size or PRESET_BATCH_SIZE, args.seq_length or min(PRESET_SEQ_LENGTH, cfg.max_position_embeddings)


def benchmark_style(style: str, args, accel, device, dtype, log) -> StyleReport:
    from zoo.training.metrics import device_name, peak_tflops, training_flops_per_token

    cfg = zoo_config(style, args)
    b, s = batch_shape(args, cfg)

    zoo = build_zoo(cfg, device, dtype, args.seed, args.lr)
    hf = build_hf(cfg, device, dtype, args.seed, args.lr)
    report = StyleReport(style, cfg.to_dict(), cfg.num_parameters(), sum(p.numel() for p in zoo.model.parameters()),
                         hf_num_parameters(hf.model))
    padded = cfg.padded_vocab_size()
    experts = (f" experts={cfg.num_experts} top-{cfg.num_experts_per_tok} ({cfg.num_parameters(active=True):,} "
               f"active parameters)" if cfg.num_experts else "")
    log(f"{style}: h={cfg.hidden_size} layers={cfg.num_hidden_layers} heads={cfg.num_attention_heads}/"
        f"{cfg.num_key_value_heads} (q/kv) ffn={cfg.intermediate_size}{experts} vocab={cfg.vocab_size}"
        + (f" (zoo pads to {padded})" if padded != cfg.vocab_size else "")
        + f" tied={cfg.tie_word_embeddings}, batch [{b}, {s}] = {b * s} tokens/step | parameters: "
          f"zoo {report.zoo_params:,} (cfg.num_parameters()), transformers {report.hf_params:,}"
        + (f", zoo allocates {report.zoo_params_allocated:,} with the padded vocabulary"
           if report.zoo_params_allocated != report.zoo_params else ""))
    if report.zoo_params != report.hf_params:
        raise ValueError(f"{style}: parameter counts differ (zoo {report.zoo_params:,}, transformers "
                         f"{report.hf_params:,}): the two configs do not describe the same model")

    g = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, cfg.vocab_size, (b, s + 1), generator=g).to(device)
    ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    trainees = [zoo, hf]
    if style == "moe" and hasattr(torch.nn.functional, "grouped_mm"):  # transformers' fused-experts path
        trainees.append(build_hf(cfg, device, dtype, args.seed, args.lr, experts_implementation="grouped_mm"))
    if args.no_compile:
        shapes = None if args.no_roofline else gemm_shapes(zoo, ids, labels)
    else:  # zoo's fast path: training.compile + training.fused_cross_entropy
        fast = build_zoo(cfg, device, dtype, args.seed, args.lr, fused_cross_entropy=True)
        shapes = None if args.no_roofline else gemm_shapes(fast, ids, labels)  # eager: the same GEMMs
        trainees += [compiled(fast), compiled(build_hf(cfg, device, dtype, args.seed, args.lr))]
        log(f"{style}: compiling the blocks of both models (the first warm-up steps)")
    # The GEMMs are timed before and after the steps and each shape keeps its faster time: a machine that slows
    # down for a while (a shared VM) must not make the roofline longer than the steps it is compared with
    before = None if shapes is None else (gemm_times(shapes, device, accel), square_gemm_flops(device, accel, dtype))
    run_interleaved(trainees, ids, labels, accel, args.warmup, args.steps)
    memory = {t.impl: None if args.no_memory else step_peak_memory_gb(t, ids, labels, accel) for t in trainees}

    flops_per_token = training_flops_per_token(cfg, s)  # no activation recomputation
    peak = peak_tflops(device_name(), args.dtype)
    for t in trainees:
        median = statistics.median(t.step_times)
        tok_s = b * s / median
        tflops = flops_per_token * tok_s / 1e12
        if not all(math.isfinite(x) for x in t.losses):
            raise FloatingPointError(f"{style}/{t.impl}: non-finite loss {t.losses}")
        report.results.append(Result(
            style, t.impl, report.hf_params if t.impl.startswith("transformers") else report.zoo_params, b * s, median,
            statistics.median(t.cpu_times), tok_s, tflops, None if peak is None else tflops / peak, memory[t.impl],
            t.losses[0], t.losses[-1], list(t.step_times)))
    if shapes is not None:
        after = gemm_times(shapes, device, accel), square_gemm_flops(device, accel, dtype)
        times = {shape: min(before[0][shape], after[0][shape]) for shape in shapes}
        gemm_s, gemm_flops = roofline(shapes, times)
        of = "zoo" if args.no_compile else "zoo-compiled"  # the model whose GEMMs were recorded
        recorded = next(r for r in report.results if r.impl == of)
        report.roofline = {"of": recorded.impl, "gemm_seconds": gemm_s, "gemm_flops": gemm_flops,
                           "gemm_seconds_before_after": [roofline(shapes, t)[0] for t in (before[0], after[0])],
                           "gemm_shapes": len(shapes), "fraction_of_matmul": gemm_s / recorded.step_time_s,
                           "step_flops_per_s": flops_per_token * b * s / recorded.step_time_s,
                           "square_gemm_flops_per_s": max(before[1], after[1])}
    return report


def benchmark_tp(style: str, args, accel, device, dtype, grid, log) -> list[dict]:
    """zoo alone at tp = the world (transformers has no tensor parallelism): eager and compiled, each step's
    collectives counted (``zoo.parallel.comm_count``). Every rank runs the same batch; rank 0 reports."""
    from zoo.parallel.comm_count import CommCounter
    from zoo.training.metrics import device_name, peak_tflops, training_flops_per_token

    cfg = zoo_config(style, args)
    b, s = batch_shape(args, cfg)
    g = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, cfg.vocab_size, (b, s + 1), generator=g).to(device)
    ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    trainees = [build_zoo(cfg, device, dtype, args.seed, args.lr)]
    if not args.no_compile:
        trainees.append(compiled(build_zoo(cfg, device, dtype, args.seed, args.lr, fused_cross_entropy=True)))
    run_interleaved(trainees, ids, labels, accel, args.warmup, args.steps)
    peak = peak_tflops(device_name(), args.dtype)
    rows = []
    for t in trainees:
        with CommCounter(grid) as comm:
            t.timed_step(ids, labels, accel, record=False)
            nbytes, calls = comm.take()
        median = statistics.median(t.step_times)
        tflops = training_flops_per_token(cfg, s) * b * s / median / grid.world_size / 1e12
        memory = None if args.no_memory else step_peak_memory_gb(t, ids, labels, accel)
        rows.append({"style": style, "impl": t.impl, "tp": grid.tp, "tokens_per_s": b * s / median,
                     "step_time_s": median, "tflops_per_device": tflops,
                     "mfu": None if peak is None else tflops / peak, "peak_memory_gb": memory,
                     "comm_bytes": nbytes, "comm_calls": calls})
        log(f"{style} tp={grid.tp} {t.impl}: {b * s / median:.0f} tok/s, {tflops:.3g} TFLOP/s per device"
            + ("" if peak is None else f", MFU {tflops / peak:.1%}")
            + ("" if memory is None else f", peak {memory:.2f} GB")
            + f", per step {', '.join(f'{k} {v / 2**20:.1f} MiB' for k, v in nbytes.items())}")
    return rows


GPU_SUITE = [  # (name, argument list): about 2-3 minutes each on one H200
    ("gpt2-124m", ["--preset", "gpt2-124m", "--dtype", "bf16"]),
    ("llama-1b", ["--preset", "llama-1b", "--dtype", "bf16", "--batch-size", "4", "--seq-length", "2048"]),
]


def gpu_suite(args, accel) -> int:
    """Every GPU benchmark in its own process (a fresh allocator and compile cache each), then one summary."""
    import subprocess

    if accel.device_name() == "cpu":
        print("error: --gpu-suite needs a GPU and deepspeed.accelerator finds only the CPU here; run it on a GPU "
              "machine (python launch/benchmark.py --gpu-suite)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    script = str(Path(__file__).resolve().parents[2] / "launch" / "benchmark.py")
    runs = [(name, [sys.executable, script, *extra, "--json", str(out / f"{name}.json")]) for name, extra in GPU_SUITE]
    if accel.device_count() >= 2:
        runs.append(("gpt2-124m-tp2", [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", script,
                                       "--preset", "gpt2-124m", "--dtype", "bf16", "--tp", "2", "--json",
                                       str(out / "gpt2-124m-tp2.json")]))
    else:
        print("note: one GPU here: the --tp 2 run needs two and is skipped", flush=True)
    failed = []
    for name, cmd in runs:
        print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
        start = time.perf_counter()
        if subprocess.run(cmd).returncode != 0:
            failed.append(name)
        print(f"== {name}: {time.perf_counter() - start:.0f} s", flush=True)
    print(f"reports in {out}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


# ---------------------------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------------------------


def format_table(results: list[Result]) -> str:
    header = ("style", "impl", "params", "tok/s", "step ms", "cpu ms", "TFLOP/s", "MFU", "peak GB", "loss first>last")
    rows = [header]
    for r in results:
        rows.append((r.style, r.impl, f"{r.params:,}", f"{r.tokens_per_s:,.0f}", f"{r.step_time_s * 1e3:.1f}",
                     f"{r.cpu_time_s * 1e3:.1f}",
                     f"{r.tflops:.3g}", "-" if r.mfu is None else f"{r.mfu:.1%}",
                     "-" if r.peak_memory_gb is None else f"{r.peak_memory_gb:.3f}",
                     f"{r.loss_first:.3f}>{r.loss_last:.3f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    left = {0, 1}
    lines = ["  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def summary_line(report: StyleReport) -> str:
    zoo, hf = (next(r for r in report.results if r.impl == impl) for impl in ("zoo", "transformers"))
    extra = "".join(f", {r.impl} {r.tokens_per_s:.0f} tok/s (ratio {zoo.tokens_per_s / r.tokens_per_s:.2f})"
                    for r in report.results if r.impl.startswith("transformers-") and not r.impl.endswith("-compiled"))
    line = (f"{report.style}: zoo {zoo.tokens_per_s:.0f} tok/s, transformers {hf.tokens_per_s:.0f} tok/s, "
            f"ratio {report.ratio:.2f}{extra}")
    zc, hc = report.tokens_per_s("zoo-compiled"), report.tokens_per_s("transformers-compiled")
    if zc is not None and hc is not None:
        line += (f"\n{report.style} compiled: zoo {zc:.0f} tok/s, transformers {hc:.0f} tok/s, ratio {zc / hc:.2f}; "
                 f"zoo compiled / transformers eager {zc / hf.tokens_per_s:.2f}, zoo compiled / eager "
                 f"{zc / zoo.tokens_per_s:.2f}")
    roof = report.roofline
    if roof is not None:
        passes = " and ".join(f"{t * 1e3:.1f}" for t in roof["gemm_seconds_before_after"])
        line += (f"\n{report.style} roofline ({roof['of']}): its {roof['gemm_shapes']} GEMM shapes (attention's "
                 f"products included) at this device's measured rates take {roof['gemm_seconds'] * 1e3:.1f} ms "
                 f"(each shape's faster time of two, before and after the steps: {passes} ms) of the step's "
                 f"{roof['gemm_seconds'] / roof['fraction_of_matmul'] * 1e3:.1f} ms: fraction_of_matmul "
                 f"{roof['fraction_of_matmul']:.2f}; the step runs {roof['step_flops_per_s'] / 1e9:.1f} GFLOP/s, a "
                 f"square GEMM {roof['square_gemm_flops_per_s'] / 1e9:.1f} GFLOP/s "
                 f"({roof['step_flops_per_s'] / roof['square_gemm_flops_per_s']:.0%})")
    return line


def run_tp(args, styles, accel, device, dtype, log) -> None:
    """``--tp N``: zoo alone on a grid of N tensor-parallel ranks; rank 0 prints (and with --json writes)."""
    from zoo.parallel.topology import initialize_model_parallel

    grid = initialize_model_parallel(args.tp, 1)
    say = log if grid.rank == 0 else (lambda line: None)
    say(f"device {accel.current_device_name()} x {grid.world_size}, tp={grid.tp}, {args.dtype}, "
        f"{args.warmup} warm-up + {args.steps} timed steps (median)")
    rows = [row for style in styles for row in benchmark_tp(style, args, accel, device, dtype, grid, say)]
    if grid.rank == 0 and args.json:
        text = json.dumps({"tp": grid.tp, "device": accel.current_device_name(), "dtype": args.dtype,
                           "results": rows})
        if args.json != "-":
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(text + "\n")
        log(text)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("steps", "warmup", "threads", "hidden_size", "layers", "heads", "kv_heads", "intermediate_size",
                 "seq_length", "batch_size", "vocab_size", "experts", "experts_per_token"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "warmup" else 1):
            print(f"error: --{name.replace('_', '-')} must be {'>= 0' if name == 'warmup' else 'positive'}, "
                  f"got {value}", file=sys.stderr)
            return 2

    from deepspeed.accelerator import get_accelerator
    import torch.distributed as dist

    from zoo.models.gpt import GPTConfig
    from zoo.parallel.topology import destroy_model_parallel, initialize_model_parallel

    if args.preset is not None:
        try:
            preset_style = style_of(GPTConfig.from_preset(args.preset))
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if args.style not in (None, preset_style):
            print(f"error: preset {args.preset!r} is {preset_style} style; drop --style or use --style "
                  f"{preset_style}", file=sys.stderr)
            return 2
        styles = [preset_style]
    else:
        styles = ["gpt2", "llama"] if args.style in (None, "both") else [args.style]

    accel = get_accelerator()
    if args.gpu_suite:
        return gpu_suite(args, accel)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.tp < 1 or args.tp != world:
        print(f"error: --tp {args.tp} runs under a launcher with that many processes (here {world}): torchrun "
              f"--nproc_per_node {max(args.tp, 1)} launch/benchmark.py ... --tp {max(args.tp, 1)}", file=sys.stderr)
        return 2
    device = torch.device(accel.current_device_name())
    dtype = DTYPES[args.dtype]
    if accel.device_name() == "cpu" and dtype != torch.float32:
        print(f"note: {args.dtype} on CPU is measured as asked, but CPU kernels are tuned for fp32", flush=True)

    threads_before = torch.get_num_threads()
    threads = args.threads or _cores()
    torch.set_num_threads(threads)
    started_dist = not (dist.is_available() and dist.is_initialized())
    log = lambda s: print(s, flush=True)  # noqa: E731
    reports: list[StyleReport] = []
    try:
        if args.tp > 1:
            run_tp(args, styles, accel, device, dtype, log)
            return 0
        initialize_model_parallel(1, 1)  # a world of one: zoo's layers take their single-rank path
        log(f"device {accel.current_device_name()} ({threads} CPU threads), {args.dtype}, AdamW lr {args.lr}, "
            f"{args.warmup} warm-up + {args.steps} timed steps per model (median), steps of the two models "
            f"interleaved")
        for style in styles:
            reports.append(benchmark_style(style, args, accel, device, dtype, log))
            gc.collect()
            if accel.device_name() != "cpu":
                accel.empty_cache()
    except (ValueError, FloatingPointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        torch.set_num_threads(threads_before)
        if started_dist:
            destroy_model_parallel()

    results = [r for rep in reports for r in rep.results]
    log("")
    log(format_table(results))
    log("")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if accel.device_name() == "cpu" and load > _cores():
        log(f"note: load average {load:.1f} on {_cores()} cores: other processes share the CPU, so step times include "
            "waiting for it; 'cpu ms' (this process's CPU time per step) compares the work done more steadily")
    for rep in reports:
        log(summary_line(rep))
    if args.json and args.json != "-":
        out = {
            "device": accel.current_device_name(),
            "dtype": args.dtype,
            "threads": threads,
            "warmup": args.warmup,
            "steps": args.steps,
            "load_average": load,
            "styles": [{"style": rep.style, "config": rep.config, "zoo_params": rep.zoo_params,
                        "zoo_params_allocated": rep.zoo_params_allocated, "transformers_params": rep.hf_params,
                        "ratio": rep.ratio, "roofline": rep.roofline,
                        "results": [asdict(r) for r in rep.results]} for rep in reports],
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        log(f"results written to {args.json}")
    if args.json:
        log(json.dumps({rep.style: rep.summary() for rep in reports}))
    return 0

"""Memory and step time of one layout of one job (the formulas of ``zoo.plan``'s docstring, in code).

Everything here is arithmetic on the model config: no torch tensors, no process group, so thousands of layouts
are priced in a second.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from zoo.plan.hardware import GPU, GiB
from zoo.training.config import reduce_bucket_elements

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
OPTIMIZER_STATE_BYTES = {"adamw": 8, "adam": 8, "sgd": 4}  # fp32 moments per parameter (SGD: momentum)
RECOMPUTE = ("none", "selective", "full")
ATTENTION = ("flash", "unfused")
ZERO3_PERSISTENCE = 100_000  # elements: DeepSpeed's stage3_param_persistence_threshold (smaller tensors stay whole)


@dataclass(frozen=True)
class Job:
    config: object  # GPTConfig
    gpus: int
    seq_length: int
    global_batch: int
    dtype: str = "bf16"
    optimizer: str = "adamw"
    attention: str = "flash"  # "flash": zoo's SDPA, no s x s matrix; "unfused": scores stored (Megatron 2021)
    fused_cross_entropy: bool = False  # training.fused_cross_entropy (every layout)
    # training.ema_decay > 0: an fp32 average of what the rank holds of the weights (zoo.training.ema)
    ema: bool = False
    # finetune.lora (a zoo.models.lora.LoraConfig): the base frozen (parameters only), the adapters train
    lora: object = None


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    cp: int = 1  # context parallel (Ulysses): each sequence split over cp ranks
    zero: int = 1
    micro_batch: int = 1
    sp: bool = False
    recompute: str = "none"
    fused_ce: bool = False  # the LM head and the loss fused (zoo.parallel.cross_entropy.linear_cross_entropy_sum)
    ep_spans_tp: bool = False  # the EP groups take in the TP ranks (parallel.ep_spans_tp): ep = tp x (DP places)

    def describe(self) -> str:
        ep = f" ep={self.ep}" + (" ep_spans_tp=true" if self.ep_spans_tp else "") if self.ep > 1 else ""
        ep += f" cp={self.cp}" if self.cp > 1 else ""
        fused = " fused_ce=true" if self.fused_ce else ""
        return (f"tp={self.tp} pp={self.pp} dp={self.dp}{ep} zero={self.zero} micro_batch={self.micro_batch} "
                f"sp={str(self.sp).lower()} recompute={self.recompute}{fused}")


@dataclass
class Estimate:
    layout: Layout
    params: int  # total parameters of the model (unpadded, as a HF checkpoint counts them)
    memory: dict  # bytes per GPU of the fullest rank: params, grads, optimizer, activations, buffers, reserved
    fits: bool
    time: dict  # seconds per step: compute, communication (exposed), bubble
    step_time_s: float
    tokens_per_s: float
    tflops_per_gpu: float
    mfu: float
    why_not: str = ""
    stage_memory: list = field(default_factory=list)  # bytes per stage (params + grads + optimizer + activations)

    @property
    def memory_per_gpu_gb(self) -> float:
        return sum(self.memory.values()) / GiB

    def row(self) -> dict:
        lay = self.layout
        return {"tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "ep": lay.ep, "cp": lay.cp, "zero": lay.zero,
                "micro_batch": lay.micro_batch, "recompute": lay.recompute, "sp": lay.sp, "fused_ce": lay.fused_ce,
                "params": self.params,
                "memory_per_gpu_gb": round(self.memory_per_gpu_gb, 3),
                "memory_gb": {k: round(v / GiB, 3) for k, v in self.memory.items()}, "fits": self.fits,
                "step_time_s": self.step_time_s, "time_s": self.time, "tokens_per_s": self.tokens_per_s,
                "tflops_per_gpu": self.tflops_per_gpu, "mfu": self.mfu, **({"why_not": self.why_not}
                                                                            if self.why_not else {})}


# ---------------------------------------------------------------------------------------------------------------
# Parameters per rank, per layer spec (as DeepSpeed's PipelineModule counts them to balance the stages)
# ---------------------------------------------------------------------------------------------------------------


def _norm_tensors(c) -> list[int]:
    return [c.hidden_size] * (2 if c.normalization == "layernorm" else 1)


def block_norms(c) -> int:
    """Norms per block: before attention and MLP; ``norm_placement="sandwich"`` (Gemma 2) also after each."""
    return 4 if c.norm_placement == "sandwich" else 2


def attended_keys(c, i: int, seq: int) -> float:
    """The keys a query of block i attends to, on average over a causal sequence of ``seq``: s / 2 (the causal
    half a flash kernel computes, as the planner has always priced it), or with a window W < s exactly
    W - W (W - 1) / (2 s) (query j sees min(j + 1, W)): a windowed layer's attention grows with s x W, not s^2."""
    w = c.attention_window(i)
    return seq / 2 if w is None or w >= seq else w - w * (w - 1) / (2 * seq)


def layer_shapes(c, i: int):
    """``(config, kv_parts)``: block i's attention shapes as a uniform config (Gemma 4's full-attention layers have
    their own head dim and kv heads) and its k/v rows per kv head (1 where k = v)."""
    kv_parts = 1 if getattr(c, "layer_k_eq_v", lambda i: False)(i) else 2
    if not hasattr(c, "layer_head_dim") or (c.layer_head_dim(i), c.layer_kv_heads(i)) == (c.head_dim,
                                                                                          c.num_key_value_heads):
        return c, kv_parts
    return replace(c, head_dim=c.layer_head_dim(i), num_key_value_heads=c.layer_kv_heads(i), global_head_dim=None,
                   num_global_key_value_heads=None, attention_k_eq_v=False), kv_parts


def block_tensors(c, i: int, tp: int, ep: int = 1) -> tuple[list[int], list[int]]:
    """``(dense, expert)`` parameter tensors (element counts) of block i on one rank: TP splits the QKV / MLP
    columns and the output projections' rows; norms, output biases and the router are replicated; experts are
    whole, E/ep per rank."""
    c, kv = layer_shapes(c, i)
    h, d, nq, nkv = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads
    if tp > nkv:  # the query rows of tp / nkv ranks, each with its group's k/v rows (replicated): two tensors each
        dense = [nq * d * h // tp, kv * d * h] + [nq * d // tp, kv * d] * c.use_qkv_bias
    else:
        qkv = (nq + kv * nkv) * d
        dense = [qkv * h // tp] + [qkv // tp] * c.use_qkv_bias
    dense += [nq * d * h // tp] + [h] * c.add_bias
    dense += {None: [], "head": [d, d], "full": [nq * d // tp, nkv * d // tp]}[c.qk_norm]
    dense += block_norms(c) * _norm_tensors(c)
    swiglu = c.gated_mlp
    expert = []
    if c.is_moe_layer(i):
        fe, fs, E = c.expert_intermediate_size, c.shared_intermediate_size, c.num_experts
        dense.append(E * h)
        if fs:
            dense += [(2 if swiglu else 1) * fs * h, h * fs] + [h] * c.shared_expert_gate
        expert = [E // ep * (2 if swiglu else 1) * fe * h, E // ep * h * fe]
    else:
        f = c.intermediate_size
        fc1_out = 2 * f if swiglu else f
        dense += [fc1_out * h // tp] + [fc1_out // tp] * c.use_mlp_bias + [h * f // tp] + [h] * c.use_mlp_bias
    return dense, expert


def block_params(c, i: int, tp: int, ep: int = 1) -> tuple[int, int]:
    """``(dense, expert)`` parameters of block i on one rank."""
    dense, expert = block_tensors(c, i, tp, ep)
    return sum(dense), sum(expert)


def embedding_tensors(c, tp: int) -> list[int]:
    learned = [c.max_position_embeddings * c.hidden_size] if c.position_embedding_type == "learned" else []
    return [c.padded_vocab_size(tp) // tp * c.hidden_size] + learned


def spec_tensors(c, tp: int, ep: int = 1) -> list[tuple[list[int], list[int]]]:
    """``(dense, expert)`` tensors per layer spec of ``zoo.models.gpt.layer_specs``: embedding, blocks, final
    norm, head. A tied head is DeepSpeed's TiedLayerSpec: the last stage builds its own copy of the embedding."""
    head = embedding_tensors(c, tp) if c.tie_word_embeddings else [c.padded_vocab_size(tp) // tp * c.hidden_size]
    return ([(embedding_tensors(c, tp), [])] + [block_tensors(c, i, tp, ep) for i in range(c.num_hidden_layers)]
            + [(_norm_tensors(c), []), (head, [])])


def spec_params(c, tp: int, ep: int = 1) -> list[tuple[int, int]]:
    """``(dense, expert)`` parameters per layer spec (what DeepSpeed's ``partition_method: parameters`` weighs)."""
    return [(sum(d), sum(e)) for d, e in spec_tensors(c, tp, ep)]


def partition_balanced(weights: list[int], parts: int) -> list[int]:
    """DeepSpeed's ``partition_balanced`` (deepspeed.runtime.utils: the linear-partition dynamic programme that
    minimises max - min stage weight, later split points winning ties), vectorised over the split point so a
    1000-GPU search stays fast. Returns the ``parts + 1`` boundaries. Equal to DeepSpeed's (tests/plan)."""
    import numpy as np

    n = len(weights)
    if n <= parts:
        return [min(p, n) for p in range(parts + 1)]
    prefix = np.zeros(n + 1)
    prefix[1:] = np.cumsum(weights)
    dp_max = np.full((n + 1, parts + 1), np.inf)
    dp_min = np.full((n + 1, parts + 1), np.inf)
    position = np.zeros((n + 1, parts + 1), dtype=int)
    dp_max[0, 0] = 0
    for i in range(1, n + 1):
        seg = prefix[i] - prefix[:i]  # weight of items k..i-1 for every split point k < i
        for j in range(1, min(i, parts) + 1):
            mx = np.maximum(dp_max[:i, j - 1], seg)
            mn = np.minimum(dp_min[:i, j - 1], seg)
            cost = mx - mn
            k = i - 1 - int(np.argmin(cost[::-1]))  # the last k of minimal cost (DeepSpeed updates on >=)
            dp_max[i, j], dp_min[i, j], position[i, j] = mx[k], mn[k], k
    bounds = [n]
    for j in range(parts, 0, -1):
        bounds.append(int(position[bounds[-1], j]))
    return bounds[::-1]


@dataclass(frozen=True)
class Stage:
    index: int
    first: bool
    last: bool
    blocks: tuple[int, ...]  # block indices on this stage
    dense: int  # parameters on one rank of this stage
    expert: int
    persistent: int = 0  # of them, in tensors small enough for ZeRO-3 to keep whole (DeepSpeed's default)


def stages(c, tp: int, pp: int, ep: int = 1, cache: dict | None = None) -> list[Stage]:
    """What each pipeline stage holds: DeepSpeed's ``partition_method: parameters`` over the layer specs."""
    key = (tp, pp, ep)
    if cache is not None and key in cache:
        return cache[key]
    tensors = spec_tensors(c, tp, ep)
    counts = [(sum(d), sum(e)) for d, e in tensors]
    bounds = partition_balanced([d + e for d, e in counts], pp) if pp > 1 else [0, len(counts)]
    out = []
    for s in range(pp):
        lo, hi = bounds[s], bounds[s + 1]
        blocks = tuple(i - 1 for i in range(lo, hi) if 1 <= i <= c.num_hidden_layers)
        tied_twice = pp == 1 and c.tie_word_embeddings  # one module holds the shared weight once
        idx = [i for i in range(lo, hi) if not (tied_twice and i == len(counts) - 1)]
        small = sum(n for i in idx for n in tensors[i][0] + tensors[i][1] if n <= ZERO3_PERSISTENCE)
        out.append(Stage(index=s, first=lo == 0, last=hi == len(counts), blocks=blocks,
                         dense=sum(counts[i][0] for i in idx), expert=sum(counts[i][1] for i in idx),
                         persistent=small))
    if cache is not None:
        cache[key] = out
    return out


# ---------------------------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------------------------


def state_bytes(n: int, parts: int, zero: int, dtype: str, optimizer: str, micro_batches: int = 1,
                persistent: int = 0, pipeline: bool = False) -> tuple[float, float, float]:
    """``(params, grads, optimizer)`` bytes of n parameters on one rank, ZeRO partitioning over ``parts`` ranks,
    as DeepSpeed holds them (measured by ``zoo.training.memory``; its reduction buckets are buffers, not here).

    fp32: DeepSpeed's ZeRO-1/2/3 optimizers keep an fp32 master copy of the rank's partition even then (counted
    as optimizer state, with the moments: 12 bytes per partitioned parameter with Adam); ZeRO-0 steps the
    parameters themselves (8). Gradients: full at ZeRO 0/1; ZeRO-2 holds the partition's accumulated gradients and,
    from the second micro-batch on, the new ones beside them; ZeRO-3 its gradient partition and the fp32 copy the
    optimizer steps on. ZeRO-3 keeps tensors of <= 1e5 elements whole on every rank (``persistent``).
    bf16/fp16: 2-byte parameters and gradients and an fp32 copy of the gradient partition for the step; without
    ZeRO and pipeline DeepSpeed's FP16_UnfusedOptimizer keeps unpartitioned fp32 masters and moments (12 bytes)
    and fp32 gradients (4 + 2); with a pipeline its BF16_Optimizer partitions them over dp.
    """
    p = DTYPE_BYTES[dtype]
    master = 4 + OPTIMIZER_STATE_BYTES[optimizer]
    accumulating = 2 if micro_batches > 1 else 1
    if dtype == "fp32":
        if zero == 0:
            return 4 * n, 4 * n, (master - 4) * n
        if zero == 3:
            return 4 * n / parts + 4 * persistent, 8 * n / parts, master * n / parts
        return 4 * n, 4 * n if zero == 1 else 4 * n / parts * accumulating, master * n / parts
    if zero == 0:
        if not pipeline:
            return p * n, (p + 4) * n, master * n
        return p * n, 2 * p * n + 4 * n / parts, master * n / parts
    if zero == 3:
        return p * n / parts + p * persistent, (p + 4) * n / parts, master * n / parts
    grads = p * n if zero == 1 else p * n / parts * accumulating
    return p * n, grads + 4 * n / parts, master * n / parts


def _dims(c, tp: int, sp: bool):
    h, d = c.hidden_size, c.head_dim
    nq, nkv = c.num_attention_heads // tp, max(c.num_key_value_heads // tp, 1)  # tp > nkv: one replicated kv head
    g = 1 / tp if sp else 1.0  # share of the norm / residual region a rank holds (sequence parallelism)
    return h, d, nq, nkv, g


def block_activation_bytes(c, i: int, tp: int, sp: bool, dtype: str, tokens: int, seq: int = 0,
                           unfused: bool = False, selective: bool = False) -> float:
    """Bytes block i saves for backward for ``tokens`` = b x s tokens of one micro-batch (no recompute), derived
    from zoo's blocks (zoo/models/gpt.py) in the style of Korthikanti et al. (arXiv 2205.05198, Sec. 4.1):

      norms (x2)    LayerNorm: its input (a) + mean, rstd (fp32); RMSNorm (fp32 statistics, as HF): the fp32 input
                    (4; the input itself in fp32 runs), the normalised fp32 -> input dtype (a) and the weighted
                    output (a), + rstd; x g = 1/tp under sequence parallelism; x4 with sandwich norms
      QKV / fc1     their input (a, gathered over TP under SP: full s), + the QKV output (a (nq + 2 nkv) d / tp:
                    q, k, v are views of it)
      RoPE          the rotated q and k (a (nq + nkv) d / tp)
      attention     SDPA's output (a nq d / tp; the output projection's input is a view) and logsumexp (fp32
                    per head and token); no s x s matrix (flash / memory-efficient kernels). ``unfused``
                    (attention as Megatron ran it in 2021, Korthikanti's 5 a s^2 b): per score the softmax output,
                    the dropout mask and the dropped probabilities, (2a + 1) bytes, unless ``selective``
                    recomputation drops them
      dropout       a 1-byte mask per element after attention and after the MLP (hidden_dropout > 0)
      MLP           GELU: its input and output (2 a f / tp); SwiGLU: the fused gate|up output, silu(gate) and
                    the product (4 a f / tp); MoE: router logits/scores in fp32, the routed tokens' expert
                    inputs and intermediates (k copies per token)
    a = the activation dtype's bytes.
    """
    a = DTYPE_BYTES[dtype]
    shapes, kv = layer_shapes(c, i)
    h, d, nq, nkv, g = _dims(shapes, tp, sp)
    if c.normalization == "layernorm":
        norm = (a * h + 2 * 4) * g
    else:
        norm = ((4 if a == 4 else 4 + a) * h + a * h + 4) * g
    attn = a * h * (1 if sp else g)  # QKV input (gathered under SP)
    attn += a * (nq + kv * nkv) * d
    if c.position_embedding_type == "rope":
        attn += a * (nq + nkv) * d
    if c.qk_norm is not None:
        attn += (4 + 2 * a) * (nq + nkv) * d  # fp32 q/k + normalised + weighted, as the RMSNorm above
    attn += a * nq * d + 4 * nq
    if unfused and not selective:  # softmax output, dropout mask and dropped probabilities: (2a + 1) per score
        attn += nq * seq * (2 * a + (1 if c.attention_dropout > 0 else 0))
    if c.hidden_dropout > 0:  # the two dropout masks (1 byte per element)
        attn += 2 * h * g
    if c.is_moe_layer(i):  # tokens split over TP (by SP or by the layer itself): per token of the micro-batch / tp
        k, fe, fs, E = c.num_experts_per_tok, c.expert_intermediate_size, c.shared_intermediate_size, c.num_experts
        inner = 4 if c.gated_mlp else 2
        mlp = (4 * h + 3 * 4 * E + k * (a * h + inner * a * fe + 8) + (a * h + inner * a * fs if fs else 0)) / tp
    else:
        f = c.intermediate_size // tp
        mlp = a * h * (1 if sp else g) + (4 if c.gated_mlp else 2) * a * f
    return tokens * (block_norms(c) * norm + attn + mlp)


def head_activation_bytes(c, tp: int, sp: bool, dtype: str, tokens: int, fused: bool = False) -> float:
    """The last stage's final norm, LM-head input and the vocab-parallel cross entropy's fp32 softmax
    (``zoo.parallel.cross_entropy`` saves it, [b, s, V/tp]). Fused (``linear_cross_entropy_sum``), the loss
    keeps the gradients it computed in the forward instead: the head input's ([b, s, h], the input's dtype) and
    the head weight's ([V/tp, h] in fp32), and no [b, s, V/tp] tensor."""
    a = DTYPE_BYTES[dtype]
    h, _, _, _, g = _dims(c, tp, sp)
    if c.normalization == "layernorm":
        norm = (a * h + 8) * g
    else:
        norm = ((4 if a == 4 else 4 + a) * h + a * h + 4) * g
    vocab = c.padded_vocab_size(tp) // tp
    if fused:
        return tokens * (norm + a * h + 24) + 4 * vocab * h
    return tokens * (norm + a * h + 4 * vocab + 24)


def fused_chunk_tokens(c, tp: int, gpu: GPU) -> int:
    """Tokens per chunk of the fused loss (``zoo.parallel.cross_entropy``: a fixed number of logits per chunk,
    fewer on a CPU)."""
    from zoo.parallel.cross_entropy import ACCELERATOR_CHUNK_ELEMENTS, CPU_CHUNK_ELEMENTS

    elements = CPU_CHUNK_ELEMENTS if gpu.name == "cpu" else ACCELERATOR_CHUNK_ELEMENTS
    return max(1, elements // (c.padded_vocab_size(tp) // tp))


def activation_bytes(c, stage: Stage, lay: Layout, dtype: str, seq: int, micro_batches: int,
                     unfused: bool = False, checkpoint_state_bytes: int = 5088) -> float:
    """Peak bytes kept for backward on one rank of a stage. 1F1B keeps min(p - k, m) micro-batches in flight on
    stage k (the first stage the most), each with what its blocks save, the token ids the embedding saves (first
    stage) and, at pp > 1, the stage's output in DeepSpeed's pipe buffers (the last stage also still holds the
    previous micro-batch's logits and labels there). With full recomputation a block keeps only its input and
    DeepSpeed's generator states (``checkpoint_state_bytes``), and one block's activations exist again while it
    is recomputed in backward."""
    tokens = lay.micro_batch * seq
    a = DTYPE_BYTES[dtype]
    kinds = {}  # blocks differ only by dense / MoE
    for i in stage.blocks:
        if c.is_moe_layer(i) not in kinds:
            kinds[c.is_moe_layer(i)] = block_activation_bytes(c, i, lay.tp, lay.sp, dtype, tokens, seq, unfused,
                                                              lay.recompute == "selective")
    per = [kinds[c.is_moe_layer(i)] for i in stage.blocks]
    hidden = tokens * a * c.hidden_size / (lay.tp if lay.sp else 1)  # a block's input
    head = head_activation_bytes(c, lay.tp, lay.sp, dtype, tokens, lay.fused_ce) if stage.last else 0.0
    fixed = 8 * tokens if stage.first else 0.0
    once = 0.0
    if lay.pp > 1:
        if stage.last:  # this micro-batch's logits (fused: the head's input) and labels, and still the previous one's
            width = c.hidden_size if lay.fused_ce else c.padded_vocab_size(lay.tp) // lay.tp
            fixed += tokens * (width * a + 8)
            once += tokens * (width * a + 8)
        else:
            fixed += hidden
    in_flight = min(lay.pp - stage.index, micro_batches)
    if lay.recompute == "full":  # the peak: the last block's recomputation, or the head at the end of forward
        kept = len(stage.blocks) * (hidden + checkpoint_state_bytes)
        working = max(max(per, default=hidden) - hidden, head)
        return (kept + fixed) * in_flight + working + once
    return (sum(per) + head + fixed) * in_flight + once


# ---------------------------------------------------------------------------------------------------------------
# Time
# ---------------------------------------------------------------------------------------------------------------


def _collective_time(nbytes: float, ranks: int, kind: str, gpu: GPU, inter: bool) -> float:
    """Ring algorithms: all-reduce moves 2 (n-1)/n of the buffer through each rank's link, all-gather and
    reduce-scatter (n-1)/n, all-to-all (n-1)/n, point-to-point the buffer."""
    if ranks <= 1 and kind != "p2p":
        return 0.0
    share = {"all_reduce": 2 * (ranks - 1) / ranks, "all_gather": (ranks - 1) / ranks,
             "reduce_scatter": (ranks - 1) / ranks, "all_to_all": (ranks - 1) / ranks, "p2p": 1.0}[kind]
    bw = (gpu.inter_node_gbps if inter else gpu.intra_node_gbps) * 1e9 * gpu.bandwidth_efficiency
    latency = (gpu.inter_latency_us if inter else gpu.intra_latency_us) * 1e-6
    return share * nbytes / bw + latency


def block_flops(c, i: int, seq: int) -> tuple[float, float]:
    """Forward ``(GEMM, attention core)`` FLOPs per token of block i, as ``zoo.training.metrics`` counts them
    (causal attention counted in full: s keys per query, min(s, W) with a window); the attention kernel executes
    ``attended_keys`` per query of them."""
    c, kv = layer_shapes(c, i)
    h, d, nq, nkv = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads
    k = 3 if c.gated_mlp else 2
    gemm = 2 * h * (nq + kv * nkv) * d + 2 * nq * d * h
    if c.is_moe_layer(i):
        gemm += 2 * h * c.num_experts + 2 * h * k * (c.num_experts_per_tok * c.expert_intermediate_size
                                                     + c.shared_intermediate_size) + 2 * h * c.shared_expert_gate
    else:
        gemm += 2 * h * c.intermediate_size * k
    return gemm, 4 * min(seq, c.attention_window(i) or seq) * nq * d


def score_traffic(a: int, dropout: bool) -> float:
    """HBM bytes per attention score of one forward + backward when the s x s matrix is materialised: written by
    QK^T, softmax read + write, dropout read + write + mask, read by PV; backward the mirror image plus the saved
    softmax read. Spread over 3 passes (forward + backward) as the caller counts passes."""
    forward = a + 2 * a + (2 * a + 1 if dropout else 0) + a
    backward = a + (2 * a + 1 if dropout else 0) + 3 * a + a
    return forward + backward


def elementwise_bytes(c, i: int, tp: int, sp: bool, dtype: str) -> float:
    """HBM traffic per token of block i's forward outside GEMMs and attention: the norms (read + write; four with
    sandwich norms), the two residual adds (2 reads + 1 write), the activation function, RoPE of q and k."""
    a = DTYPE_BYTES[dtype]
    h, d, nq, nkv, g = _dims(layer_shapes(c, i)[0], tp, sp)
    f = (c.num_experts_per_tok * c.expert_intermediate_size + c.shared_intermediate_size) / tp \
        if c.is_moe_layer(i) else c.intermediate_size / tp
    act = 3 * f if c.gated_mlp else 2 * f
    rope = 2 * (nq + nkv) * d if c.position_embedding_type == "rope" else 0
    return a * ((block_norms(c) * 2 + 2 * 3) * h * g + act + rope)


def _inter(group_span: int, gpu: GPU) -> bool:
    """Whether a group whose ranks lie within ``group_span`` consecutive ranks crosses a node boundary."""
    return group_span > gpu.gpus_per_node


def _block_cost(c, i: int, lay: Layout, job: Job, gpu: GPU) -> tuple:
    """One micro-batch's forward through block i on one rank: (GEMM FLOPs, attention FLOPs, attention FLOPs done
    once more by selective recomputation, elementwise HBM bytes per pass, extra bytes of that recomputation,
    TP communication seconds of all passes, EP communication seconds of all passes)."""
    s, a, rc = job.seq_length, DTYPE_BYTES[job.dtype], 1 if lay.recompute == "full" else 0
    c = layer_shapes(c, i)[0]  # block i's head dim and kv heads (block_flops and the others read them per layer too)
    tokens = lay.micro_batch * s // lay.cp  # this rank's share of the micro-batch (context parallelism)
    g, at = block_flops(c, i, s)  # as the metrics count them
    gemm, attn_extra, extra_bytes = g * tokens / lay.tp, 0.0, 0.0
    elem = elementwise_bytes(c, i, lay.tp, lay.sp, job.dtype) * tokens
    if job.attention == "unfused":  # the whole s x s square is computed and streamed through HBM (window or not)
        at = 4 * s * c.num_attention_heads * c.head_dim
        attn = at * tokens / lay.tp
        scores = lay.micro_batch * c.num_attention_heads // lay.tp * s * s // lay.cp
        elem += scores * score_traffic(a, c.attention_dropout > 0) / 3  # per pass, as elem counts
        if lay.recompute == "selective":  # the attention core once more in backward
            attn_extra = at * tokens / lay.tp
            extra_bytes = scores * score_traffic(a, c.attention_dropout > 0) / 3
    else:  # causal: the kernel skips the masked half; a window, all but the W keys before each query
        attn = at * tokens / lay.tp * attended_keys(c, i, s) / min(s, c.attention_window(i) or s)
    tp_inter = _inter(lay.tp, gpu)
    tp_comm = 0.0
    for kind in (("all_gather", "reduce_scatter") if lay.sp else ("all_reduce", "all_reduce")):
        tp_comm += (2 + rc) * _collective_time(tokens * c.hidden_size * a, lay.tp, kind, gpu, tp_inter)
    if lay.cp > 1:  # Ulysses: q, k, v to heads-sharded whole sequences and the output back, each pass
        size = tokens * (2 * c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim // lay.tp * a
        if lay.tp > c.num_key_value_heads:  # one replicated kv head per rank
            size = tokens * (2 * c.num_attention_heads // lay.tp + 2) * c.head_dim * a
        tp_comm += (2 + rc) * _collective_time(size, lay.cp, "all_to_all", gpu, _inter(lay.tp * lay.cp, gpu))
    ep_comm = 0.0
    if lay.ep > 1 and c.is_moe_layer(i):  # dispatch + combine all-to-alls
        size = tokens / lay.tp * c.num_experts_per_tok * c.hidden_size * a
        # EP ranks: tp x cp apart, or whole TP groups whose places are tp x cp apart when the groups span TP
        span = lay.cp * lay.ep if lay.ep_spans_tp else lay.tp * lay.cp * lay.ep
        ep_comm = 2 * (2 + rc) * _collective_time(size, lay.ep, "all_to_all", gpu, _inter(span, gpu))
    return gemm, attn, attn_extra, elem, extra_bytes, tp_comm, ep_comm


def estimate(job: Job, lay: Layout, gpu: GPU, cache: dict | None = None) -> Estimate:
    """Memory of the fullest rank and the step time of ``lay``; ``fits`` says whether it fits ``gpu``.

    Per pipeline stage: its memory (``_stage_memory``) and one micro-batch's compute and exposed communication
    (``_stage_time``); the slowest stage paces the 1F1B schedule, whose bubble is ``pp - 1`` of its micro-batches;
    then the data-parallel collectives (``_data_parallel_time``) and the optimizer step."""
    from zoo.training.metrics import training_flops_per_token

    c, s, z = job.config, job.seq_length, _Sizes.of(job, lay, gpu)
    st = stages(c, lay.tp, lay.pp, lay.ep, cache)
    memory, stage_memory = None, []
    for stage in st:
        mem = _stage_memory(job, lay, gpu, z, stage)
        stage_memory.append(mem["params"] + mem["grads"] + mem["optimizer"] + mem["activations"])
        if memory is None or sum(mem.values()) > sum(memory.values()):
            memory = mem
    block_costs: dict = {}
    slowest = max((_stage_time(job, lay, gpu, z, stage, block_costs) for stage in st), key=sum)
    per_micro = sum(slowest)
    pipeline = (z.m + lay.pp - 1) * per_micro
    bubble = (lay.pp - 1) * per_micro

    dp_time = _data_parallel_time(max(st, key=lambda x: x.dense + x.expert), lay, gpu, z)
    # ZeRO-3 prefetches parameters and reduces gradients while the step computes (DeepSpeed's overlap_comm); the
    # other stages reduce outside the backward (zoo leaves overlap_comm off; the pipeline engine after its flush)
    dp_exposed = max(0.0, dp_time - pipeline) if lay.zero == 3 else dp_time
    # the optimizer step streams master weights, moments, gradients and parameters once (memory bound)
    opt_bytes = memory["optimizer"] * 2 + memory["grads"] + memory["params"]
    optimizer_time = opt_bytes / z.hbm

    step = pipeline + dp_exposed + optimizer_time
    flops_eq3 = job.global_batch * s * training_flops_per_token(c, s, recompute=lay.recompute == "full")
    flops_model = job.global_batch * s * training_flops_per_token(c, s, recompute=False)
    gpus = lay.tp * lay.pp * lay.dp * lay.cp
    time = {"compute": z.m * slowest[0] + optimizer_time, "communication": z.m * slowest[1] + dp_exposed,
            "bubble": bubble}
    total = sum(memory.values())
    capacity = gpu.memory_gb * GiB
    return Estimate(layout=lay, params=c.num_parameters(), memory=memory, fits=total <= capacity, time=time,
                    step_time_s=step, tokens_per_s=job.global_batch * s / step,
                    tflops_per_gpu=flops_eq3 / gpus / step / 1e12,
                    mfu=flops_model / gpus / step / (gpu.peak_tflops * 1e12),
                    why_not="" if total <= capacity else _short(memory, capacity),
                    stage_memory=stage_memory)


@dataclass(frozen=True)
class _Sizes:
    """What every term of one layout's estimate reads: the job as the layout divides it, and the GPU's rates."""
    a: int  # bytes per element of the training dtype
    parts: int  # DeepSpeed's dp group: dp x cp
    expert_parts: int  # the experts' data-parallel (EDP) group: the ranks that hold the same experts
    m: int  # micro-batches per step
    tokens: int  # this rank's tokens of one micro-batch (context parallelism splits the sequence)
    rc: int  # 1 when full recomputation runs every forward again
    peak: float  # FLOP/s of the training dtype
    hbm: float  # sustained HBM bytes/s

    @classmethod
    def of(cls, job: Job, lay: Layout, gpu: GPU) -> _Sizes:
        a = DTYPE_BYTES[job.dtype]
        return cls(a=a, parts=lay.dp * lay.cp,
                   expert_parts=max(1, lay.dp * lay.cp * (lay.tp if lay.ep_spans_tp else 1) // lay.ep),
                   m=job.global_batch // (lay.micro_batch * lay.dp), tokens=lay.micro_batch * job.seq_length // lay.cp,
                   rc=1 if lay.recompute == "full" else 0, peak=(gpu.peak_tflops if a == 2 else gpu.fp32_peak) * 1e12,
                   hbm=gpu.hbm_gbps * 1e9 * gpu.bandwidth_efficiency)


def _stage_memory(job: Job, lay: Layout, gpu: GPU, z: _Sizes, stage: Stage) -> dict:
    """Bytes per GPU of a rank of this stage: params, grads, optimizer, activations, buffers, reserved."""
    c, pipe = job.config, lay.pp > 1
    dense = state_bytes(stage.dense, z.parts, lay.zero, job.dtype, job.optimizer, z.m, stage.persistent, pipe)
    expert = state_bytes(stage.expert, z.expert_parts, lay.zero, job.dtype, job.optimizer, z.m, 0, pipe)
    if job.lora is not None:  # a frozen base holds its parameters alone; the adapters' state is priced as any
        ad, ae = _adapter_tensors(job, lay, stage)
        small = sum(n for n in ad if n <= ZERO3_PERSISTENCE)
        a = state_bytes(sum(ad), z.parts, lay.zero, job.dtype, job.optimizer, z.m, small, pipe)
        e = state_bytes(sum(ae), z.expert_parts, lay.zero, job.dtype, job.optimizer, z.m, 0, pipe)
        dense = (dense[0] + a[0], a[1], a[2])
        expert = (expert[0] + e[0], e[1], e[2])
    act = activation_bytes(c, stage, lay, job.dtype, job.seq_length // lay.cp, z.m, job.attention == "unfused",
                           gpu.checkpoint_state_bytes)
    # the weight average: fp32, what the rank holds of every tensor (zoo.training.ema; ZeRO-3: its partition of
    # each, persistent ones too); with the optimizer state, which it sits beside and is streamed with every step
    ema = 4 * (stage.dense / (z.parts if lay.zero == 3 else 1) + stage.expert) if job.ema else 0
    return {"params": dense[0] + expert[0], "grads": dense[1] + expert[1], "optimizer": dense[2] + expert[2] + ema,
            "activations": act, "buffers": _buffer_bytes(job, lay, gpu, z, stage), "reserved": gpu.reserved_gb * GiB}


def _adapter_tensors(job: Job, lay: Layout, stage: Stage) -> tuple[list, list]:
    """The adapter tensors (element counts, dense and expert) one rank of ``stage`` holds."""
    from zoo.models.lora import adapter_tensors

    return adapter_tensors(job.lora, job.config, stage.blocks, stage.last and not job.config.tie_word_embeddings,
                           lay.tp, lay.ep)


def _buffer_bytes(job: Job, lay: Layout, gpu: GPU, z: _Sizes, stage: Stage) -> float:
    """The stage's buffers beside its state and activations: ZeRO's, the pipeline's and the loss's."""
    c, buffers = job.config, 0.0
    if lay.zero >= 1:  # ZeRO's reduction bucket (two with a pipeline), in the gradients' dtype, as zoo sizes it
        held = 2 if lay.pp > 1 and lay.zero < 3 else 1
        trained = stage.dense + stage.expert if job.lora is None else sum(map(sum, _adapter_tensors(job, lay, stage)))
        buffers += reduce_bucket_elements(trained) * z.a * held
    if lay.zero == 3:  # a gathered block and the prefetched next one
        one_of_each = {c.is_moe_layer(i): i for i in stage.blocks}.values()
        buffers += 2 * max((sum(block_params(c, i, lay.tp, lay.ep)) for i in one_of_each), default=0) * z.a
    if lay.pp > 1:  # DeepSpeed's receive buffers: an activation and its gradient
        buffers += 2 * z.tokens * c.hidden_size * z.a / (lay.tp if lay.sp else 1)
    if stage.last:  # logits and their fp32 gradient, alive around the loss (fused: one chunk of them)
        rows = min(z.tokens, fused_chunk_tokens(c, lay.tp, gpu)) if lay.fused_ce else z.tokens
        buffers += rows * c.padded_vocab_size(lay.tp) // lay.tp * (z.a + 4)
    return buffers


def _stage_time(job: Job, lay: Layout, gpu: GPU, z: _Sizes, stage: Stage, block_costs: dict) -> tuple[float, float]:
    """``(compute, communication)`` seconds of one micro-batch through this stage: forward, backward (2x) and the
    recomputed forward; ``block_costs`` keeps each kind of block's cost (dense, MoE) once computed."""
    c, a, tokens = job.config, z.a, z.tokens
    tp_inter = _inter(lay.tp, gpu)
    totals = [0.0] * 7  # gemm, attn, attn_extra, elem, extra_bytes, tp_comm, ep_comm
    for i in stage.blocks:
        kind = c.is_moe_layer(i)
        if kind not in block_costs:
            block_costs[kind] = _block_cost(c, i, lay, job, gpu)
        totals = [t + x for t, x in zip(totals, block_costs[kind])]
    gemm, attn, attn_extra, elem, extra_bytes, tp_comm, ep_comm = totals
    passes = 3 + z.rc
    if stage.last:
        gemm_head = 2 * c.hidden_size * c.padded_vocab_size(lay.tp) / lay.tp * tokens
        compute_head = 3 * gemm_head / (z.peak * gpu.matmul_efficiency) + \
            4 * tokens * c.padded_vocab_size(lay.tp) / lay.tp * 4 / z.hbm
        tp_comm += _collective_time(tokens * c.hidden_size * a, lay.tp, "all_reduce", gpu, tp_inter)
    else:
        compute_head = 0.0
    if stage.first:  # vocab-parallel embedding: one all-reduce forward
        tp_comm += _collective_time(tokens * c.hidden_size * a, lay.tp, "all_reduce", gpu, tp_inter)
    compute = passes * (gemm / (z.peak * gpu.matmul_efficiency) + attn / (z.peak * gpu.attention_efficiency)) \
        + attn_extra / (z.peak * gpu.attention_efficiency) + (passes * elem + extra_bytes) / z.hbm + compute_head
    p2p = 0.0
    if lay.pp > 1:  # activations forward, their gradients backward (partitioned over TP by DeepSpeed / SP)
        p2p = 2 * _collective_time(tokens * c.hidden_size * a / lay.tp, 2, "p2p", gpu,
                                   _inter(lay.tp * lay.cp * lay.dp * 2, gpu))
    return compute, tp_comm + ep_comm + p2p


def _data_parallel_time(fullest: Stage, lay: Layout, gpu: GPU, z: _Sizes) -> float:
    """Seconds of the fullest stage's data-parallel collectives per step, dense and expert parameters each over
    their own group.

    As DeepSpeed runs them (its calls counted by zoo.parallel.comm_count, tests/parallel): ZeRO-0 all-reduces the
    accumulated gradients once per step; ZeRO-1 too, then all-gathers the updated parameters (DeepSpeed reduces
    with an all-reduce, not a reduce-scatter); ZeRO-2 all-reduces every micro-batch's gradients, then all-gathers;
    ZeRO-3 reduce-scatters every micro-batch's gradients and all-gathers each block's parameters for every
    forward, backward and recomputed forward."""
    a, m = z.a, z.m
    gbytes = 4 if a == 4 else a
    dp_inter = _inter(lay.tp * lay.cp * lay.dp, gpu)
    dp_time = 0.0
    for n, ranks in ((fullest.dense, z.parts), (fullest.expert, z.expert_parts)):
        if ranks <= 1 or n == 0:
            continue
        if lay.zero == 3:
            dp_time += m * _collective_time(n * gbytes, ranks, "reduce_scatter", gpu, dp_inter)
            dp_time += m * (2 + z.rc) * _collective_time(n * a, ranks, "all_gather", gpu, dp_inter)
            continue
        dp_time += (m if lay.zero == 2 else 1) * _collective_time(n * gbytes, ranks, "all_reduce", gpu, dp_inter)
        if lay.zero in (1, 2):
            dp_time += _collective_time(n * a, ranks, "all_gather", gpu, dp_inter)
    return dp_time


def _short(memory: dict, capacity: float) -> str:
    parts = ", ".join(f"{k} {v / GiB:.1f}" for k, v in memory.items())
    return f"needs {sum(memory.values()) / GiB:.1f} GiB per GPU ({parts}) > {capacity / GiB:.1f} GiB"

"""GPT models, GPT-2 style and Llama style, from one config, built from tensor-parallel layers.

GPT-2 (Radford et al. 2019): learned positions, LayerNorm, GELU (tanh), biases, tied embeddings.
Llama (Touvron et al. 2023): rotary positions (RoPE, Su et al. 2021; linear, Llama-3, YaRN or LongRoPE frequency
scaling, partial rotary, NoPE layers, a theta for the sliding layers: :mod:`zoo.models.rope`), RMSNorm, SwiGLU
(Shazeer 2020), no biases, grouped-query attention (Ainslie et al. 2023), tied or untied head.
Options on top: q/k biases (Qwen2), q/k RMSNorm per head (Qwen3) or over the projection (OLMoE, OLMo 2), a head dim
other than h / heads, and mixture-of-experts MLPs in some or all blocks (Mixtral, Qwen-MoE, OLMoE, DeepSeek routing;
:mod:`zoo.models.moe`). Block variants: sandwich norms (Gemma 2) or post-norm (OLMo 2), the parallel residual and exact
GELU with MLP biases apart from the attention's (GPT-NeoX), Granite's residual / attention / logit multipliers, Gemma
4's full-attention layers with their own head shapes and k = v, its v norm and layer scalars.

Parallel plan (Megatron-LM, arXiv 1909.08053): fused QKV and MLP fc1 (or gate/up) are column-parallel, the
attention output and MLP fc2 row-parallel, so a block costs two all-reduces forward; the embedding is
vocab-parallel and the LM head produces vocab-sharded logits for ``vocab_parallel_cross_entropy``. With sequence
parallelism (arXiv 2205.05198) the norms, dropouts and residuals work on ``[b, s/tp, h]``.

Context parallelism (:mod:`zoo.parallel.context_parallel`, ``ParallelOptions.cp_group``): every layer holds this CP
rank's s/cp positions (inputs and labels split alike, by ``split_sequence``); position embeddings and RoPE use the
tokens' global positions (and the sequence's global length, which picks LongRoPE's factors), attention is Ulysses
or ring attention, the loss the mean over the whole sequence.
Heads are split over TP first, then Ulysses splits each TP rank's heads over CP. Sequence parallelism composes:
it splits the local chunk, so norms see ``[b, s/(cp tp), h]`` and attention's column-parallel input gathers
``[b, s/cp, h]`` back over TP. Generation (the KV cache) runs without CP.

The model is a list of layer specs (:func:`layer_specs`): ``GPTEmbedding``, ``GPTBlock`` x L, ``GPTFinalNorm``
and the LM head (the embedding again, through ``TiedLayerSpec``, when tied). Each layer takes and returns one
tensor. Notation: b batch, s sequence, h hidden, nq/nkv query/key-value heads, d head dim, V padded vocabulary;
a ``_local`` suffix means "this TP rank's share";
with context parallelism, s counts this CP rank's positions (s/cp of the sequence).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from typing import NamedTuple

import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, TiedLayerSpec
from torch import nn

from zoo.models.attention import attention
from zoo.models.config import TransformerConfig, preset_config
from zoo.models.moe import GPTMoE
from zoo.models.rope import (  # noqa: F401 (_ROPE_TABLES, rope_inv_freq re-exported)
    _ROPE_TABLES,
    apply_rope,
    layer_rope,
    rope_inv_freq,
    rope_table,
    switch_length,
    validate_rope,
)
from zoo.parallel.context_parallel import (
    ALGORITHMS as CP_ALGORITHMS,
)
from zoo.parallel.context_parallel import (
    check_ulysses_heads,
    context_parallel_mean,
    ring_attention,
    sequence_positions,
    ulysses_attention,
)
from zoo.parallel.cross_entropy import linear_cross_entropy_sum, vocab_parallel_cross_entropy
from zoo.parallel.layers import (
    ColumnParallelLinear,
    GroupedQKVLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    divide,
    init_method_normal,
    scaled_init_method_normal,
    set_tensor_model_parallel_attributes,
)
from zoo.parallel.mappings import (
    all_reduce_tensor_model_parallel_region,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from zoo.parallel.random import tensor_parallel_rng
from zoo.parallel.topology import get_tensor_model_parallel_group, group_rank_and_size

FAMILY = "gpt"  # the family name of a zoo model folder (zoo.models.registry)


@dataclass
class GPTConfig(TransformerConfig):  # padded_vocab_size, check_layout, from_dict
    tp_split_heads = ("num_attention_heads",)  # what tensor parallelism splits (kv heads: check_layout)

    vocab_size: int = 50257
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_key_value_heads: int | None = None  # None: = num_attention_heads (multi-head attention)
    head_dim: int | None = None  # None: hidden_size / num_attention_heads (Qwen3 sets it apart)
    intermediate_size: int | None = None  # Megatron: ffn_hidden_size. None: 4h (GELU)
    max_position_embeddings: int = 1024
    position_embedding_type: str = "learned"  # "learned" (GPT-2) | "rope" (Llama)
    normalization: str = "layernorm"  # "layernorm" | "rmsnorm"
    norm_eps: float = 1e-5
    # "gelu" (tanh approximation, GPT-2's gelu_new) | "gelu_exact" (erf: HF's "gelu", NeoX) | "swiglu" | "geglu"
    # (tanh GELU gate)
    activation: str = "gelu"
    add_bias: bool = True  # biases in every linear layer
    qkv_bias: bool | None = None  # a bias on the fused QKV projection; None: = add_bias (True, add_bias False: Qwen2)
    mlp_bias: bool | None = None  # biases of the dense MLP's fc1 and fc2; None: = add_bias (NeoX: attention apart)
    tie_word_embeddings: bool = True
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "linear" | "llama3" | "yarn" | "longrope", ...} (zoo.models.rope)
    partial_rotary_factor: float = 1.0  # Phi-3, NeoX: only the first int(head_dim * f) features of a head rotate
    no_rope_layers: list[int] | None = None  # SmolLM3: per layer, 1 RoPE, 0 none (NoPE); None: RoPE on every layer
    rope_local_base_freq: float | None = None  # Gemma 3: sliding layers' theta (plain RoPE); None: rope_theta
    initializer_range: float = 0.02
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    make_vocab_size_divisible_by: int = 128  # Megatron: the padded vocabulary is a multiple of this x tp
    qk_norm: str | None = None  # RMSNorm of q and k before RoPE: "head" (Qwen3, over each head) | "full" (OLMoE)
    # Attention variants (zoo.models.attention; HF names). A query at i sees keys j with i - W < j <= i on a
    # "sliding_attention" layer. layer_types None: every layer sliding when sliding_window is set (Mistral), else full.
    sliding_window: int | None = None
    layer_types: list[str] | None = None  # per layer: "full_attention" | "sliding_attention" (Gemma 2, Qwen2)
    attn_logit_softcapping: float | None = None  # Gemma 2: scores = c tanh(scores / c)
    query_pre_attn_scalar: float | None = None  # Gemma 2: scores scaled by query_pre_attn_scalar^-1/2, not d^-1/2
    # Block and head variants (Gemma 2). Every norm (blocks, final, q/k) scales by (norm_weight_offset + w), its w
    # initialised to 1 - offset: Gemma's RMSNorm is x (1 + w) with w = 0 at init.
    norm_weight_offset: float = 0.0
    # "pre": x + f(norm(x)) | "sandwich": x + norm(f(norm(x))) (Gemma 2/3) | "post": x + norm(f(x)) (OLMo 2)
    norm_placement: str = "pre"
    use_parallel_residual: bool = False  # NeoX: x + attn(norm1(x)) + mlp(norm2(x)), both sublayers read x
    residual_multiplier: float | None = None  # Granite: x + m f(...) for both sublayers
    attention_multiplier: float | None = None  # Granite: the scores' scale itself, instead of 1/sqrt(d)
    logits_scaling: float | None = None  # Granite: logits / s (the fused LM head + loss divides its input instead)
    embedding_multiplier: float | None = None  # token embeddings times this, cast to their dtype (Gemma: sqrt(h))
    final_logit_softcapping: float | None = None  # Gemma 2: logits = c tanh(logits / c)
    # Gemma 4: its full-attention layers have heads of their own width and count, and may take the values from the
    # keys' projection; values may be RMS-normed without a weight; each block's output may be scaled by a constant.
    global_head_dim: int | None = None  # head dim of the full-attention layers (None: head_dim)
    num_global_key_value_heads: int | None = None  # kv heads of the full-attention layers (None: num_key_value_heads)
    attention_k_eq_v: bool = False  # full-attention layers: v = the key projection (before k norm and RoPE)
    v_norm: bool = False  # values RMS-normed over each head, no weight (Gemma 4)
    layer_scalar: bool = False  # each block's output times its ``layer_scalar`` buffer (Gemma 4; loaded, not trained)
    # Mixture of experts (zoo.models.moe; HF names). Defaults: a dense model. Which layers: is_moe_layer().
    num_experts: int = 0  # Mixtral: num_local_experts; DeepSeek: n_routed_experts. 0: dense
    num_experts_per_tok: int = 2  # top-k
    moe_intermediate_size: int | None = None  # per expert; None: intermediate_size (Mixtral)
    first_k_dense_replace: int = 0  # DeepSeek: the first k layers stay dense
    decoder_sparse_step: int = 1  # Qwen: layer i is sparse when (i + 1) % step == 0
    mlp_only_layers: list[int] = field(default_factory=list)  # Qwen: layers forced dense
    num_shared_experts: int = 0  # DeepSeek: n_shared_experts (one MLP of their summed width); Qwen2-MoE: 1
    shared_expert_intermediate_size: int | None = None  # None: num_shared_experts * moe_intermediate_size
    shared_expert_gate: bool = False  # Qwen2-MoE: shared(x) * sigmoid(x . w_gate)
    scoring_func: str = "softmax"  # "softmax" | "sigmoid" (DeepSeek-V3)
    norm_topk_prob: bool = True  # renormalise the k selected scores to sum to 1
    routed_scaling_factor: float = 1.0  # DeepSeek: routed weights times this
    n_group: int = 1  # DeepSeek group-limited routing: experts in n_group groups,
    topk_group: int = 1  # tokens choose among the best topk_group groups
    moe_expert_bias: bool = False  # DeepSeek-V3 aux-loss-free balancing (e_score_correction_bias)
    expert_bias_update_rate: float = 1e-3
    # Per MoE layer: coef * E * sum_e f_e P_e (1 when uniform; HF's Mixtral loss is k times that, over all layers).
    router_aux_loss_coef: float = 0.0
    router_aux_loss_type: str = "global"  # "global": over the layer call's tokens | "seq": per sequence (DeepSeek)
    router_z_loss_coef: float = 0.0  # ST-MoE: coef * mean(logsumexp(logits)^2)
    capacity_factor: float | None = None  # None: dropless; else ceil(cf * tokens * k / E) per expert and rank

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.intermediate_size is None:
            self.intermediate_size = 4 * self.hidden_size
        if self.head_dim is None and self.hidden_size % self.num_attention_heads == 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        self.validate()

    def validate(self) -> None:
        def need(ok, msg):
            if not ok:
                raise ValueError(f"GPTConfig: {msg}")

        need(self.position_embedding_type in ("learned", "rope"),
             f"position_embedding_type must be 'learned' or 'rope', got {self.position_embedding_type!r}")
        need(self.normalization in ("layernorm", "rmsnorm"),
             f"normalization must be 'layernorm' or 'rmsnorm', got {self.normalization!r}")
        need(self.activation in ACTIVATIONS, f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        need(self.norm_placement in NORM_PLACEMENTS,
             f"norm_placement must be one of {NORM_PLACEMENTS}, got {self.norm_placement!r}")
        need(self.head_dim is not None,
             f"hidden_size {self.hidden_size} is not divisible by num_attention_heads {self.num_attention_heads} "
             f"(or set head_dim)")
        need(self.num_attention_heads % self.num_key_value_heads == 0,
             f"num_attention_heads {self.num_attention_heads} is not divisible by num_key_value_heads "
             f"{self.num_key_value_heads}")
        need(self.qkv_bias is None or isinstance(self.qkv_bias, bool),
             f"qkv_bias must be true, false or null (= add_bias), got {self.qkv_bias!r}")
        validate_rope(self, need)
        need(self.qk_norm in (None, "head", "full"), f"qk_norm must be null, 'head' or 'full', got {self.qk_norm!r}")
        self._validate_attention(need)
        self._validate_moe(need)

    def _validate_attention(self, need) -> None:
        w, types = self.sliding_window, self.layer_types
        need(w is None or (isinstance(w, int) and not isinstance(w, bool) and w >= 1),
             f"sliding_window must be a positive integer or null, got {w!r}")
        if types is not None:
            need(isinstance(types, list) and len(types) == self.num_hidden_layers,
                 f"layer_types must list one type per layer ({self.num_hidden_layers}), got {types!r}")
            bad = sorted({t for t in types if t not in LAYER_TYPES})
            need(not bad, f"layer_types holds unknown type(s) {bad}; known: {list(LAYER_TYPES)}")
            need(w is not None or "sliding_attention" not in types,
                 "layer_types has 'sliding_attention' layers but sliding_window is null; set sliding_window")
        for name in ("attn_logit_softcapping", "query_pre_attn_scalar", "final_logit_softcapping",
                     "embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"):
            value = getattr(self, name)
            need(value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0),
                 f"{name} must be a positive number or null, got {value!r}")
        need(self.query_pre_attn_scalar is None or self.attention_multiplier is None,
             "query_pre_attn_scalar and attention_multiplier both set the scores' scale; set one of them")
        need(self.mlp_bias is None or isinstance(self.mlp_bias, bool),
             f"mlp_bias must be true, false or null (= add_bias), got {self.mlp_bias!r}")
        need(isinstance(self.use_parallel_residual, bool),
             f"use_parallel_residual must be true or false, got {self.use_parallel_residual!r}")
        need(not self.use_parallel_residual or self.norm_placement == "pre",
             f"use_parallel_residual needs norm_placement 'pre' (NeoX's), got {self.norm_placement!r}")
        for name in ("global_head_dim", "num_global_key_value_heads"):
            value = getattr(self, name)
            need(value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1),
                 f"{name} must be a positive integer or null, got {value!r}")
        gkv = self.num_global_key_value_heads
        need(gkv is None or self.num_attention_heads % gkv == 0,
             f"num_attention_heads {self.num_attention_heads} is not divisible by num_global_key_value_heads {gkv}")
        need(self.position_embedding_type != "rope" or (self.global_head_dim or 2) % 2 == 0,
             f"RoPE needs an even global_head_dim, got {self.global_head_dim}")
        full = [i for i in range(self.num_hidden_layers) if self.is_full_attention(i)]
        need(not (self.attention_k_eq_v or self.global_head_dim or gkv) or full,
             "attention_k_eq_v / global_head_dim / num_global_key_value_heads apply to full-attention layers, and "
             "layer_types has none")

    def _validate_moe(self, need) -> None:
        E, k = self.num_experts, self.num_experts_per_tok
        need(self.scoring_func in ("softmax", "sigmoid"),
             f"scoring_func must be 'softmax' or 'sigmoid', got {self.scoring_func!r}")
        need(self.router_aux_loss_type in ("global", "seq"),
             f"router_aux_loss_type must be 'global' or 'seq', got {self.router_aux_loss_type!r}")
        need(E >= 0, f"num_experts must be >= 0 (0: dense), got {E}")
        need(self.decoder_sparse_step >= 1, f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")
        if E == 0:
            return
        need(1 <= k <= E, f"num_experts_per_tok (top-k) {k} must be between 1 and num_experts {E}")
        need(self.n_group >= 1 and E % self.n_group == 0, f"n_group {self.n_group} does not divide num_experts {E}")
        need(1 <= self.topk_group <= self.n_group, f"topk_group {self.topk_group} must be between 1 and n_group "
             f"{self.n_group}")
        need(self.topk_group * (E // self.n_group) >= k,
             f"topk_group {self.topk_group} groups of {E // self.n_group} experts hold fewer than "
             f"num_experts_per_tok {k}")
        need(self.activation != "geglu", "MoE layers have no GeGLU experts; use activation 'swiglu' or 'gelu'")
        need(self.activation != "gelu_exact", "MoE layers have tanh-GELU experts only; use activation 'swiglu' or "
             "'gelu'")
        need(not self.add_bias, "MoE layers have no biases (as in every HF MoE model): set add_bias=False "
             "(qkv_bias may stay)")
        need(self.num_shared_experts >= 0, f"num_shared_experts must be >= 0, got {self.num_shared_experts}")
        need(self.num_shared_experts > 0 or (self.shared_expert_intermediate_size is None
                                              and not self.shared_expert_gate),
             "shared_expert_intermediate_size / shared_expert_gate need num_shared_experts > 0")
        need(self.capacity_factor is None or self.capacity_factor > 0,
             f"capacity_factor must be > 0 or null (dropless), got {self.capacity_factor}")

    def attention_window(self, i: int) -> int | None:
        """The sliding window of layer i, None for full attention (``layer_types``, else every layer alike)."""
        if self.sliding_window is None:
            return None
        kind = "sliding_attention" if self.layer_types is None else self.layer_types[i]
        return self.sliding_window if kind == "sliding_attention" else None

    def is_full_attention(self, i: int) -> bool:
        """Whether layer i is a full-attention layer by its type (``layer_types``; without it, every layer is
        when there is no ``sliding_window``): Gemma 4's global layers, whatever the sequence length."""
        if self.layer_types is not None:
            return self.layer_types[i] == "full_attention"
        return self.sliding_window is None

    def layer_head_dim(self, i: int) -> int:
        """Layer i's head dim: ``global_head_dim`` on full-attention layers where set, else ``head_dim``."""
        return self.global_head_dim if self.global_head_dim and self.is_full_attention(i) else self.head_dim

    def layer_kv_heads(self, i: int) -> int:
        """Layer i's key-value heads: ``num_global_key_value_heads`` on full-attention layers where set."""
        gkv = self.num_global_key_value_heads
        return gkv if gkv and self.is_full_attention(i) else self.num_key_value_heads

    def layer_k_eq_v(self, i: int) -> bool:
        """Whether layer i's values are its keys' projection (``attention_k_eq_v``, full-attention layers)."""
        return self.attention_k_eq_v and self.is_full_attention(i)

    @property
    def attention_scale(self) -> float | None:
        """The scores' scale: ``attention_multiplier``, ``query_pre_attn_scalar^-1/2``, or None (the kernels'
        1/sqrt(head_dim))."""
        if self.attention_multiplier is not None:
            return float(self.attention_multiplier)
        return None if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar ** -0.5

    @property
    def gated_mlp(self) -> bool:
        """Whether the MLP is gated (SwiGLU, GeGLU): fc1 holds gate and up, fused, so three weight matrices."""
        return self.activation in GATED_ACTIVATIONS

    @property
    def use_qkv_bias(self) -> bool:
        """Whether the fused QKV projection has a bias (``qkv_bias``, or ``add_bias`` when that is None)."""
        return self.add_bias if self.qkv_bias is None else self.qkv_bias

    @property
    def use_mlp_bias(self) -> bool:
        """Whether the dense MLP's fc1 and fc2 have biases (``mlp_bias``, or ``add_bias`` when that is None)."""
        return self.add_bias if self.mlp_bias is None else self.mlp_bias

    def is_moe_layer(self, i: int) -> bool:
        """Whether block i has a mixture of experts (else the dense MLP): DeepSeek's first_k_dense_replace and
        Qwen's mlp_only_layers / decoder_sparse_step together."""
        return (self.num_experts > 0 and i >= self.first_k_dense_replace and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def expert_intermediate_size(self) -> int:
        return self.intermediate_size if self.moe_intermediate_size is None else self.moe_intermediate_size

    @property
    def shared_intermediate_size(self) -> int:
        if self.shared_expert_intermediate_size is not None:
            return self.shared_expert_intermediate_size
        return self.num_shared_experts * self.expert_intermediate_size

    def has_dense_mlp(self) -> bool:
        return any(not self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    def check_layout(self, tp: int, pp: int = 1, ep: int = 1) -> None:
        """One line per problem, before anything is built: which number does not divide which. tp may exceed
        num_key_value_heads when it is a multiple of them (each kv head replicated over tp / nkv ranks)."""
        if ep > 1 and self.num_experts == 0:
            raise ValueError(f"ep {ep} needs a mixture-of-experts model (num_experts > 0)")
        if ep > 1 and self.num_experts % ep:
            raise ValueError(f"num_experts {self.num_experts} is not divisible by ep {ep}; use an ep that divides it")
        super().check_layout(tp, pp)
        for name in ("num_key_value_heads", "num_global_key_value_heads"):  # the latter: Gemma 4's full layers
            nkv = getattr(self, name)
            if nkv is None:
                continue
            if nkv % tp and tp % nkv:
                raise ValueError(f"{name} {nkv} and tp {tp}: one must divide the other (tp > kv heads replicates "
                                 f"each kv head over tp / kv heads ranks); use a tp that divides {nkv} or a "
                                 f"multiple of it")
            if tp > nkv and self.qk_norm == "full":
                raise ValueError(f"qk_norm 'full' is not supported with tp {tp} > {name} {nkv} (replicated kv "
                                 f"heads); use a tp that divides {nkv}")

    def num_parameters(self, include_embeddings: bool = True, active: bool = False) -> int:
        """Parameters of the unpadded model (as a HF checkpoint counts them). ``active``: those one token uses,
        i.e. only ``num_experts_per_tok`` of the routed experts of each MoE layer (router and shared ones in full)."""
        h, f, L = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        nq = self.num_attention_heads
        norm = h * (2 if self.normalization == "layernorm" else 1)
        block_norms = 4 if self.norm_placement == "sandwich" else 2

        def attn(i):  # a Gemma 4 full-attention layer has its own head dim and kv heads, and no v rows with k = v
            d, nkv, kv = self.layer_head_dim(i), self.layer_kv_heads(i), 1 if self.layer_k_eq_v(i) else 2
            out = h * (nq + kv * nkv) * d + nq * d * h + self.use_qkv_bias * (nq + kv * nkv) * d + self.add_bias * h
            return out + {None: 0, "head": 2 * d, "full": (nq + nkv) * d}[self.qk_norm]

        per_h = 3 if self.gated_mlp else 2  # weights per (hidden, intermediate) pair
        mlp = per_h * h * f + self.use_mlp_bias * ((2 * f if self.gated_mlp else f) + h)
        routed = self.num_experts_per_tok if active else self.num_experts
        moe = (self.num_experts * h + routed * per_h * h * self.expert_intermediate_size
               + per_h * h * self.shared_intermediate_size + self.shared_expert_gate * h)
        total = sum(attn(i) + block_norms * norm + (moe if self.is_moe_layer(i) else mlp) for i in range(L)) + norm
        if include_embeddings:
            total += self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
            if self.position_embedding_type == "learned":
                total += self.max_position_embeddings * h
        return total

    def to_dict(self) -> dict:
        """All fields, less the later additions at their defaults (qkv_bias, head_dim = h / heads, qk_norm, the MoE
        fields), so the configs (and zoo folders) of models without them stay as they were."""
        d = asdict(self)
        defaults = {f.name: f.default if f.default_factory is MISSING else f.default_factory() for f in fields(self)}
        for name in _ADDED_FIELDS:
            if d[name] == defaults[name]:
                del d[name]
        if d["head_dim"] == self.hidden_size // self.num_attention_heads:
            del d["head_dim"]
        return d

    @classmethod
    def from_preset(cls, name: str, **overrides) -> GPTConfig:
        return preset_config(cls, PRESETS, "GPT", name, overrides)


_ADDED_FIELDS = ("qkv_bias", "qk_norm", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                 "first_k_dense_replace", "decoder_sparse_step", "mlp_only_layers", "num_shared_experts",
                 "shared_expert_intermediate_size", "shared_expert_gate", "scoring_func", "norm_topk_prob",
                 "routed_scaling_factor", "n_group", "topk_group", "moe_expert_bias", "expert_bias_update_rate",
                 "router_aux_loss_coef", "router_aux_loss_type", "router_z_loss_coef", "capacity_factor")
_ADDED_FIELDS += ("sliding_window", "layer_types", "attn_logit_softcapping", "query_pre_attn_scalar")
_ADDED_FIELDS += ("norm_weight_offset", "norm_placement", "embedding_multiplier", "final_logit_softcapping")
_ADDED_FIELDS += ("mlp_bias", "use_parallel_residual", "residual_multiplier", "attention_multiplier", "logits_scaling")
_ADDED_FIELDS += ("partial_rotary_factor", "no_rope_layers", "rope_local_base_freq")
ACTIVATIONS = ("gelu", "gelu_exact", "swiglu", "geglu")
_ADDED_FIELDS += ("global_head_dim", "num_global_key_value_heads", "attention_k_eq_v", "v_norm", "layer_scalar")
GATED_ACTIVATIONS = {"swiglu": F.silu, "geglu": functools.partial(F.gelu, approximate="tanh")}  # the gate's function
NORM_PLACEMENTS = ("pre", "sandwich", "post")
LAYER_TYPES = ("full_attention", "sliding_attention")  # HF's names

_LLAMA = dict(position_embedding_type="rope", normalization="rmsnorm", activation="swiglu", add_bias=False)
_TINY_LLAMA = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=176, max_position_embeddings=128, tie_word_embeddings=False, norm_eps=1e-6,
                   **_LLAMA)
PRESETS: dict[str, dict] = {
    # Tests and the laptop run.
    "tiny": dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                 max_position_embeddings=128),
    "tiny-llama": _TINY_LLAMA,
    # The main job (configs/gpt/main.yaml): "tiny" at twice the width, 0.88M parameters.
    "mini": dict(vocab_size=512, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                 max_position_embeddings=128),
    # Mixtral-like: every block 8 experts, top-2 of a softmax, renormalised.
    "tiny-moe": dict(_TINY_LLAMA, num_experts=8, num_experts_per_tok=2),
    # Qwen2-MoE-like: narrow experts, not renormalised, a sigmoid-gated shared expert, q/k/v biases; blocks 0, 2 dense.
    "tiny-moe-shared": dict(_TINY_LLAMA, qkv_bias=True, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                            num_shared_experts=1, shared_expert_intermediate_size=64, shared_expert_gate=True,
                            norm_topk_prob=False, decoder_sparse_step=2),
    # GPT-2 family (the shapes of the released checkpoints).
    "gpt2-124m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12),
    "gpt2-355m": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16),
    "gpt2-774m": dict(hidden_size=1280, num_hidden_layers=36, num_attention_heads=20),
    "gpt2-1.5b": dict(hidden_size=1600, num_hidden_layers=48, num_attention_heads=25),
    # Llama shapes: Llama-3.2-1B and Llama-2-7B.
    "llama-1b": dict(vocab_size=128256, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, intermediate_size=8192, max_position_embeddings=131072, rope_theta=500000.0,
                     rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                     tie_word_embeddings=True, **_LLAMA),
    "llama-7b": dict(vocab_size=32000, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                     intermediate_size=11008, max_position_embeddings=4096, tie_word_embeddings=False, **_LLAMA),
    # Mistral-7B-v0.3 (grouped-query attention, no sliding window).
    "mistral-7b": dict(vocab_size=32768, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, intermediate_size=14336, max_position_embeddings=32768,
                       rope_theta=1e6, tie_word_embeddings=False, **_LLAMA),
    # Mixture-of-experts shapes of the released checkpoints (counts checked against transformers in tests/models).
    # The router loss coefficients are training settings, left at 0.
    "mixtral-8x7b": dict(vocab_size=32000, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, intermediate_size=14336, max_position_embeddings=32768,
                         rope_theta=1e6, tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2, **_LLAMA),
    "qwen3-30b-a3b": dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, qk_norm="head", intermediate_size=6144,
                          max_position_embeddings=40960, rope_theta=1e6, norm_eps=1e-6, tie_word_embeddings=False,
                          num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, **_LLAMA),
    "olmoe-1b-7b": dict(vocab_size=50304, hidden_size=2048, num_hidden_layers=16, num_attention_heads=16,
                        intermediate_size=1024, max_position_embeddings=4096, qk_norm="full", tie_word_embeddings=False,
                        num_experts=64, num_experts_per_tok=8, norm_topk_prob=False, **_LLAMA),
}


@dataclass
class ParallelOptions:
    """How the layers are laid out; not part of the architecture (a checkpoint is the same for any value)."""

    sequence_parallel: bool = False
    tp_group: object = field(default=None, repr=False)  # None: the current grid's TP group
    ep_group: object = field(default=None, repr=False)  # expert parallelism (zoo.models.moe); None: no EP
    # The EP group takes in the TP ranks ("parallel folding"): each TP rank holds other experts (zoo.models.moe).
    ep_spans_tp: bool = False
    cp_group: object = field(default=None, repr=False)  # context parallelism; None: no CP
    cp_algorithm: str = "ulysses"  # "ulysses" (heads over CP) | "ring" (key/value blocks around CP)
    # The LM head returns LMHeadInputs(hidden, weight) and GPTLoss runs head + loss in token chunks
    # (zoo.parallel.cross_entropy.linear_cross_entropy_sum): no [tokens, V] logits. For training only.
    fused_cross_entropy: bool = False

    def __post_init__(self):
        if self.cp_algorithm not in CP_ALGORITHMS:
            raise ValueError(f"cp_algorithm must be one of {CP_ALGORITHMS}, got {self.cp_algorithm!r}")

    def global_positions(self, s_local: int, device) -> torch.Tensor:
        """The global positions ``[s_local]`` of this rank's tokens (``0 .. s_local-1`` without CP)."""
        rank, cp = group_rank_and_size(self.cp_group)
        return sequence_positions(s_local * cp, rank, cp, self.cp_algorithm, device=device)


# ---------------------------------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------------------------------


class Norm(nn.Module):
    """LayerNorm or RMSNorm over the last dimension, statistics in fp32 (as HF's LlamaRMSNorm)."""

    def __init__(self, config: GPTConfig, par: ParallelOptions):
        super().__init__()
        h = config.hidden_size
        self.kind, self.eps, self.offset = config.normalization, config.norm_eps, config.norm_weight_offset
        self.weight = nn.Parameter(torch.full((h,), 1.0 - self.offset))  # the scale offset + w starts at 1
        self.bias = nn.Parameter(torch.zeros(h)) if self.kind == "layernorm" else None
        self.sequence_parallel, self.tp_group = par.sequence_parallel, par.tp_group
        for p in self.parameters():
            p.sequence_parallel = par.sequence_parallel

    def forward(self, x):
        w, b = self.weight, self.bias
        if self.sequence_parallel:  # this rank saw s/tp positions: sum the weight grads over TP
            w = copy_to_tensor_model_parallel_region(w, self.tp_group)
            b = None if b is None else copy_to_tensor_model_parallel_region(b, self.tp_group)
        if self.kind == "layernorm":
            return F.layer_norm(x, (x.shape[-1],), w if not self.offset else w + self.offset, b, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return _scale(x32, w, self.offset, x.dtype)


def _scale(x32, w, offset: float, dtype):
    """The normalised fp32 ``x32`` times its weight, as HF does: Llama casts x to the dtype, then scales;
    Gemma (an offset) scales in fp32 by (offset + w), then casts."""
    if not offset:
        return w * x32.to(dtype)
    return (x32 * (offset + w.float())).to(dtype)


class QKNorm(nn.Module):
    """RMSNorm of queries or keys ``[b, n_local, s, d]`` before RoPE, statistics in fp32.

    ``qk_norm="head"`` (Qwen3): over each head's d features, one ``weight`` [d] shared by all heads, replicated
    (each TP rank holds other heads, so its gradient is summed over TP). ``"full"`` (OLMoE): over all n*d features
    of the projection, ``weight`` [n*d] sharded over TP like the heads; the sum of squares is all-reduced.
    """

    def __init__(self, config: GPTConfig, num_heads: int, tp_group, head_dim: int | None = None):
        super().__init__()
        self.kind, self.eps, self.num_heads = config.qk_norm, config.norm_eps, num_heads
        self.offset = config.norm_weight_offset
        self.tp_group, self.tp = tp_group, group_rank_and_size(tp_group)[1]
        d = config.head_dim if head_dim is None else head_dim  # a Gemma 4 full-attention layer's own
        self.weight = nn.Parameter(torch.full((d if self.kind == "head" else num_heads // self.tp * d,),
                                              1.0 - self.offset))
        if self.kind == "full":
            set_tensor_model_parallel_attributes(self.weight, 0)

    def forward(self, x):
        x32 = x.float()
        if self.kind == "head":
            mean_square = x32.pow(2).mean(-1, keepdim=True)  # [b, n_local, s, 1]
            w = self.weight if self.tp == 1 else copy_to_tensor_model_parallel_region(self.weight, self.tp_group)
        else:
            square_sum = x32.pow(2).sum((1, 3), keepdim=True)  # [b, 1, s, 1], this rank's heads
            if self.tp > 1:  # every rank's partial sum feeds every rank's heads: all-reduce both ways
                square_sum = all_reduce_tensor_model_parallel_region(square_sum, self.tp_group)
            mean_square = square_sum / (self.num_heads * x.shape[-1])
            w = self.weight.view(x.shape[1], 1, x.shape[-1])  # [n_local, 1, d]
        return _scale(x32 * torch.rsqrt(mean_square + self.eps), w, self.offset, x.dtype)


def v_norm(v, eps: float):
    """Gemma 4's value norm: RMSNorm over each head's d features in fp32, without a weight."""
    v32 = v.float()
    return (v32 * torch.rsqrt(v32.pow(2).mean(-1, keepdim=True) + eps)).to(v.dtype)


class KVCache:
    """One block's keys and values for incremental decoding, preallocated for ``max_len`` positions, or for the last
    ``window`` positions of a sliding-window layer (a rolling buffer).

    A forward with the cache computes keys and values for its s new positions only, stores them, and attends to the
    past ones too: the prompt is one forward (s = prompt length), each decoding step one more (s = 1). Rows may be
    left-padded: the first ``pad[i]`` positions of row i are padding, masked out as keys, and row i's positions count
    from its first real token, so a padded row computes what it would alone. Inference only: tensors are written in
    place, nothing is kept for backward.

    Full cache: position p at slot p; a forward writes ``[length, length + s)`` and attends to ``[0, length + s)``,
    its window (if any) masked by the attention function. Rolling cache (``window`` W < ``max_len``): only W slots,
    position p at slot p mod W. A query at p sees keys in (p - W, p], so once a decoding step has written its key at
    slot p mod W (over position p - W, which it may not see) every slot holds a key it sees: it attends to the
    buffer as it lies, unmasked (keys in any order give the same softmax sum, up to rounding). The prompt attends to
    its own keys, as the full cache does, and leaves its last W; a chunk after a past, or padded rows, attend to the
    past in position order (a W-key copy) with an explicit mask. Memory: W positions, not ``max_len``.
    """

    def __init__(self, batch: int, num_heads: int, max_len: int, head_dim: int, *, dtype: torch.dtype, device,
                 pad: torch.Tensor | None = None, window: int | None = None):
        self.window = window if window is not None and window < max_len else None  # None: the full cache
        slots = max_len if self.window is None else self.window
        # [b, nkv_local, slots, d]
        self.k = torch.zeros(batch, num_heads, slots, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.max_len = max_len
        self.length = 0
        self.pad = pad  # [b] number of leading padding positions per row, or None

    def positions(self, s: int, device) -> torch.Tensor:
        """Positions of the next s tokens: ``[s]``, or ``[b, s]`` with padding (clamped at 0 on the padding)."""
        pos = torch.arange(self.length, self.length + s, device=device)
        return pos if self.pad is None else (pos - self.pad[:, None]).clamp(min=0)

    def attention_mask(self, s: int, device) -> torch.Tensor | None:
        """Boolean mask of the next s queries over all ``length + s`` keys, True = attend: ``[s, t]`` or
        ``[b, 1, s, t]``. None where no mask is needed: no past (plain causal) or a single query (sees all)."""
        if self.pad is None and (self.length == 0 or s == 1):
            return None
        query = torch.arange(self.length, self.length + s, device=device)[:, None]  # [s, 1]
        key = torch.arange(self.length + s, device=device)  # [t]
        return self._mask(query, key)

    def _mask(self, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        """Queries at positions ``query`` [s, 1] over keys at ``key`` [t]: causal (and the window, rolling), real keys
        only; ``[s, t]`` or ``[b, 1, s, t]`` with padding."""
        allowed = key <= query  # [s, t]: causal within the new tokens, all past ones visible
        if self.window is not None:
            allowed = allowed & (key > query - self.window)
        if self.pad is None:
            return allowed
        real = key >= self.pad[:, None, None]  # [b, 1, t]
        # A padding query still sees itself: a row with no key would give NaN, and NaN times a zero weight is NaN.
        return ((allowed & real) | (key == query))[:, None]  # [b, 1, s, t]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Full cache: store ``[b, nkv_local, s, d]`` keys/values after the past ones; return all
        ``[b, nkv_local, length, d]``."""
        if self.window is not None:
            raise ValueError("a rolling (sliding-window) cache has no whole past to return; use update()")
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache full: {end} positions needed, {self.max_len} allocated")
        self.k[:, :, self.length:end] = k
        self.v[:, :, self.length:end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Store the s new keys/values ``[b, nkv_local, s, d]``; return the keys and values the s new queries attend
        to and the arguments of :func:`zoo.models.attention.attention` that say how (``causal``, ``attn_mask``,
        ``q_offset``, and ``window`` where the mask already holds it)."""
        past, s = self.length, k.shape[2]
        if self.window is None:
            mask = self.attention_mask(s, k.device)
            k, v = self.append(k, v)  # [b, nkv_local, past + s, d]
            # No mask: an empty cache is plain causal attention (square), a single query sees every key (but those
            # outside its window: the queries sit at past .. past + s - 1).
            return k, v, dict(causal=mask is None and past == 0, attn_mask=mask, q_offset=past)
        if past + s > self.max_len:
            raise ValueError(f"KV cache full: {past + s} positions needed, {self.max_len} allocated")
        W = self.window
        if past == 0:  # the prompt: its own keys, as the full cache attends them (window by the attention function)
            mask = self.attention_mask(s, k.device)
            self._store(k, v)
            return k, v, dict(causal=mask is None, attn_mask=mask, q_offset=0)
        if s == 1 and self.pad is None:  # a decoding step: every slot written so far is inside its window
            self._store(k, v)
            n = min(self.length, W)
            return self.k[:, :, :n], self.v[:, :, :n], dict(causal=False, attn_mask=None, q_offset=0, window=None)
        first = max(0, past - W + 1)  # the oldest past position a new query sees
        order = torch.arange(first, past, device=k.device) % W  # their slots, in position order
        keys = torch.cat([self.k[:, :, order], k], dim=2)  # [b, nkv_local, past - first + s, d]
        values = torch.cat([self.v[:, :, order], v], dim=2)
        query = torch.arange(past, past + s, device=k.device)[:, None]  # [s, 1]
        mask = self._mask(query, torch.arange(first, past + s, device=k.device))
        self._store(k, v)
        return keys, values, dict(causal=False, attn_mask=mask, q_offset=0, window=None)

    def _store(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Rolling cache: the last (at most W) of the s new positions at their slots p mod W."""
        s, W = k.shape[2], self.window
        keep = min(s, W)
        slots = torch.arange(self.length + s - keep, self.length + s, device=k.device) % W
        self.k[:, :, slots] = k[:, :, s - keep:]
        self.v[:, :, slots] = v[:, :, s - keep:]
        self.length += s


class GPTAttention(nn.Module):
    """Causal self-attention; heads split over TP; with CP, over the whole sequence by Ulysses or ring attention.

    The fused QKV weight is laid out per key-value group: ``[q (nq/nkv heads), k, v]`` for each of the nkv groups,
    so a contiguous TP split hands each rank whole groups where tp divides nkv, as in Megatron. Where tp is a
    multiple of nkv, the tp / nkv ranks of a group split its query heads and each holds the group's k/v rows, their
    gradients summed over those ranks (:class:`zoo.parallel.layers.GroupedQKVLinear`). Ulysses then splits
    a TP rank's nq/tp query heads over CP (cp must divide them); ring attention has no head limit and no dropout.

    Training calls ``forward(x)``. Generation passes a :class:`KVCache`, or attaches one as ``self.kv_cache``
    (the block calls ``attention(x)`` unchanged); the training path only checks that it is None.

    Layer ``layer_idx``'s window (``config.attention_window``), the soft cap and the scale go to the one attention
    function (:func:`zoo.models.attention.attention`) in every path: one process, Ulysses (per rank, after its
    all-to-all), ring attention (which skips blocks outside the window) and generation. In generation a
    sliding-window layer keeps a rolling cache of its last W positions (:class:`KVCache` with ``window``), the full
    layers the whole sequence.
    """

    def __init__(self, config: GPTConfig, par: ParallelOptions, output_init, layer_idx: int = 0):
        super().__init__()
        self.config = config
        self.window = config.attention_window(layer_idx)
        self.layer_idx, self.has_rope = layer_idx, layer_rope(config, layer_idx) is not None
        self.switch = switch_length(config, layer_idx)  # longrope: where the long factors start; else None
        self.variant = dict(window=self.window, softcap=config.attn_logit_softcapping, scale=config.attention_scale)
        # Gemma 4's full-attention layers have their own head dim and kv heads, and may hold no v rows (k = v).
        d, nq, nkv = config.layer_head_dim(layer_idx), config.num_attention_heads, config.layer_kv_heads(layer_idx)
        self.k_eq_v = config.layer_k_eq_v(layer_idx)
        self.kv_rows = 1 if self.k_eq_v else 2  # per group: [q heads, k, v] or [q heads, k]
        if d != config.head_dim:  # RoPE tables are made for the layer's head dim
            self.rope_config = replace(config, head_dim=d, global_head_dim=None, num_global_key_value_heads=None,
                                       attention_k_eq_v=False, layer_types=None, sliding_window=None)
        else:
            self.rope_config = config
        tp = group_rank_and_size(par.tp_group)[1]
        if tp > nkv:  # each kv head replicated over the tp / nkv ranks that split its query heads
            self.qkv = GroupedQKVLinear(config.hidden_size, nq, nkv, d, bias=config.use_qkv_bias,
                                        kv_parts=self.kv_rows, init_method=init_method_normal(config.initializer_range),
                                        sequence_parallel=par.sequence_parallel, tp_group=par.tp_group)
        else:
            self.qkv = ColumnParallelLinear(config.hidden_size, (nq + self.kv_rows * nkv) * d,
                                            bias=config.use_qkv_bias,
                                            init_method=init_method_normal(config.initializer_range),
                                            sequence_parallel=par.sequence_parallel, tp_group=par.tp_group)
        self.dense = RowParallelLinear(nq * d, config.hidden_size, bias=config.add_bias, input_is_parallel=True,
                                       init_method=output_init, sequence_parallel=par.sequence_parallel,
                                       tp_group=par.tp_group)
        self.num_groups_local = divide(nkv, tp, "num_key_value_heads") if tp <= nkv else 1
        self.q_per_group = nq // nkv if tp <= nkv else nq // tp  # query heads per local group
        self.head_dim = d
        self.sequence_parallel = par.sequence_parallel
        self.par, self.cp = par, group_rank_and_size(par.cp_group)[1]
        if par.cp_algorithm == "ulysses":
            check_ulysses_heads(nq // tp, self.cp)
        self.q_norm = self.k_norm = None
        if config.qk_norm is not None:
            self.q_norm = QKNorm(config, nq, self.qkv.tp_group, d)
            self.k_norm = QKNorm(config, nkv, self.qkv.tp_group, d)
        self.kv_cache: KVCache | None = None  # set by the generator for the duration of a generation

    def forward(self, x, kv_cache: KVCache | None = None):
        kv_cache = self.kv_cache if kv_cache is None else kv_cache
        if kv_cache is not None and self.sequence_parallel:
            raise ValueError("the KV cache is for generation, which runs without sequence parallelism; build the "
                             "model with ParallelOptions(sequence_parallel=False)")
        if kv_cache is not None and self.cp > 1:
            raise ValueError("the KV cache is for generation, which runs without context parallelism; build the "
                             "model with ParallelOptions(cp_group=None)")
        qkv = self.qkv(x)  # [b, s, g_local * (q_per_group + 2) * d]
        b, s, _ = qkv.shape
        qkv = qkv.view(b, s, self.num_groups_local, self.q_per_group + self.kv_rows, self.head_dim)
        q = qkv[:, :, :, : self.q_per_group].reshape(b, s, -1, self.head_dim).transpose(1, 2)  # [b, nq_local, s, d]
        k = qkv[:, :, :, self.q_per_group].transpose(1, 2)  # [b, nkv_local, s, d]
        v = k if self.k_eq_v else qkv[:, :, :, self.q_per_group + 1].transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.config.v_norm:
            v = v_norm(v, self.config.norm_eps)
        if kv_cache is not None:
            return self._forward_cached(q, k, v, kv_cache)
        if self.has_rope:
            cos, sin = rope_table(self.rope_config, s * self.cp, x.device, q.dtype, self.layer_idx)
            if self.cp == 1:
                cos, sin = cos[:s], sin[:s]  # [s, d]
            else:  # this rank's tokens sit at their global positions
                pos = self.par.global_positions(s, x.device)
                cos, sin = cos[pos], sin[pos]  # [s, d]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        p = self.config.attention_dropout if self.training else 0.0
        with tensor_parallel_rng(p > 0):  # heads are sharded: each rank draws its own heads' masks
            if self.cp == 1:
                out = attention(q, k, v, dropout_p=p, **self.variant)  # [b, nq_local, s, d]
            elif self.par.cp_algorithm == "ulysses":
                attend = functools.partial(attention, dropout_p=p, **self.variant)
                out = ulysses_attention(q, k, v, self.par.cp_group, attend=attend)  # [b, nq_local, s, d]
            elif p > 0:
                raise ValueError("ring attention has no attention dropout; set attention_dropout=0 or use "
                                 "cp_algorithm='ulysses'")
            else:
                out = ring_attention(q, k, v, self.par.cp_group, **self.variant)  # [b, nq_local, s, d]
        out = out.transpose(1, 2).reshape(b, s, -1)  # [b, s, nq_local * d]
        return self.dense(out)

    def _forward_cached(self, q, k, v, cache: KVCache):
        """q: [b, nq_local, s, d], k, v: [b, nkv_local, s, d] for the s new positions; attends to the past too."""
        b, _, s, _ = q.shape
        past = cache.length
        if self.has_rope:
            pos = cache.positions(s, q.device)  # [s] or [b, s]
            # The sequence's length (longrope's factor set follows it): its largest position + 1, as in HF.
            length = past + s if cache.pad is None or self.switch is None else int(pos.max()) + 1
            cos, sin = rope_table(self.rope_config, length, q.device, q.dtype, self.layer_idx)
            cos, sin = cos[pos], sin[pos]  # [s, d] or [b, s, d]
            if pos.dim() == 2:
                cos, sin = cos[:, None], sin[:, None]  # [b, 1, s, d]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v, how = cache.update(k, v)  # the keys the new queries attend to, and how (KVCache.update)
        out = attention(q, k, v, **{**self.variant, **how})  # [b, nq_local, s, d]
        out = out.transpose(1, 2).reshape(b, s, -1)  # [b, s, nq_local * d]
        return self.dense(out)


class GPTMLP(nn.Module):
    """GELU: fc2(gelu(fc1 x)), tanh-approximate ("gelu") or exact ("gelu_exact"). SwiGLU: fc2(silu(gate x) * up x),
    GeGLU the same with tanh-GELU for silu; gate and up fused in one column-parallel weight ``[gate; up]`` split with
    stride 2, so each rank holds matching halves. Biases where ``config.use_mlp_bias``."""

    def __init__(self, config: GPTConfig, par: ParallelOptions, output_init):
        super().__init__()
        h, f = config.hidden_size, config.intermediate_size
        self.gate_fn = GATED_ACTIVATIONS.get(config.activation)  # None: plain GELU
        self.approximate = "none" if config.activation == "gelu_exact" else "tanh"
        gated, bias = self.gate_fn is not None, config.use_mlp_bias
        self.fc1 = ColumnParallelLinear(h, 2 * f if gated else f, bias=bias, stride=2 if gated else 1,
                                        init_method=init_method_normal(config.initializer_range),
                                        sequence_parallel=par.sequence_parallel, tp_group=par.tp_group)
        self.fc2 = RowParallelLinear(f, h, bias=bias, input_is_parallel=True, init_method=output_init,
                                     sequence_parallel=par.sequence_parallel, tp_group=par.tp_group)

    def forward(self, x):
        h = self.fc1(x)
        if self.gate_fn is not None:
            gate, up = h.chunk(2, dim=-1)
            h = self.gate_fn(gate) * up
        else:
            h = F.gelu(h, approximate=self.approximate)
        return self.fc2(h)


def _dropout(x, p, training, sequence_parallel):
    if not training or p == 0.0:
        return x
    if sequence_parallel:  # sequence shards differ per rank: draw from the TP stream
        with tensor_parallel_rng():
            return F.dropout(x, p, True)
    return F.dropout(x, p, True)


class GPTEmbedding(nn.Module):
    """Token ids ``[b, s]`` -> hidden ``[b, s, h]`` (``[b, s/tp, h]`` with sequence parallelism). With context
    parallelism the ids are this CP rank's s/cp tokens and learned positions are looked up at their global positions.

    Also the tied LM head (``lm_logits``) on the last pipeline stage when embeddings are tied.
    """

    def __init__(self, config: GPTConfig, par: ParallelOptions):
        super().__init__()
        self.config, self.par = config, par
        tp = group_rank_and_size(par.tp_group)[1]
        self.word_embeddings = VocabParallelEmbedding(config.padded_vocab_size(tp), config.hidden_size,
                                                      init_method=init_method_normal(config.initializer_range),
                                                      tp_group=par.tp_group)
        self.word_embeddings.weight.unpadded_size = config.vocab_size  # rows past it are padding (zoo.convert.io)
        if config.position_embedding_type == "learned":
            self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
            init_method_normal(config.initializer_range)(self.position_embeddings.weight.data)
        else:
            self.position_embeddings = None

    @property
    def word_embeddings_weight(self):  # TiedLayerSpec fetches the shared weight with getattr
        return self.word_embeddings.weight

    def forward(self, ids, position_ids=None):
        """``position_ids`` (``[s]`` or ``[b, s]``; default ``0 .. s-1``) lets generation continue after cached
        positions; training passes ids alone."""
        s = ids.shape[1]
        cp = group_rank_and_size(self.par.cp_group)[1]
        if position_ids is None:
            if s * cp > self.config.max_position_embeddings:
                raise ValueError(f"sequence length {s * cp} exceeds max_position_embeddings "
                                 f"{self.config.max_position_embeddings}")
            position_ids = self.par.global_positions(s, ids.device)  # 0 .. s-1 without CP
        elif self.par.sequence_parallel or cp > 1:
            raise ValueError("position_ids are for generation, which runs without sequence or context parallelism")
        x = self.word_embeddings(ids)  # [b, s, h]
        if self.config.embedding_multiplier is not None:  # as HF's Gemma: the factor rounded to x's dtype
            x = x * torch.tensor(self.config.embedding_multiplier, dtype=x.dtype, device=x.device)
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(position_ids)  # [s, h] or [b, s, h]
        if self.par.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, self.par.tp_group)  # [b, s/tp, h]
        return _dropout(x, self.config.hidden_dropout, self.training, self.par.sequence_parallel)


def lm_logits(embedding: GPTEmbedding, hidden):
    """Tied LM head: hidden ``[b, s(/tp), h]`` -> vocab-sharded logits ``[b, s, V/tp]`` with the input embedding."""
    return _parallel_logits(hidden, embedding.word_embeddings.weight, embedding.par, embedding.config)


class LMHeadInputs(NamedTuple):
    """What the LM head hands the loss with ``ParallelOptions.fused_cross_entropy``: its input as the GEMM would
    see it (TP-copied / SP-gathered, ``[b, s, h]``) and this rank's ``[V/tp, h]`` weight, so the loss computes the
    logits itself, a chunk of tokens at a time."""

    hidden: torch.Tensor
    weight: torch.Tensor


def _parallel_logits(hidden, weight, par: ParallelOptions, config: GPTConfig):
    if par.sequence_parallel:
        hidden = gather_from_sequence_parallel_region(hidden, par.tp_group, tensor_parallel_output_grad=True)
    else:
        hidden = copy_to_tensor_model_parallel_region(hidden, par.tp_group)
    if par.fused_cross_entropy:  # (hidden / s) W^T = (hidden W^T) / s: logits_scaling rides on the GEMM's input
        return LMHeadInputs(hidden if config.logits_scaling is None else hidden / config.logits_scaling, weight)
    return softcap_logits(F.linear(hidden, weight), config)


def softcap_logits(logits, config: GPTConfig):
    """``logits_scaling`` s (Granite): logits / s; then ``final_logit_softcapping`` c: logits = c tanh(logits / c);
    elementwise, so a vocab shard scales and caps its own."""
    if config.logits_scaling is not None:
        logits = logits / config.logits_scaling
    c = config.final_logit_softcapping
    return logits if c is None else c * torch.tanh(logits / c)


class GPTLMHead(nn.Module):
    """Untied LM head: a column-parallel ``[V/tp, h]`` weight producing vocab-sharded logits."""

    def __init__(self, config: GPTConfig, par: ParallelOptions):
        super().__init__()
        tp = group_rank_and_size(par.tp_group)[1]
        self.par, self.config = par, config
        self.linear = ColumnParallelLinear(config.hidden_size, config.padded_vocab_size(tp), bias=False,
                                           init_method=init_method_normal(config.initializer_range),
                                           sequence_parallel=par.sequence_parallel, tp_group=par.tp_group)
        self.linear.weight.unpadded_size = config.vocab_size

    def forward(self, hidden):
        if self.par.fused_cross_entropy:
            # the weight the head stands for: with a LoRA adapter (zoo.models.lora) W + s B A, which the loss reads
            weight = getattr(self.linear, "merged_weight", None)
            return _parallel_logits(hidden, self.linear.weight if weight is None else weight(), self.par, self.config)
        return softcap_logits(self.linear(hidden), self.config)


class GPTBlock(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)); ``[b, s(/tp), h]`` in and out. The
    mlp is a mixture of experts (:class:`zoo.models.moe.GPTMoE`) where ``config.is_moe_layer(layer_idx)``.
    ``norm_placement="sandwich"`` (Gemma 2) norms each sublayer's output too, before the residual add
    (``attention_output_norm``, ``mlp_output_norm``; with SP on the sequence shard, as the other norms); "post"
    (OLMo 2) norms only the outputs: x + norm(attn(x)), then x + norm(mlp(x)) (no ``input_norm`` /
    ``post_attention_norm``). ``use_parallel_residual`` (NeoX): x + attn(norm1(x)) + mlp(norm2(x)), the MLP reading
    the block's input. ``residual_multiplier`` m (Granite) scales each sublayer's output before its add."""

    def __init__(self, config: GPTConfig, par: ParallelOptions, layer_idx: int):
        super().__init__()
        self.config, self.par, self.layer_idx = config, par, layer_idx
        output_init = scaled_init_method_normal(config.initializer_range, config.num_hidden_layers)
        pre = config.norm_placement != "post"  # the sublayers' input norms
        self.input_norm = Norm(config, par) if pre else nn.Identity()
        self.attention = GPTAttention(config, par, output_init, layer_idx)
        self.post_attention_norm = Norm(config, par) if pre else nn.Identity()
        if config.is_moe_layer(layer_idx):
            self.mlp = GPTMoE(config, par, output_init)
        else:
            self.mlp = GPTMLP(config, par, output_init)
        output = config.norm_placement in ("sandwich", "post")  # the sublayers' output norms
        self.attention_output_norm = Norm(config, par) if output else nn.Identity()
        self.mlp_output_norm = Norm(config, par) if output else nn.Identity()
        if config.layer_scalar:  # Gemma 4: a constant of the checkpoint (a buffer, as in HF), saved and loaded
            self.register_buffer("layer_scalar", torch.ones(1))
        else:
            self.layer_scalar = None

    def _residual(self, out):
        """A sublayer's output as added to the residual stream: dropout, times ``residual_multiplier``."""
        out = _dropout(out, self.config.hidden_dropout, self.training, self.par.sequence_parallel)
        m = self.config.residual_multiplier
        return out if m is None else out * m

    def forward(self, x):
        attn = self._residual(self.attention_output_norm(self.attention(self.input_norm(x))))
        if self.config.use_parallel_residual:  # NeoX: both sublayers read x; one sum (HF's order: mlp + attn + x)
            out = self._residual(self.mlp_output_norm(self.mlp(self.post_attention_norm(x)))) + attn + x
        else:
            x = x + attn
            out = x + self._residual(self.mlp_output_norm(self.mlp(self.post_attention_norm(x))))
        return out if self.layer_scalar is None else out * self.layer_scalar.to(out.dtype)  # Gemma 4


class GPTFinalNorm(Norm):
    """The norm after the last block (its own class name, for ``type:`` partitioning)."""


def layer_specs(config: GPTConfig, par: ParallelOptions | None = None) -> list:
    """The model as DeepSpeed layer specs; the TP group is resolved here, once."""
    par = par or ParallelOptions()
    if par.tp_group is None:
        par = replace(par, tp_group=get_tensor_model_parallel_group())
    config.check_layout(group_rank_and_size(par.tp_group)[1], ep=group_rank_and_size(par.ep_group)[1])
    if par.fused_cross_entropy and config.final_logit_softcapping is not None:  # the fused loss makes raw logits
        raise ValueError("final_logit_softcapping is not supported with the fused LM head + loss; set "
                         "training.fused_cross_entropy: false")
    blocks = [LayerSpec(GPTBlock, config, par, i) for i in range(config.num_hidden_layers)]
    if config.tie_word_embeddings:
        return [
            TiedLayerSpec("embed", GPTEmbedding, config, par, tied_weight_attr="word_embeddings_weight"),
            *blocks,
            LayerSpec(GPTFinalNorm, config, par),
            TiedLayerSpec("embed", GPTEmbedding, config, par, forward_fn=lm_logits,
                          tied_weight_attr="word_embeddings_weight"),
        ]
    return [LayerSpec(GPTEmbedding, config, par), *blocks, LayerSpec(GPTFinalNorm, config, par),
            LayerSpec(GPTLMHead, config, par)]


CHECKPOINTABLE_LAYERS = ("GPTBlock",)


def _whole(weight):
    """While the fused loss runs: the LM head's weight whole on this rank. ZeRO-3 partitions it again once the model's
    forward ends, before the loss (which computes the logits) sees it; the loss computes its gradients in its own
    forward, so the backward needs no weight, and ZeRO-3 reduces the weight's gradient as any other."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    if getattr(weight, "ds_status", None) == ZeroParamStatus.NOT_AVAILABLE:
        import deepspeed

        return deepspeed.zero.GatheredParameters([weight])
    return contextlib.nullcontext()


class GPTLoss:
    """Mean next-token cross entropy over the labels that are not ``ignore_index``, from vocab-sharded logits.

    With context parallelism (``cp_group``) the labels are this rank's share, shifted before the split; the loss is
    the mean over the whole (micro-)batch's labels: every CP rank returns sum of all token losses / count of all
    labels, the same value, and its backward scales this rank's tokens by cp / count, so the gradients *averaged*
    over the CP ranks (a trainer's dp x cp average) are the gradient of that mean
    (:func:`zoo.parallel.context_parallel.context_parallel_mean`).
    """

    def __init__(self, config: GPTConfig, tp_group=None, ignore_index: int = -100, label_smoothing: float = 0.0,
                 cp_group=None):
        self.vocab_size, self.ignore_index, self.label_smoothing = config.vocab_size, ignore_index, label_smoothing
        self.tp_group = get_tensor_model_parallel_group() if tp_group is None else tp_group
        self.cp_group = cp_group

    def __call__(self, logits, labels):
        """``logits``: the vocab-sharded logits, or the head's :class:`LMHeadInputs` (fused cross entropy)."""
        if isinstance(logits, LMHeadInputs):
            weight = getattr(logits.weight, "ds_param_alias", logits.weight)  # ZeRO-3 hands out an alias
            with _whole(weight):
                total = linear_cross_entropy_sum(logits.hidden, weight, labels,
                                                 label_smoothing=self.label_smoothing, ignore_index=self.ignore_index,
                                                 vocab_size=self.vocab_size, tp_group=self.tp_group)
        else:
            total = vocab_parallel_cross_entropy(logits, labels, label_smoothing=self.label_smoothing,
                                                 ignore_index=self.ignore_index, vocab_size=self.vocab_size,
                                                 tp_group=self.tp_group).sum()
        return context_parallel_mean(total, (labels != self.ignore_index).sum(), self.cp_group)


FAMILIES = {FAMILY: GPTConfig}  # zoo.models.registry

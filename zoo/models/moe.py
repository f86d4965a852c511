"""Mixture-of-experts MLP for the GPT family: router, grouped experts, shared experts, expert-parallel dispatch.

y(x) = sum over the k chosen experts e of w_e(x) * E_e(x)  [+ sigmoid(x . g) * S(x)]   (Shazeer et al. 2017,
GShard 2006.16668, Switch 2101.03961; shared experts: DeepSeekMoE 2401.06066; the sigmoid gate: Qwen2-MoE).

Routing (``MoERouter``, all in fp32: logits = x.float() @ W.float().T):
  scores s = softmax(logits) (Mixtral, Qwen, OLMoE) or sigmoid(logits) (DeepSeek-V3).
  selection c = s + b, with b the aux-loss-free balancing bias (DeepSeek-V3, 2412.19437 Sec. 2.1.2) when
  ``moe_expert_bias``; b only chooses, it never weights. Group-limited routing (``n_group > 1``): the E experts
  form n_group groups; a group's score is the sum of its top-2 c (V3; sigmoid) or its max c (V2; softmax); the
  best ``topk_group`` groups stay, the rest are masked with -inf, then top-k of c.
  weights w = s of the chosen experts, / their sum when ``norm_topk_prob``, then x ``routed_scaling_factor``.
Losses, over the tokens of one layer call (all TP ranks together): the load-balancing loss
  aux = E * sum_e f_e P_e, f_e = (assignments to e) / (T k), P_e = mean over tokens of p_e, p = s / sum(s)
  ("global", Switch/GShard; 1 when balanced; HF's Mixtral loss is k times this, pooled over layers), or the same
  per sequence and averaged over sequences ("seq", DeepSeek-V2/V3); the z-loss mean_t logsumexp(logits_t)^2
  (ST-MoE 2202.08906). They are not added to the output: ``MoEAuxLossAutoScaler`` (Megatron-Core's) returns the
  output unchanged and, in backward, seeds ``aux_loss_scale * (router_aux_loss_coef * aux + router_z_loss_coef
  * z)`` with gradient 1, so the losses reach the router in any pipeline layout where only hidden states travel.
Capacity (``capacity_factor`` not None): each expert takes at most C = ceil(cf * T * k / E) assignments of the
  T tokens of this rank's layer call; it keeps those of highest routing weight, ties to the earlier token
  (flattened ``[b, s]`` order); a dropped assignment contributes nothing (no renormalisation; the residual carries
  the token). Default: dropless.

Interface (a drop-in for ``GPTMLP`` in ``GPTBlock`` where ``config.is_moe_layer(i)``)::

    moe = GPTMoE(config, par)           # par: ParallelOptions (tp_group, sequence_parallel, ep_group, cp_group)
    y = moe(x)                          # [b, s_local, h] -> [b, s_local, h]; s_local = s/tp with SP
    moe.aux_loss_scale = 1 / grad_accumulation_steps     # the trainer's choice; default 1.0
    moe.last_stats                      # detached, from the last call: aux_loss, z_loss, tokens_per_expert [E]
                                        # (summed over TP, CP and EP), dropped_fraction
    moe.update_expert_bias(load)        # after each optimizer step, load [E] summed over the step: b += rate *
                                        # sign(mean(load) - load); pass the same load on every rank

Parameters: ``router.weight`` [E, h] (HF ``mlp.gate.weight``), ``router.expert_bias`` [E] (a persistent fp32
buffer, HF DeepSeek ``e_score_correction_bias``), ``experts.gate_up_proj`` [E/ep, 2I, h] ([gate; up]) and
``experts.down_proj`` [E/ep, h, I] as transformers 5 holds them (GELU experts: ``experts.up_proj`` [E/ep, I, h]),
``shared_expert.gate_up_proj`` [2I_s, h], ``shared_expert.down_proj`` [h, I_s], ``shared_expert_gate.weight``
[1, h]. Expert parameters carry ``expert_parallel = True``, ``partition_dim = 0`` (their slice of the
[E, ...] tensor is the rank's experts) and ``num_experts`` (the full E). Experts are whole, never TP-sharded.

Parallelism. Tensor parallel: with sequence parallelism the tokens are already split over TP; without it the
layer keeps this TP rank's 1/tp of the flattened tokens (``scatter_to_sequence_parallel_region``) and all-gathers
the output (``tensor_parallel_output_grad=False``); a call whose b*s does not divide by tp (one-token decoding)
runs whole on every TP rank instead. Wherever tokens are split, every weight passes through
``copy_to_tensor_model_parallel_region`` (its gradient summed over TP, as zoo's ``Norm`` under SP) and the loss
statistics are summed over TP. Expert parallel (``ep_group``): rank r holds experts [r E/ep, (r+1) E/ep);
tokens sorted by expert go to their experts' ranks with one uneven ``all_to_all`` (its split sizes exchanged
first, also by ``all_to_all``), each rank runs its experts on the tokens of all source ranks, and a second
``all_to_all`` brings the results back. The trainer must not average expert gradients over the EP group (each
rank's experts already saw every EP rank's tokens) and must keep ``expert_bias`` identical on all ranks. EP
spanning TP (``par.ep_spans_tp``, Megatron-Core's "parallel folding"): the EP group holds whole TP groups (TP rank
fastest), so the TP ranks, which route different tokens, hold different experts instead of the same ones: each TP
rank's share of the tokens goes straight to the experts' ranks, and the expert weights skip the gradient sum over
TP (the all-to-all's backward brings every contribution); experts per rank drop by tp at the same ep. Context
parallel (``cp_group``): each rank holds s/cp positions of every sequence; the router's statistics are summed over
the CP group too, so the router losses are the whole sequences' on every CP rank, and their gradient is seeded cp
times (``aux_loss_scale x cp``), because the trainer averages gradients over CP (as ``GPTLoss``'s convention).
Router losses are those of this rank's layer call (its TP and CP groups' tokens); capacity is per rank.

Dispatch: the k assignments of each token are flattened, sorted by expert (stable argsort), run expert by
expert as plain matmuls (no padding), scaled by their weights and summed back per token with ``index_add`` in
fp32, then cast to the input dtype.

Notation: T tokens of this rank's layer call, E experts (E_l = E/ep local), k experts per token, I expert width,
N assignments (T k, fewer with capacity), h hidden.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from zoo.parallel.layers import init_method_normal, scaled_init_method_normal, shard_master_weight
from zoo.parallel.mappings import (
    all_to_all,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from zoo.parallel.topology import get_tensor_model_parallel_group, group_rank_and_size

if TYPE_CHECKING:
    from zoo.models.gpt import GPTConfig, ParallelOptions


def _summed_grad(w: torch.Tensor, group) -> torch.Tensor:
    """``w`` for a computation on this rank's share of the tokens: its gradient is summed over ``group``."""
    return w if group is None else copy_to_tensor_model_parallel_region(w, group)


def _sum_over(x: torch.Tensor, *groups) -> torch.Tensor:
    """Sum over each of ``groups`` (None: skipped); forward all-reduce, backward identity: every rank uses the sum
    alike."""
    for group in groups:
        if group is not None:
            x = reduce_from_tensor_model_parallel_region(x, group)
    return x


def expert_mlp(x, w1, w2, swiglu: bool):
    """One expert on its tokens ``x`` [n, h]: SwiGLU down(silu(gate x) * up x) with w1 = [gate; up] [2I, h],
    or GELU (tanh) w2 gelu(w1 x) with w1 [I, h]; w2 [h, I]."""
    a = F.linear(x, w1)
    if swiglu:
        gate, up = a.chunk(2, dim=-1)
        a = F.silu(gate) * up
    else:
        a = F.gelu(a, approximate="tanh")
    return F.linear(a, w2)


class Routing(NamedTuple):
    """The router's decision for T tokens, and the losses and load of the whole layer call. A named tuple, so that
    ZeRO-3 sees its tensors and gathers the router's weight again for their backward."""

    indices: torch.Tensor  # [T, k] chosen experts
    weights: torch.Tensor  # [T, k] fp32 combine weights
    aux_loss: torch.Tensor  # scalar fp32, not yet times its coefficient
    z_loss: torch.Tensor  # scalar fp32
    tokens_per_expert: torch.Tensor  # [E] assignments before any capacity drop, over the token group


class MoERouter(nn.Module):
    """Scores, top-k selection and the balancing statistics (see the module docstring for the formulas)."""

    def __init__(self, config: GPTConfig, init_method):
        super().__init__()
        E, h = config.num_experts, config.hidden_size
        self.num_experts, self.top_k = E, config.num_experts_per_tok
        self.scoring_func, self.norm_topk_prob = config.scoring_func, config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.aux_loss_type = config.router_aux_loss_type
        self.bias_update_rate = config.expert_bias_update_rate
        self.weight = nn.Parameter(torch.empty(E, h))
        init_method(self.weight.data)
        if config.moe_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(E, dtype=torch.float32))
        else:
            self.expert_bias = None

    def _apply(self, fn, recurse=True):
        # A model cast to bf16 keeps the balancing bias in fp32: its steps (1e-3) would vanish in bf16.
        bias = self.expert_bias
        out = super()._apply(fn, recurse)
        if bias is not None and self.expert_bias.dtype != torch.float32:
            self.expert_bias = bias.to(self.expert_bias.device)
        return out

    def _select(self, scores: torch.Tensor) -> torch.Tensor:
        """Chosen experts [T, k] from the scores [T, E]: bias added, groups limited, then top-k."""
        choice = scores if self.expert_bias is None else scores + self.expert_bias
        if self.n_group > 1:
            T, per = choice.shape[0], self.num_experts // self.n_group
            grouped = choice.view(T, self.n_group, per)  # [T, G, E/G]
            if self.scoring_func == "sigmoid":
                group_scores = grouped.topk(min(2, per), dim=-1).values.sum(-1)  # [T, G]
            else:
                group_scores = grouped.max(dim=-1).values
            best = group_scores.topk(self.topk_group, dim=-1).indices  # [T, topk_group]
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)  # [T, G]
            choice = grouped.masked_fill(~keep[:, :, None], float("-inf")).view(T, -1)  # [T, E]
        return choice.topk(self.top_k, dim=-1).indices

    def forward(self, x: torch.Tensor, seq_ids: torch.Tensor, num_seqs: int, token_group=None,
                context_group=None) -> Routing:
        """x: [T, h] tokens; seq_ids: [T] the sequence (< num_seqs) of each token, for the "seq" loss.
        ``token_group``: the group this layer call's tokens are split over (weight gradient and statistics are
        summed over it); None when all of them are here. ``context_group``: the CP group holding the sequences'
        other positions: statistics are summed over it too, the gradient is not (the trainer averages it over CP,
        as the language-model loss's)."""
        E, k, T = self.num_experts, self.top_k, x.shape[0]
        logits = F.linear(x.float(), _summed_grad(self.weight, token_group).float())  # [T, E]
        if self.scoring_func == "sigmoid":
            scores = logits.sigmoid()
            probs = scores / scores.sum(-1, keepdim=True)
        else:
            scores = probs = logits.softmax(dim=-1)
        with torch.no_grad():
            indices = self._select(scores)  # [T, k]
        weights = scores.gather(1, indices)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights * self.routed_scaling_factor

        # Per-sequence tables: [b, E] assignment counts and token count (no gradient); [b, E] probability sums
        # and [b, 1] sums of logsumexp^2 (with gradient). Summed over the token group, they describe the call.
        with torch.no_grad():
            counts = torch.zeros(num_seqs, E + 1, device=x.device)
            counts.index_put_((seq_ids.repeat_interleave(k), indices.reshape(-1)), torch.ones(T * k, device=x.device),
                              accumulate=True)
            counts[:, E] = torch.bincount(seq_ids, minlength=num_seqs).float()
            counts = _sum_over(counts, token_group, context_group)
        sums = torch.cat([probs, logits.logsumexp(-1, keepdim=True).square()], dim=1)  # [T, E + 1]
        sums = _sum_over(torch.zeros(num_seqs, E + 1, device=x.device).index_add(0, seq_ids, sums), token_group,
                         context_group)
        assigned, tokens = counts[:, :E], counts[:, E].clamp(min=1)  # [b, E], [b]
        if self.aux_loss_type == "global":
            aux = E * (assigned.sum(0) / (tokens.sum() * k) * sums[:, :E].sum(0) / tokens.sum()).sum()
        else:
            aux = (E * (assigned / (tokens[:, None] * k) * sums[:, :E] / tokens[:, None]).sum(-1)).mean()
        z = sums[:, E].sum() / tokens.sum()
        return Routing(indices, weights, aux, z, assigned.sum(0))

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: torch.Tensor) -> None:
        if self.expert_bias is None:
            raise ValueError("update_expert_bias needs a config with moe_expert_bias=True")
        load = tokens_per_expert.to(device=self.expert_bias.device, dtype=torch.float32)
        self.expert_bias += self.bias_update_rate * torch.sign(load.mean() - load)


def _expert_param(local: torch.Tensor, num_experts: int) -> nn.Parameter:
    p = nn.Parameter(local)
    p.expert_parallel, p.partition_dim, p.num_experts = True, 0, num_experts
    return p


class GroupedExperts(nn.Module):
    """This rank's experts [first, first + E_l), their weights fused along a leading expert dimension.

    The full [E, ...] master weights are drawn from the current RNG state and this rank's experts sliced out, so
    a layer built at ep=N with a seed holds the ep=1 layer's experts with that seed.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, swiglu: bool, ep_rank: int = 0,
                 ep_size: int = 1, init_method, output_init_method):
        super().__init__()
        E, h, I = num_experts, hidden_size, intermediate_size
        if E % ep_size:
            raise ValueError(f"num_experts {E} is not divisible by ep {ep_size}; use an ep that divides it")
        self.num_local_experts = E // ep_size
        self.first_expert = ep_rank * self.num_local_experts
        self.swiglu = swiglu
        w1 = torch.empty(E, 2 * I if swiglu else I, h)
        init_method(w1)
        w2 = torch.empty(E, h, I)
        output_init_method(w2)
        self.w1_name = "gate_up_proj" if swiglu else "up_proj"
        # a copy of this rank's experts at ep > 1, not a view that would keep all E of them alive on every rank
        self.register_parameter(self.w1_name, _expert_param(shard_master_weight(w1, 0, ep_rank, ep_size), E))
        self.down_proj = _expert_param(shard_master_weight(w2, 0, ep_rank, ep_size), E)

    def forward(self, x: torch.Tensor, counts: list[int], token_group=None) -> torch.Tensor:
        """x: [N, h], sorted by local expert, counts[e] rows for expert e -> [N, h] in the same order."""
        w1 = _summed_grad(getattr(self, self.w1_name), token_group)
        w2 = _summed_grad(self.down_proj, token_group)
        # Every expert runs, even on no rows: the graph (and so the backward collectives) is the same on all ranks.
        return torch.cat([expert_mlp(chunk, w1[e], w2[e], self.swiglu)
                          for e, chunk in enumerate(x.split(counts))], dim=0)


class SharedExpert(nn.Module):
    """The always-on expert(s): one MLP of width I_s = num_shared_experts * I (or shared_expert_intermediate_size)."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, swiglu: bool, init_method, output_init_method):
        super().__init__()
        self.swiglu = swiglu
        self.gate_up_proj = nn.Parameter(torch.empty(2 * intermediate_size if swiglu else intermediate_size,
                                                     hidden_size))
        init_method(self.gate_up_proj.data)
        self.down_proj = nn.Parameter(torch.empty(hidden_size, intermediate_size))
        output_init_method(self.down_proj.data)

    def forward(self, x, token_group=None):
        return expert_mlp(x, _summed_grad(self.gate_up_proj, token_group), _summed_grad(self.down_proj, token_group),
                          self.swiglu)


class SharedExpertGate(nn.Linear):
    """Qwen2-MoE's sigmoid gate logit of the shared expert, x . g, for this rank's share of the tokens. Called as a
    module (not its weight read from outside it), so that ZeRO-3 gathers the weight for its forward and backward."""

    def forward(self, x, token_group=None):
        return F.linear(x, _summed_grad(self.weight, token_group))


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """Forward: the output, unchanged. Backward: the output's gradient, and ``scale`` as the gradient of the
    (coefficient-weighted) router loss, which thus joins the backward pass without being added to any loss."""

    @staticmethod
    def forward(ctx, output, aux_loss, scale: float):
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx, grad):
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.full_like(aux_loss, ctx.scale), None


def capacity_keep(experts: torch.Tensor, weights: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """Which of N flattened assignments (token-major: token t's k choices at t*k ... t*k + k-1) an expert with
    room for ``capacity`` keeps: its highest weights first, ties to the earlier token. -> bool [N]."""
    n = experts.shape[0]
    by_weight = torch.argsort(weights, descending=True, stable=True)
    order = by_weight[torch.argsort(experts[by_weight], stable=True)]  # by expert, then weight, then token
    counts = torch.bincount(experts, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts
    place = torch.arange(n, device=experts.device) - starts[experts[order]]  # rank within its expert
    keep = torch.zeros(n, dtype=torch.bool, device=experts.device)
    keep[order] = place < capacity
    return keep


class GPTMoE(nn.Module):
    """Router + experts (+ shared expert and its gate); ``[b, s_local, h]`` in and out. See the module docstring."""

    def __init__(self, config: GPTConfig, par: ParallelOptions, output_init=None):
        super().__init__()
        self.config = config
        self.tp_group = get_tensor_model_parallel_group() if par.tp_group is None else par.tp_group
        self.ep_group, self.cp_group = par.ep_group, par.cp_group
        self.cp_world_size = group_rank_and_size(self.cp_group)[1]
        self.tp_rank, self.tp_world_size = group_rank_and_size(self.tp_group)
        self.ep_rank, self.ep_world_size = group_rank_and_size(self.ep_group)
        # EP spanning TP: the ranks of a TP group hold different experts, which see their tokens through the
        # all-to-all alone (no gradient sum over TP); the tp x (ep / tp) EP ranks count each token tp times.
        self.ep_spans_tp = par.ep_spans_tp and self.tp_world_size > 1 and self.ep_world_size > 1
        if self.ep_spans_tp and self.ep_world_size % self.tp_world_size:
            raise ValueError(f"an EP group spanning TP needs ep ({self.ep_world_size}) a multiple of tp "
                             f"({self.tp_world_size})")
        self.sequence_parallel = par.sequence_parallel
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        init = init_method_normal(config.initializer_range)
        output_init = output_init or scaled_init_method_normal(config.initializer_range, config.num_hidden_layers)
        swiglu = config.activation == "swiglu"
        self.router = MoERouter(config, init)
        self.experts = GroupedExperts(config.num_experts, config.hidden_size, config.expert_intermediate_size,
                                      swiglu=swiglu, ep_rank=self.ep_rank, ep_size=self.ep_world_size,
                                      init_method=init, output_init_method=output_init)
        if self.ep_spans_tp:  # DeepSpeed's norms count a parameter on every TP rank only if it is model-parallel
            for p in self.experts.parameters():
                p.model_parallel = True
        self.shared_expert = self.shared_expert_gate = None
        if config.num_shared_experts:
            self.shared_expert = SharedExpert(config.hidden_size, config.shared_intermediate_size, swiglu=swiglu,
                                              init_method=init, output_init_method=output_init)
            if config.shared_expert_gate:
                self.shared_expert_gate = SharedExpertGate(config.hidden_size, 1, bias=False)
                init(self.shared_expert_gate.weight.data)
        self.aux_loss_scale = 1.0
        self.last_stats: dict[str, torch.Tensor] = {}

    def update_expert_bias(self, tokens_per_expert: torch.Tensor) -> None:
        """DeepSeek-V3's balancing step: b += expert_bias_update_rate * sign(mean(load) - load), load [E]."""
        self.router.update_expert_bias(tokens_per_expert)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        tp = self.tp_world_size
        split = tp > 1 and (self.sequence_parallel or (b * s) % tp == 0)
        group = self.tp_group if split else None  # the group this call's tokens are split over
        tokens = x.reshape(1, b * s, h)
        offset = 0
        if split and not self.sequence_parallel:
            tokens = scatter_to_sequence_parallel_region(tokens, self.tp_group)  # [1, b*s/tp, h]
            offset = self.tp_rank * tokens.shape[1]
        tokens = tokens[0]  # [T, h]
        T = tokens.shape[0]
        seq_ids = torch.div(torch.arange(offset, offset + T, device=x.device), s, rounding_mode="floor")

        route = self.router(tokens, seq_ids, b, group, self.cp_group)
        y, kept = self._routed(tokens, route, group)
        if self.shared_expert is not None:
            shared = self.shared_expert(tokens, group)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(tokens, group)) * shared
            y = y + shared
        y = y.view(1, T, h)
        if split and not self.sequence_parallel:
            y = gather_from_sequence_parallel_region(y, self.tp_group, tensor_parallel_output_grad=False)
        y = y.view(b, s, h)

        cfg = self.config
        loss = cfg.router_aux_loss_coef * route.aux_loss + cfg.router_z_loss_coef * route.z_loss
        if torch.is_grad_enabled() and (cfg.router_aux_loss_coef or cfg.router_z_loss_coef):
            # Under CP each rank's share of the router losses' gradient is one of cp that the trainer averages.
            y = MoEAuxLossAutoScaler.apply(y, loss, float(self.aux_loss_scale) * self.cp_world_size)
        with torch.no_grad():  # load and drops of the whole call: over TP (where split), CP and EP
            drops = _sum_over(torch.tensor([T * self.top_k - kept, T * self.top_k], dtype=torch.float32,
                                           device=x.device), group, self.cp_group)
            load = torch.cat([route.tokens_per_expert, drops])  # the router's counts are already over TP and CP
            load = _sum_over(load, self.ep_group if self.ep_world_size > 1 else None)
            if self.ep_spans_tp:  # the EP group held each replica's (TP-summed) load once per TP rank
                load = load / self.tp_world_size
        self.last_stats = dict(aux_loss=route.aux_loss.detach(), z_loss=route.z_loss.detach(),
                               tokens_per_expert=load[: self.num_experts], dropped_fraction=load[-2] / load[-1])
        return y

    @torch.compiler.disable
    def _routed(self, tokens: torch.Tensor, route: Routing, group):
        """sum_k w_k E_k(x) for the T tokens [T, h] -> ([T, h] in tokens' dtype, number of kept assignments)."""
        T, k, E = tokens.shape[0], self.top_k, self.num_experts
        experts = route.indices.reshape(-1)  # [T k], token-major
        weights = route.weights.reshape(-1)
        token_of = torch.arange(T, device=tokens.device).repeat_interleave(k)
        if self.config.capacity_factor is not None:
            capacity = math.ceil(self.config.capacity_factor * T * k / E)
            keep = capacity_keep(experts, weights.detach(), E, capacity)
            experts, weights, token_of = experts[keep], weights[keep], token_of[keep]
        order = torch.argsort(experts, stable=True)  # [N], grouped by expert
        experts, weights, token_of = experts[order], weights[order], token_of[order]
        counts = torch.bincount(experts, minlength=E)  # [E] rows per expert, in expert order
        out = self._run_experts(tokens[token_of], counts, group)  # [N, h]
        combined = torch.zeros(T, tokens.shape[1], dtype=torch.float32, device=tokens.device)
        combined = combined.index_add(0, token_of, out.float() * weights[:, None])
        return combined.to(tokens.dtype), experts.shape[0]

    def _run_experts(self, x: torch.Tensor, counts: torch.Tensor, group) -> torch.Tensor:
        """x: [N, h] sorted by expert, counts [E] -> each row through its expert, [N, h] in the same order."""
        ep, E_l = self.ep_world_size, self.experts.num_local_experts
        if ep == 1:
            return self.experts(x, counts.tolist(), group)
        if self.ep_spans_tp:  # these experts differ from the other TP ranks': their gradient is not summed over TP
            group = None
        counts = counts.view(ep, E_l)  # [destination rank, its local expert]
        recv_counts = all_to_all(counts, [1] * ep, [1] * ep, self.ep_group)  # [source rank, my local expert]
        send_splits, recv_splits = counts.sum(1).tolist(), recv_counts.sum(1).tolist()
        received = all_to_all(x, recv_splits, send_splits, self.ep_group)  # [N_recv, h]: by source, then expert
        local_expert = torch.arange(E_l, device=x.device).repeat(ep).repeat_interleave(recv_counts.reshape(-1))
        by_expert = torch.argsort(local_expert, stable=True)  # [N_recv]: by expert, then source
        out = self.experts(received[by_expert], recv_counts.sum(0).tolist(), group)
        out = out[torch.argsort(by_expert)]  # back to (source, expert) order
        return all_to_all(out, send_splits, recv_splits, self.ep_group)  # [N, h], x's order

"""The models a GPT benchmark compares: zoo's GPT and the ``transformers`` model of the same shape (GPT-2,
Llama or Mixtral style), their configs from the command line's flags, each wrapped as a :class:`Trainee` that owns
its AdamW and times its own training step.
"""

from __future__ import annotations

import time

import torch

STYLES = ("gpt2", "llama", "moe")  # "both": gpt2 and llama
# The CPU-sized default model (both styles): under a minute for everything on 2 idle cores, a few when shared.
DEFAULT_SIZE = dict(hidden_size=256, layers=4, heads=4, seq_length=256, batch_size=4, vocab_size=8192)
DEFAULT_EXPERTS, DEFAULT_EXPERTS_PER_TOKEN = 8, 2
PRESET_SEQ_LENGTH, PRESET_BATCH_SIZE = 1024, 8


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


def batch_shape(args, cfg) -> tuple[int, int]:
    """``(sequences, tokens per sequence)`` of the benchmark's batch: the flags, else the defaults of its size."""
    if args.preset is None:
        return args.batch_size or DEFAULT_SIZE["batch_size"], args.seq_length or DEFAULT_SIZE["seq_length"]
    return args.batch_size or PRESET_BATCH_SIZE, args.seq_length or min(PRESET_SEQ_LENGTH, cfg.max_position_embeddings)


def token_batch(cfg, b: int, s: int, seed: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, labels)`` ``[b, s]`` each: one seeded random sequence of ``s + 1`` tokens per row, the labels the
    next tokens (so no shift inside either model's loss)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (b, s + 1), generator=g).to(device)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


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

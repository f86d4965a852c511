"""Rotary position embeddings (RoPE, Su et al. 2021) of zoo's GPT: frequencies, tables and their application.

The settings are ``GPTConfig`` fields (HF names): ``rope_theta``, ``rope_scaling`` (``rope_type`` linear, llama3,
yarn or longrope, with that type's keys as transformers 5's ``rope_parameters`` hold them), ``partial_rotary_factor``
(only the first ``int(head_dim * factor)`` features of each head rotate, the rest pass: Phi-3, NeoX), and per layer
``no_rope_layers`` (SmolLM3: 0 marks a layer without positions, NoPE) and ``rope_local_base_freq`` (Gemma 3: the
sliding-window layers use plain RoPE with this theta, the full ones ``rope_theta`` with its scaling).

Types, as transformers' ``ROPE_INIT_FUNCTIONS`` compute them (the tests compare the frequencies):

- linear (Chen et al. 2023): frequencies divided by ``factor``;
- llama3: long wavelengths slowed by ``factor``, short ones kept, a smooth blend in between;
- yarn (Peng et al. 2023): interpolated and extrapolated frequencies blended over a ramp of dimensions
  (``beta_fast``/``beta_slow``, ``truncate``), cos and sin times the attention factor (``attention_factor``, else
  from ``factor``, ``mscale``, ``mscale_all_dim``);
- longrope (Phi-3): per-frequency ``short_factor`` while the sequence fits ``original_max_position_embeddings``,
  ``long_factor`` beyond it; cos and sin times its attention factor. Which set a forward uses follows the sequence
  length (the largest position + 1), so a generation crossing the switch re-encodes its prefix with the long set
  (``switch_length``; :class:`zoo.models.generate.Generator` does it, as transformers' Phi-3 does);
- proportional (Gemma 4's full-attention layers): the plain frequencies of the whole head, of which only the first
  ``int(partial_rotary_factor * d / 2)`` turn (the others are 0: those features pass), divided by ``factor``;
- dynamic (NTK) is refused: its frequencies change with every length a forward sees.

Every table is ``[n, rotary_dim]`` (rotate-half layout, as HF Llama), computed once per settings, length, device and
dtype and shared by the layers that use it. Context parallelism indexes it with the global positions of a rank's
tokens (``ParallelOptions.global_positions``), so every layout encodes a token alike.
"""

from __future__ import annotations

import math

import torch

ROPE_TYPES = ("linear", "llama3", "yarn", "longrope", "proportional")  # rope_scaling's rope_type; None: plain RoPE
_REQUIRED = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                               "original_max_position_embeddings"),
             "yarn": ("factor", "original_max_position_embeddings"),
             "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
             "proportional": ()}
_OPTIONAL = {"linear": (), "llama3": (), "yarn": ("attention_factor", "beta_fast", "beta_slow", "mscale",
                                                  "mscale_all_dim", "truncate"),
             "longrope": ("factor", "attention_factor"),
             "proportional": ("factor", "partial_rotary_factor")}


def rope_kind(scaling: dict | None) -> str | None:
    return None if scaling is None else scaling.get("rope_type", scaling.get("type"))


def rotary_dim(config) -> int:
    """The features of each head that rotate: ``int(head_dim * partial_rotary_factor)`` (HF's rule)."""
    return int(config.head_dim * config.partial_rotary_factor)


def validate_rope(config, need) -> None:
    """One line per problem with the RoPE fields (called by ``GPTConfig.validate``)."""
    f = config.partial_rotary_factor
    need(isinstance(f, (int, float)) and not isinstance(f, bool) and 0 < f <= 1,
         f"partial_rotary_factor must be in (0, 1], got {f!r}")
    if config.position_embedding_type == "rope":
        need(rotary_dim(config) % 2 == 0 and rotary_dim(config) > 0,
             f"RoPE needs an even rotary dim, got int(head_dim {config.head_dim} * partial_rotary_factor {f}) = "
             f"{rotary_dim(config)}")
    layers = config.no_rope_layers
    need(layers is None or (isinstance(layers, list) and len(layers) == config.num_hidden_layers
                            and all(v in (0, 1) for v in layers)),
         f"no_rope_layers must list 1 (RoPE) or 0 (NoPE) per layer ({config.num_hidden_layers}), got {layers!r}")
    base = config.rope_local_base_freq
    need(base is None or (isinstance(base, (int, float)) and not isinstance(base, bool) and base > 0),
         f"rope_local_base_freq must be a positive number or null, got {base!r}")
    scaling = config.rope_scaling
    if scaling is None:
        return
    kind = rope_kind(scaling)
    if kind == "dynamic":
        need(False, "rope_scaling type 'dynamic' is not supported (its frequencies change with each length a "
                    "forward sees); use 'yarn' or 'linear'")
    need(kind in ROPE_TYPES, f"rope_scaling type must be one of {list(ROPE_TYPES)}, got {kind!r}")
    missing = [k for k in _REQUIRED[kind] if scaling.get(k) is None and not (kind == "yarn" and k == "factor")]
    need(not missing, f"rope_scaling {kind!r} needs {missing}")
    unknown = sorted(set(scaling) - {"rope_type", "type", *_REQUIRED[kind], *_OPTIONAL[kind]})
    need(not unknown, f"rope_scaling {kind!r} has unknown keys {unknown}")
    if kind == "longrope":
        half = rotary_dim(config) // 2
        need(len(scaling["short_factor"]) == half and len(scaling["long_factor"]) == half,
             f"rope_scaling longrope: short_factor and long_factor need rotary_dim / 2 = {half} values each")


def layer_rope(config, layer_idx: int) -> tuple[float, dict | None] | None:
    """``(theta, scaling)`` of layer ``layer_idx``, or None where it has no RoPE (learned positions, NoPE)."""
    if config.position_embedding_type != "rope":
        return None
    if config.no_rope_layers is not None and not config.no_rope_layers[layer_idx]:
        return None
    if config.rope_local_base_freq is not None and config.attention_window(layer_idx) is not None:
        return float(config.rope_local_base_freq), None  # Gemma 3's local layers: plain RoPE, their own theta
    return float(config.rope_theta), config.rope_scaling


def _original_length(scaling: dict) -> int:
    return int(scaling["original_max_position_embeddings"])


def switch_length(config, layer_idx: int | None = None) -> int | None:
    """Longrope: the longest sequence encoded with ``short_factor`` (longer ones use ``long_factor``); else None."""
    layers = range(config.num_hidden_layers) if layer_idx is None else [layer_idx]
    for i in layers:
        spec = layer_rope(config, i)
        if spec is not None and rope_kind(spec[1]) == "longrope":
            return _original_length(spec[1])
    return None


def _yarn_factor(config, scaling: dict) -> float:
    factor = scaling.get("factor")
    return config.max_position_embeddings / _original_length(scaling) if factor is None else float(factor)


def _mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def attention_factor(config, layer_idx: int = 0) -> float:
    """The factor cos and sin are multiplied by (yarn, longrope; 1 for the other types)."""
    spec = layer_rope(config, layer_idx)
    scaling = None if spec is None else spec[1]
    kind = rope_kind(scaling)
    if kind not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    if kind == "yarn":
        factor = _yarn_factor(config, scaling)
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        return float(_mscale(factor, m) / _mscale(factor, m_all)) if m and m_all else _mscale(factor)
    old = _original_length(scaling)
    factor = scaling.get("factor")
    factor = config.max_position_embeddings / old if factor is None else float(factor)
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old))


def rope_inv_freq(config, layer_idx: int = 0, seq_len: int | None = None) -> torch.Tensor:
    """The ``rotary_dim / 2`` inverse frequencies (float32) of layer ``layer_idx``'s RoPE for a sequence of
    ``seq_len`` positions (only longrope depends on it: ``long_factor`` past ``original_max_position_embeddings``)."""
    spec = layer_rope(config, layer_idx)
    if spec is None:
        raise ValueError(f"layer {layer_idx} has no RoPE (learned positions or a NoPE layer)")
    theta, scaling = spec
    d = rotary_dim(config)
    exponents = torch.arange(0, d, 2, dtype=torch.float64) / d
    inv_freq = 1.0 / (theta ** exponents)
    kind = rope_kind(scaling)
    if kind is None:
        return inv_freq.float()
    if kind == "linear":
        return (inv_freq / float(scaling["factor"])).float()
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(_original_length(scaling))
        wavelen = 2 * math.pi / inv_freq
        smooth = ((old_len / wavelen - low) / (high - low)).clamp(0.0, 1.0)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        out = torch.where(wavelen > old_len / low, inv_freq / factor, blended)
        return torch.where(wavelen < old_len / high, inv_freq, out).float()
    if kind == "yarn":
        return _yarn_inv_freq(config, scaling, theta, inv_freq).float()
    if kind == "proportional":  # Gemma 4: the first fraction of the d/2 frequencies turn, the rest are 0 (pass)
        turning = int(float(scaling.get("partial_rotary_factor", 1.0)) * d // 2)
        inv_freq[turning:] = 0.0
        return (inv_freq / float(scaling.get("factor", 1.0))).float()
    # longrope: one factor per frequency, the long set once the sequence outgrows the original length
    long = seq_len is not None and seq_len > _original_length(scaling)
    ext = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float64)
    return (inv_freq / ext).float()


def _yarn_inv_freq(config, scaling: dict, theta: float, inv_freq: torch.Tensor) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than ``beta_slow`` times over the original length are interpolated
    (divided by factor), those turning more than ``beta_fast`` times kept, a linear ramp over the dims between."""
    d = rotary_dim(config)
    factor, old = _yarn_factor(config, scaling), _original_length(scaling)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_of(rotations):  # the dimension whose frequency turns `rotations` times over the original length
        return d * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    return inv_freq / factor * (1 - keep) + inv_freq * keep


_ROPE_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _frozen(value):
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value


def rope_table(config, length: int, device, dtype: torch.dtype, layer_idx: int = 0):
    """cos, sin ``[n, rotary_dim]`` of layer ``layer_idx`` for positions ``0 .. n-1``,
    ``n = max(length, max_position_embeddings)``, for a sequence of ``length`` positions (longrope picks its factor
    set by it); the d/2 frequencies repeated (rotate-half layout, as HF Llama), times the attention factor.

    Computed once per (frequencies, n, device, dtype) and shared by every layer, instead of once per layer and step.
    Built outside inference mode, so a table first made during generation can still be saved for backward later.
    """
    n = max(length, config.max_position_embeddings)
    theta, scaling = layer_rope(config, layer_idx)
    long = None
    if rope_kind(scaling) == "longrope":
        long = length > _original_length(scaling)
    key = (rotary_dim(config), theta, _frozen(scaling), long, config.max_position_embeddings, n,
           torch.device(device), dtype)
    table = _ROPE_TABLES.get(key)
    if table is None:
        with torch.inference_mode(False), torch.no_grad():
            inv_freq = rope_inv_freq(config, layer_idx, seq_len=length).to(device)
            freqs = torch.outer(torch.arange(n, device=device).float(), inv_freq)  # [n, d/2]
            emb = torch.cat((freqs, freqs), dim=-1)  # [n, d]
            cos, sin = emb.cos(), emb.sin()
            scale = attention_factor(config, layer_idx)
            if scale != 1.0:
                cos, sin = cos * scale, sin * scale
            table = cos.to(dtype), sin.to(dtype)
        if len(_ROPE_TABLES) >= 16:  # a handful of (device, dtype) pairs in practice; never grow without bound
            _ROPE_TABLES.clear()
        _ROPE_TABLES[key] = table
    return table


def apply_rope(x, cos, sin):
    """x: [b, n, s, d]; cos, sin: [s, r] or [b, 1, s, r], r <= d. Rotates pairs (x_i, x_{i+r/2}) of the first r
    features by the position's angle; features r.. pass unchanged (partial rotary)."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :r], cos, sin), x[..., r:]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin

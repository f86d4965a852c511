"""DDPM: noise schedule, training batches, ancestral sampling (Ho et al. 2020, arXiv 2006.11239, Algorithms 1 and 2)."""

from __future__ import annotations

from collections.abc import Callable

import torch

# Sampling steps when none are asked for, of DDPM's 1000: in 50 the tiny run's model skews every image green/yellow;
# in 250, ~12 s for 16 images on 2 cores, the backgrounds take the data's hues.
DDPM_SAMPLE_STEPS = 250


class DDPMSchedule:
    """Linear betas from ``beta_start`` to ``beta_end`` over ``num_train_timesteps`` steps (diffusers' DDPMScheduler
    defaults); ``alphas_cumprod[t]`` = prod_{s<=t} (1 - beta_s), fp32."""

    def __init__(self, num_train_timesteps: int = 1000, beta_start: float = 1e-4, beta_end: float = 0.02,
                 clip_sample: bool = True):
        self.num_train_timesteps, self.clip_sample = num_train_timesteps, clip_sample
        self.beta_start, self.beta_end = beta_start, beta_end
        self.betas = torch.linspace(beta_start, beta_end, num_train_timesteps, dtype=torch.float32)
        self.alphas_cumprod = torch.cumprod(1.0 - self.betas, dim=0)

    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """q(x_t | x_0): sqrt(abar_t) x_0 + sqrt(1 - abar_t) noise, per sample (``t`` is ``[b]``)."""
        abar = self.alphas_cumprod.to(x0.device)[t].to(x0.dtype).view(-1, *([1] * (x0.dim() - 1)))
        return abar.sqrt() * x0 + (1 - abar).sqrt() * noise

    def training_batch(self, x0: torch.Tensor, generator: torch.Generator | None = None, *,
                       seeds: list[int] | None = None):
        """``((x_t, t), noise)`` for clean images ``x0 [b, C, H, W]`` in [-1, 1]: t uniform in [0, T), noise N(0, I).
        The pipeline's input and label.

        Drawn from ``generator`` for the whole batch, or with ``seeds`` (one per sample, e.g. its global index in
        the run) each sample from its own generator, so a sample's noise is the same however the global batch is
        cut into micro-batches and data-parallel ranks.
        """
        gens = _per_sample_generators(x0, generator, seeds)
        if gens is None:
            t = torch.randint(0, self.num_train_timesteps, (x0.shape[0],), generator=generator)
            noise = torch.randn(x0.shape, generator=generator, dtype=x0.dtype)
        else:
            t = torch.cat([torch.randint(0, self.num_train_timesteps, (1,), generator=g) for g in gens])
            noise = torch.stack([torch.randn(x0.shape[1:], generator=g, dtype=x0.dtype) for g in gens])
        noise = noise.to(x0.device)
        return (self.add_noise(x0, noise, t.to(x0.device)), t.to(x0.device)), noise

    def timesteps(self, num_inference_steps: int | None = None) -> list[int]:
        """Sampling timesteps, descending; every ``T // n``-th from 0 ("leading" spacing, as diffusers)."""
        n = num_inference_steps or self.num_train_timesteps
        if not 1 <= n <= self.num_train_timesteps:
            raise ValueError(f"num_inference_steps must be in [1, {self.num_train_timesteps}], got {n}")
        ratio = self.num_train_timesteps // n
        return [k * ratio for k in reversed(range(n))]

    def to_diffusers(self) -> dict:
        """The diffusers ``DDPMScheduler`` config of this schedule (what ``scheduler_config.json`` holds)."""
        return {"_class_name": "DDPMScheduler", "num_train_timesteps": self.num_train_timesteps,
                "beta_start": self.beta_start, "beta_end": self.beta_end, "beta_schedule": "linear",
                "variance_type": "fixed_small", "clip_sample": self.clip_sample, "prediction_type": "epsilon"}

    def sample(self, model_fn, shape, *, seed: int, num_inference_steps: int | None = None, device="cpu",
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return ddpm_sample(model_fn, shape, seed=seed, schedule=self, num_inference_steps=num_inference_steps,
                           device=device, dtype=dtype)

    def step(self, eps: torch.Tensor, t: int, prev_t: int, x_t: torch.Tensor, noise: torch.Tensor | None):
        """x_{t-1} (or x at ``prev_t``) from x_t and the predicted noise: the posterior mean given the predicted
        (clipped) x_0, plus sqrt(beta~_t) ``noise`` (DDPM's "fixed small" variance) when t > 0."""
        abar_t = self.alphas_cumprod[t]
        abar_prev = self.alphas_cumprod[prev_t] if prev_t >= 0 else torch.tensor(1.0)
        alpha_t = abar_t / abar_prev  # 1 - beta_t (over the stride from prev_t to t)
        beta_t = 1 - alpha_t
        x0 = (x_t - (1 - abar_t) ** 0.5 * eps) / abar_t ** 0.5  # Eq. 15
        if self.clip_sample:
            x0 = x0.clamp(-1.0, 1.0)
        mean = (abar_prev ** 0.5 * beta_t / (1 - abar_t)) * x0 + (alpha_t ** 0.5 * (1 - abar_prev) / (1 - abar_t)) * x_t
        if t == 0 or noise is None:
            return mean
        variance = ((1 - abar_prev) / (1 - abar_t) * beta_t).clamp(min=1e-20)
        return mean + variance ** 0.5 * noise


@torch.no_grad()
def ddpm_sample(model_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], shape: tuple[int, ...], *,
                seed: int, schedule: DDPMSchedule | None = None, num_inference_steps: int | None = None,
                device="cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Ancestral sampling (DDPM Algorithm 2): x_T ~ N(0, I), then x_{t-1} from ``model_fn(x_t, t [b]) -> eps``.

    Deterministic given ``seed``: x_T and every step's noise come from one CPU generator, in diffusers'
    DDPMPipeline order, so the same seed gives the same images (and the same as diffusers with
    ``torch.Generator().manual_seed(seed)``). Returns x_0 in [-1, 1] ``shape``; ``(x + 1) / 2`` maps it to [0, 1].
    Under TP every rank runs the same loop with the same seed; with pipelines ``model_fn`` wraps
    ``zoo.parallel.pipe_forward.pipeline_forward``.
    """
    schedule = schedule or DDPMSchedule()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=dtype).to(device)
    steps = schedule.timesteps(num_inference_steps)
    ratio = schedule.num_train_timesteps // len(steps)
    for t in steps:
        eps = model_fn(x, torch.full((shape[0],), t, dtype=torch.long, device=device)).to(dtype)
        noise = torch.randn(shape, generator=g, dtype=dtype).to(device) if t > 0 else None
        x = schedule.step(eps, t, t - ratio, x, noise)
    return x


def _per_sample_generators(x0: torch.Tensor, generator, seeds) -> list[torch.Generator] | None:
    """None to draw the batch from ``generator``, else one generator per sample seeded from ``seeds``."""
    if (generator is None) == (seeds is None):
        raise ValueError("training_batch: pass either a generator or one seed per sample")
    if seeds is None:
        return None
    if len(seeds) != x0.shape[0]:
        raise ValueError(f"training_batch: {len(seeds)} seeds for {x0.shape[0]} samples")
    return [torch.Generator().manual_seed(int(s)) for s in seeds]

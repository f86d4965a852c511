"""Flow matching: straight paths from data to noise, velocity prediction, Euler sampling."""

from __future__ import annotations

from collections.abc import Callable

import torch

from zoo.models.unet.ddpm import _per_sample_generators

FLOW_SAMPLE_STEPS = 50  # Euler steps when none are asked for, as diffusers' default


class FlowMatchSchedule:
    """Flow matching on straight paths (Lipman et al. 2023, arXiv 2210.02747; rectified flow, Liu et al. 2023), as
    Stable Diffusion 3 trains it (Esser et al. 2024, arXiv 2403.03206): ``x_s = (1 - s) x_0 + s noise`` for a noise
    level ``s`` in (0, 1), drawn logit-normal (``sigmoid`` of N(``logit_mean``, ``logit_std``), which weights the
    middle levels, where the path is hardest to tell); the model is given the timestep ``s * T`` (a float, through
    the same sinusoidal embedding as DDPM's integer steps) and predicts the velocity ``noise - x_0``.

    Sampling integrates ``dx/ds = v(x, s)`` from pure noise at ``s = 1`` to ``s = 0`` with Euler steps over
    diffusers' ``FlowMatchEulerDiscreteScheduler`` levels (``shift`` 1): ``n`` levels evenly from 1 to ``1 / T``,
    then 0. A small model trained for a few CPU minutes draws cleaner images this way than with DDPM's 1000-step
    chain: every step follows the predicted direction, with no noise injected and no clipping.
    """

    def __init__(self, num_train_timesteps: int = 1000, logit_mean: float = 0.0, logit_std: float = 1.0):
        self.num_train_timesteps, self.logit_mean, self.logit_std = num_train_timesteps, logit_mean, logit_std

    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        """``(1 - s) x_0 + s noise`` per sample (``sigma`` is ``[b]``)."""
        s = sigma.to(x0.dtype).view(-1, *([1] * (x0.dim() - 1)))
        return (1 - s) * x0 + s * noise

    def training_batch(self, x0: torch.Tensor, generator: torch.Generator | None = None, *,
                       seeds: list[int] | None = None):
        """``((x_s, s * T), noise - x_0)`` for clean images ``x0 [b, C, H, W]``; the timesteps are float32 ``[b]``.
        Drawn as :meth:`DDPMSchedule.training_batch` draws (one ``generator``, or a generator per sample from
        ``seeds``), so a sample's pair does not depend on how the batch is cut."""
        gens = _per_sample_generators(x0, generator, seeds)
        if gens is None:
            u = torch.randn(x0.shape[0], generator=generator)
            noise = torch.randn(x0.shape, generator=generator, dtype=x0.dtype)
        else:
            u = torch.cat([torch.randn(1, generator=g) for g in gens])
            noise = torch.stack([torch.randn(x0.shape[1:], generator=g, dtype=x0.dtype) for g in gens])
        sigma = torch.sigmoid(self.logit_mean + self.logit_std * u).to(x0.device)
        noise = noise.to(x0.device)
        return (self.add_noise(x0, noise, sigma), sigma * self.num_train_timesteps), noise - x0

    def sigmas(self, num_inference_steps: int) -> torch.Tensor:
        """The ``n + 1`` noise levels of an ``n``-step sampling run, descending, fp32: ``n`` evenly from 1 to
        ``1 / T``, then 0 (diffusers' FlowMatchEulerDiscreteScheduler.set_timesteps, shift 1)."""
        n, big_t = num_inference_steps, self.num_train_timesteps
        if not 1 <= n <= big_t:
            raise ValueError(f"num_inference_steps must be in [1, {big_t}], got {n}")
        levels = torch.linspace(1.0, 1.0 / big_t, n, dtype=torch.float64).float()
        return torch.cat([levels, torch.zeros(1)])

    @staticmethod
    def step(velocity: torch.Tensor, sigma: float, sigma_next: float, x: torch.Tensor) -> torch.Tensor:
        """One Euler step of ``dx/ds = v`` from level ``sigma`` to ``sigma_next``."""
        return x + (sigma_next - sigma) * velocity

    def to_diffusers(self) -> dict:
        return {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": self.num_train_timesteps,
                "shift": 1.0, "use_dynamic_shifting": False}

    def sample(self, model_fn, shape, *, seed: int, num_inference_steps: int | None = None, device="cpu",
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return flow_sample(model_fn, shape, seed=seed, schedule=self, num_inference_steps=num_inference_steps,
                           device=device, dtype=dtype)

@torch.no_grad()
def flow_sample(model_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], shape: tuple[int, ...], *,
                seed: int, schedule: FlowMatchSchedule | None = None, num_inference_steps: int | None = None,
                device="cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Euler sampling of a flow-matching model: x ~ N(0, I) at level 1 (drawn from a CPU generator seeded with
    ``seed``), then ``x += (s_next - s) * model_fn(x, s * T [b] float32)`` down the levels of
    :meth:`FlowMatchSchedule.sigmas`. Deterministic in ``seed`` (no noise after the first draw); returns x_0
    ``shape``, clamped to [-1, 1]. Under TP or pipelines as :func:`ddpm_sample`."""
    schedule = schedule or FlowMatchSchedule()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=dtype).to(device)
    sigmas = schedule.sigmas(num_inference_steps or FLOW_SAMPLE_STEPS).tolist()
    for sigma, sigma_next in zip(sigmas[:-1], sigmas[1:]):
        t = torch.full((shape[0],), sigma * schedule.num_train_timesteps, dtype=torch.float32, device=device)
        x = schedule.step(model_fn(x, t).to(dtype), sigma, sigma_next, x)
    return x.clamp(-1.0, 1.0)

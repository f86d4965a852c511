"""The objective of a diffusion model: training config <-> schedule <-> diffusers scheduler config, and the sampling
steps each objective takes when none are asked for."""

from __future__ import annotations

from zoo.models.unet.ddpm import DDPM_SAMPLE_STEPS, DDPMSchedule
from zoo.models.unet.flow import FLOW_SAMPLE_STEPS, FlowMatchSchedule

OBJECTIVES = ("ddpm", "flow")
SCHEDULER_CONFIG = "scheduler_config.json"  # diffusers' file name; beside a model it says how to sample it


def schedule_for(objective: str | None):
    """The schedule of ``training.objective`` (None: DDPM)."""
    if objective in (None, "ddpm"):
        return DDPMSchedule()
    if objective == "flow":
        return FlowMatchSchedule()
    raise ValueError(f"unknown diffusion objective {objective!r}; choose one of {', '.join(OBJECTIVES)}")


def schedule_from_config(d: dict | None):
    """The schedule a diffusers scheduler config describes (None: DDPM with diffusers' defaults, what a model
    folder without a scheduler config was trained with). Raises ValueError naming what zoo cannot sample."""
    if d is None:
        return DDPMSchedule()
    name = d.get("_class_name")
    if name == "DDPMScheduler":
        unsupported = {k: d[k] for k, want in (("beta_schedule", "linear"), ("prediction_type", "epsilon"),
                                                ("variance_type", "fixed_small"), ("thresholding", False))
                       if k in d and d[k] != want}
        if d.get("trained_betas") is not None:
            unsupported["trained_betas"] = "..."
        if unsupported:
            raise ValueError(f"DDPMScheduler options zoo's sampler does not implement: {unsupported}")
        return DDPMSchedule(int(d.get("num_train_timesteps", 1000)), float(d.get("beta_start", 1e-4)),
                            float(d.get("beta_end", 0.02)), bool(d.get("clip_sample", True)))
    if name == "FlowMatchEulerDiscreteScheduler":
        unsupported = {k: d[k] for k, want in (("shift", 1.0), ("use_dynamic_shifting", False),
                                                ("invert_sigmas", False), ("use_karras_sigmas", False),
                                                ("use_exponential_sigmas", False), ("use_beta_sigmas", False),
                                                ("stochastic_sampling", False), ("shift_terminal", None))
                       if k in d and d[k] != want}
        if unsupported:
            raise ValueError(f"FlowMatchEulerDiscreteScheduler options zoo's sampler does not implement: "
                             f"{unsupported}")
        return FlowMatchSchedule(int(d.get("num_train_timesteps", 1000)))
    raise ValueError(f"scheduler {name!r}: zoo samples DDPMScheduler and FlowMatchEulerDiscreteScheduler models")


def objective_of(scheduler_config: dict | None) -> str:
    """``"flow"`` or ``"ddpm"``: the objective a model with this diffusers scheduler config (None: none) was trained
    with. Raises ValueError as :func:`schedule_from_config` does."""
    return "flow" if isinstance(schedule_from_config(scheduler_config), FlowMatchSchedule) else "ddpm"


def default_sample_steps(objective: str | None) -> int:
    """Sampling steps when none are asked for: 50 Euler steps for flow matching, 250 DDPM steps otherwise."""
    return FLOW_SAMPLE_STEPS if objective == "flow" else DDPM_SAMPLE_STEPS

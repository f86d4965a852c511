"""accelerate internals zoo relies on, each behind one function (the package docstring says why they live here).

Every piece was checked against accelerate 1.15.0; its canary test is in ``tests/compat/test_accelerate.py``.
"""

from __future__ import annotations

# What ``accelerate launch`` tells the process it starts, in the environment (accelerate/utils/launch.py: the
# ``prepare_*_cmd_env`` functions), for an ``Accelerator`` to read. The first is set by the simple launcher (one
# machine, no --multi_gpu), among others.
SIMPLE_LAUNCHER = "ACCELERATE_DYNAMO_BACKEND"
USE_DEEPSPEED = "ACCELERATE_USE_DEEPSPEED"
ZERO_STAGE = "ACCELERATE_DEEPSPEED_ZERO_STAGE"
DEEPSPEED_CONFIG_FILE = "ACCELERATE_DEEPSPEED_CONFIG_FILE"
MIXED_PRECISION = "ACCELERATE_MIXED_PRECISION"


def launched_settings(env) -> dict:
    """What ``accelerate launch`` asked of the process it started, from its environment ``env``: ``one_process``
    (its simple launcher started one plain process where ``--num_processes N`` asked for more: it sets MASTER_ADDR
    for N > 1 but no WORLD_SIZE), ``deepspeed`` (``--use_deepspeed``),
    ``zero_stage`` and ``deepspeed_config_file`` (None when not given) and ``mixed_precision`` ("no" when not
    given).

    Why: accelerate passes its launcher flags to the process only as undocumented environment variables that its
    ``Accelerator`` reads; zoo reads none of them for its run and refuses a launch whose flags say otherwise.
    Checked: accelerate 1.15.0. No upstream issue known."""
    return {"one_process": SIMPLE_LAUNCHER in env and "MASTER_ADDR" in env and "WORLD_SIZE" not in env,
            "deepspeed": env.get(USE_DEEPSPEED) == "true", "zero_stage": env.get(ZERO_STAGE),
            "deepspeed_config_file": env.get(DEEPSPEED_CONFIG_FILE) or None,
            "mixed_precision": env.get(MIXED_PRECISION, "no")}


def reset_state() -> None:
    """Forget the process-wide state an ``Accelerator`` left (its ``AcceleratorState``, ``PartialState`` and
    ``GradientState`` singletons), so that another can be made in the same process with other settings.

    Why: the singletons have no public reset; ``AcceleratorState._reset_state(reset_partial_state=True)`` and
    ``GradientState._reset_state()`` are what accelerate's own tests call. Checked: accelerate 1.15.0. No upstream
    issue known."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()

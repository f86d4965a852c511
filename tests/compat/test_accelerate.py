"""Canaries of zoo.compat.accelerate: each checks, in this one process, that accelerate still has the names and
behaviour one piece relies on, and fails naming the accelerate version and what changed."""

from __future__ import annotations

import inspect

from tests.compat.canary import expect, parameters, source
from zoo.compat import accelerate as accelerate_compat

LIB = "accelerate"


def test_launcher_environment():
    """Where ``accelerate launch`` writes what zoo reads: the simple launcher its mark and MASTER_ADDR without
    WORLD_SIZE, the DeepSpeed launcher its DeepSpeed flags."""
    from accelerate.utils import launch

    piece = "accelerate.launched_settings"
    simple = source(launch.prepare_simple_launcher_cmd_env)
    expect(f'"{accelerate_compat.SIMPLE_LAUNCHER}"' in simple and '"MASTER_ADDR"' in simple
           and '"WORLD_SIZE"' not in simple, LIB, piece,
           f"prepare_simple_launcher_cmd_env no longer sets {accelerate_compat.SIMPLE_LAUNCHER} and MASTER_ADDR "
           f"without WORLD_SIZE")
    deepspeed = source(launch.prepare_deepspeed_cmd_env)
    for name in (accelerate_compat.USE_DEEPSPEED, accelerate_compat.ZERO_STAGE, accelerate_compat.DEEPSPEED_CONFIG_FILE,
                 accelerate_compat.MIXED_PRECISION):
        expect(f'"{name}"' in deepspeed, LIB, piece, f"prepare_deepspeed_cmd_env no longer sets {name}")
    expect('current_env["ACCELERATE_USE_DEEPSPEED"] = "true"' in deepspeed, LIB, piece,
           "prepare_deepspeed_cmd_env no longer marks DeepSpeed with ACCELERATE_USE_DEEPSPEED=true")


def test_launched_settings():
    assert accelerate_compat.launched_settings({}) == {
        "one_process": False, "deepspeed": False, "zero_stage": None,
        "deepspeed_config_file": None, "mixed_precision": "no"}
    env = {"ACCELERATE_DYNAMO_BACKEND": "NO", "MASTER_ADDR": "127.0.0.1", "ACCELERATE_USE_DEEPSPEED": "true",
           "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2", "ACCELERATE_MIXED_PRECISION": "bf16"}
    assert accelerate_compat.launched_settings(env) == {
        "one_process": True, "deepspeed": True, "zero_stage": "2", "deepspeed_config_file": None,
        "mixed_precision": "bf16"}
    assert not accelerate_compat.launched_settings({**env, "WORLD_SIZE": "2"})["one_process"]


def test_reset_state():
    from accelerate.state import AcceleratorState, GradientState, PartialState

    piece = "accelerate.reset_state"
    expect(parameters(AcceleratorState._reset_state) == ["reset_partial_state"], LIB, piece,
           "AcceleratorState._reset_state(reset_partial_state) changed")
    expect(callable(getattr(GradientState, "_reset_state", None)), LIB, piece, "GradientState._reset_state is gone")
    PartialState(cpu=True)
    GradientState()
    accelerate_compat.reset_state()
    expect(PartialState._shared_state == {} and GradientState._shared_state == {}, LIB, piece,
           "the _reset_state methods no longer empty the singletons' _shared_state")


def test_every_piece_says_why_and_what_it_was_checked_on():
    for name, obj in vars(accelerate_compat).items():
        if inspect.isfunction(obj) and obj.__module__ == accelerate_compat.__name__:
            doc = " ".join((inspect.getdoc(obj) or "").split())
            assert "Why:" in doc and "accelerate 1.15.0" in doc and "upstream" in doc.lower(), name

"""A zoo model trained in your own Accelerate loop, ZeRO-2 through accelerate's DeepSpeed plugin.

    accelerate launch --multi_gpu --num_processes 2 launch/accelerate_loop.py --steps 20
    python launch/accelerate_loop.py --steps 20 --set data.source=synthetic          # one process

Unlike the other launch/ files this one is meant to be read and copied: the loop is the example. zoo brings the run
config (configs/gpt/tiny.yaml, any field overridable with --set), the plain model built from the layer specs (tp=1,
pp=1: one module), the loss, the data in zoo's sample order and zoo's LR schedule; the loop brings the Accelerator,
the optimizer and the steps. With the same config it trains what ``launch/train.py --zero 2`` does on the same
number of processes, loss for loss (tests/training/test_accelerate_loop.py).
"""

import argparse
import os
import sys
import types
from functools import partial

import torch

from zoo.flags import Parser
from zoo.package import config_file
from zoo.training.config import ConfigError, deepspeed_config, load, validate
from zoo.training.run import config_flag_hints

CONFIG = config_file("gpt/tiny.yaml")


def train_loop(cfg, model_cfg, log=print) -> list[float]:
    """``cfg.training.steps`` steps in an Accelerate loop; the per-step losses (mean over micro-batches and
    processes)."""
    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.utils import InitProcessGroupKwargs
    from deepspeed.accelerator import get_accelerator

    from zoo.data.batches import micro_batch, to_device
    from zoo.models.gpt import ParallelOptions
    from zoo.models.specs import SpecSequential
    from zoo.parallel.random import model_parallel_seed
    from zoo.parallel.topology import init_distributed
    from zoo.training.engine import lr_factor, param_groups
    from zoo.training.families import get_family

    tr, gas = cfg.training, cfg.gradient_accumulation_steps
    init_distributed()  # any launcher, or none (a world of one), as launch/train.py starts
    # zoo's DeepSpeed config without its optimizer (the loop brings its own): batch sizes, clipping, ZeRO stage.
    ds = {key: value for key, value in deepspeed_config(cfg).items() if key != "optimizer"}
    accelerator = Accelerator(
        deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds), gradient_accumulation_steps=gas,
        mixed_precision=tr.precision if tr.precision in ("bf16", "fp16") else "no",  # as ds says
        step_scheduler_with_optimizer=False,  # zoo's schedule counts optimizer steps, once each (not per process)
        # the device's own backend (gloo on CPU, where accelerate would otherwise see no distributed device)
        kwargs_handlers=[InitProcessGroupKwargs(backend=get_accelerator().communication_backend_name())])

    family = get_family(cfg.model.family)
    # one process's layout (no TP, SP, EP or CP), seeded as launch/train.py's
    model = SpecSequential(family.layer_specs(model_cfg, ParallelOptions()), base_seed=tr.seed)
    loss_fn = family.loss(model_cfg)
    model_parallel_seed(tr.seed)  # dropout streams, as launch/train.py seeds them
    optimizer = torch.optim.AdamW(param_groups(model, tr.weight_decay), lr=tr.lr, betas=(tr.adam_beta1, tr.adam_beta2),
                                  eps=tr.adam_eps)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(lr_factor, steps=tr.steps,
                                                                    warmup_steps=tr.warmup_steps,
                                                                    min_ratio=tr.min_lr / tr.lr))
    model, optimizer, schedule = accelerator.prepare(model, optimizer, schedule)
    # build_data reads the global rank only: rank 0 prepares the embedded corpus once.
    data = family.build_data(cfg, model_cfg, types.SimpleNamespace(rank=accelerator.process_index))

    losses = []
    for step in range(tr.steps):
        lr = schedule.get_last_lr()[0]  # the rate this step uses
        total = torch.zeros((), device=accelerator.device)
        for micro in range(gas):  # step t reads samples [t G, (t+1) G), this process's share of each micro-batch
            ids, labels = to_device(micro_batch(data.train, step, micro, micro_batch_size=tr.micro_batch_size,
                                                accumulation=gas, dp_rank=accelerator.process_index,
                                                dp=accelerator.num_processes), accelerator.device)
            with accelerator.accumulate(model):  # DeepSpeed clips and steps AdamW after the last micro-batch
                loss = loss_fn(model(ids), labels)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            total += loss.detach().float()
        schedule.step()
        losses.append(float(accelerator.reduce(total / gas, "mean")))
        if accelerator.is_main_process:
            log(f"step {step + 1}/{tr.steps} | loss {losses[-1]:.6f} | lr {lr:.2e}")
    accelerator.free_memory()  # the engine; the process group stays for the caller (destroyed at exit, as zoo does)
    return losses


def parse_args(argv=None):
    p = Parser(prog="launch/accelerate_loop.py", description=__doc__, hints=config_flag_hints,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(CONFIG), help="run config YAML (default: configs/gpt/tiny.yaml)")
    p.add_argument("--steps", type=int, help="optimizer steps")
    p.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=2, help="ZeRO stage (default 2)")
    p.add_argument("--set", nargs="+", action="extend", default=[], metavar="SECTION.KEY=VALUE",
                   help="override any config field, e.g. --set training.lr=3e-4")
    return p.parse_args(argv)  # an unknown flag: one line, exit status 2 (zoo.flags)


def plan(args, world_size: int):
    """The run config and model config, checked before any process group: the plain model only."""
    overrides = [f"parallel.zero_stage={args.zero}", *([f"training.steps={args.steps}"] if args.steps else []),
                 *args.set]
    cfg = load(args.config, overrides)
    par = cfg.parallel
    if (par.tp, par.pp, par.cp, par.ep) != (1, 1, 1, 1):
        raise ConfigError(f"this loop trains the plain model (tp, pp, cp, ep all 1), the config asks for tp={par.tp} "
                          f"pp={par.pp} cp={par.cp} ep={par.ep}; launch/train.py runs every layout")
    return cfg, validate(cfg, world_size)


def main(argv=None) -> int:
    try:
        cfg, model_cfg = plan(parse_args(argv), int(os.environ.get("WORLD_SIZE", "1")))
    except ConfigError as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {e}", file=sys.stderr)
        return 2
    train_loop(cfg, model_cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())

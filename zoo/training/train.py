"""``launch/train.py``: the run config of the command line, checked (with the checkpoint to resume) before any
process group exists, then the run: the family's data, :class:`zoo.training.trainer.Trainer` to ``training.steps``,
the layout-free model export and the end-of-run lines.

The engine and its layouts are ``zoo.training.engine``'s; the loop, evaluation and checkpoints
``zoo.training.trainer``'s.

Entry point: ``launch/train.py`` (one process, ``torchrun`` or the ``deepspeed`` launcher).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from zoo.package import config_file
from zoo.training.config import ConfigError, RunConfig, load, lora_config, validate
from zoo.training.families import get_family
from zoo.training.run import (
    RunParser,
    command,
    init_without_tokenizer,
    layout_line,
    loss_change,
    process_group,
    say,
    start_run,
    train_and_save,
)

DEFAULT_CONFIG = config_file("gpt/main.yaml")


def parse_args(argv=None):
    p = RunParser("launch/train.py", "Train a zoo model.",
                  "With no arguments: the main job (configs/gpt/main.yaml), a 0.88M-parameter GPT-2-style model "
                  "trained 1000 steps on the embedded corpus (Python's own help texts, no download), about 3:20 on 2 "
                  "idle CPU cores (docs/results.md).")
    p.add_argument("--config",
                   help=f"run config YAML (default: {DEFAULT_CONFIG.relative_to(DEFAULT_CONFIG.parents[2])})")
    p.add_run_flags(load_help=": model, optimizer, LR schedule, step, RNG and data position; another tp/pp/dp/ep "
                              "goes through DeepSpeed's universal checkpoint")
    p.add_argument("--out", help="output folder: config.yaml, metrics.jsonl, tb/, loss.png, checkpoints/, model/")
    p.add_argument("--init", metavar="DIR",
                   help="start from these weights: a zoo model folder (launch/convert.py hf-to-zoo, or a run's model/) "
                        "or a HuggingFace folder / Hub id (converted on the fly); the model config comes from it")
    p.add_argument("--no-sample", action="store_true", help="skip the sample printed at the end")
    return p.parse_args(argv)


def config_from_args(args) -> RunConfig:
    overrides = list(args.set)
    for flag, key in (("tp", "parallel.tp"), ("pp", "parallel.pp"), ("ep", "parallel.ep"),
                      ("ep_spans_tp", "parallel.ep_spans_tp"), ("cp", "parallel.cp"),
                      ("cp_algorithm", "parallel.cp_algorithm"), ("zero", "parallel.zero_stage"),
                      ("compile", "training.compile"), ("fused_cross_entropy", "training.fused_cross_entropy"),
                      ("steps", "training.steps"), ("eval_interval", "training.eval_interval"),
                      ("save_interval", "training.save_interval"), ("init", "training.init_from"), ("out", "out")):
        value = getattr(args, flag)
        if value is not None:
            overrides.append(f"{key}={value}")
    return load(args.config or DEFAULT_CONFIG, overrides)


def resume_plan(cfg: RunConfig, model_cfg, args):
    """Which checkpoint to resume (None: start fresh) and whether it needs the universal path; checked before any
    process group so a wrong --load costs nothing and touches nothing."""
    from zoo.training import checkpoint as ckpt

    if args.load is None and args.load_step is not None:
        raise ConfigError("--load-step needs --load DIR")
    if args.load is not None:
        found = ckpt.find_checkpoint(args.load, args.load_step,
                                     allow_no_manifest=getattr(args, "allow_no_manifest", False))
    elif cfg.training.save and (Path(cfg.out) / ckpt.CHECKPOINTS).is_dir():
        # Megatron's habit: a run resumes where it saved (the newest intact checkpoint)
        found = ckpt.find_intact(cfg.out, warn=lambda line: os.environ.get("RANK", "0") == "0" and
                                 print(line, file=sys.stderr, flush=True))
        if found is None:
            return None, False
    else:
        return None, False
    meta = found.meta
    saved = meta["model"]
    here = model_cfg.to_dict()
    diff = [f"{k} {saved.get(k)!r} vs {here.get(k)!r}" for k in sorted(set(saved) | set(here))
            if saved.get(k) != here.get(k)]
    if diff:
        raise ConfigError(f"checkpoint {found.root / found.tag} holds a different model (checkpoint vs this run: "
                          f"{'; '.join(diff[:4])}); use the model config it was trained with, or another --out")
    lora = lora_config(cfg)
    if meta.get("lora") != (None if lora is None else lora.to_dict()):
        raise ConfigError(f"checkpoint {found.root / found.tag} trained adapters {meta.get('lora')}, this run's "
                          f"finetune.lora is {cfg.finetune.lora}; set finetune.lora as it was, or another --out")
    if meta["global_batch_size"] != cfg.global_batch_size or meta["seq_length"] != cfg.training.seq_length:
        raise ConfigError(f"checkpoint {found.root / found.tag} was trained with global batch "
                          f"{meta['global_batch_size']} x {meta['seq_length']} tokens, this run uses "
                          f"{cfg.global_batch_size} x {cfg.training.seq_length}; keep them to resume the same data "
                          f"order")
    old, par = meta["layout"], cfg.parallel
    same_model_layout = ((old["tp"], old["pp"], old.get("ep", 1), old.get("ep_spans_tp", False))
                         == (par.tp, par.pp, par.ep, par.ep_spans_tp))
    # DeepSpeed partitions ZeRO states over dp x cp (zoo.parallel.topology): a cp change is a dp change to it.
    zero_same = old["zero_stage"] == par.zero_stage and (old["zero_stage"] == 0 or
                                                         old["dp"] * old.get("cp", 1) == cfg.dp * par.cp)
    universal = not (same_model_layout and zero_same)
    if universal and (old["zero_stage"] == 0 or par.zero_stage == 0):
        raise ConfigError(f"checkpoint {found.root / found.tag} was saved at tp={old['tp']} pp={old['pp']} "
                          f"dp={old['dp']} ZeRO-{old['zero_stage']}; resuming at tp={par.tp} pp={par.pp} "
                          f"dp={cfg.dp} ZeRO-{par.zero_stage} goes through DeepSpeed's universal checkpoint, which "
                          f"needs ZeRO >= 1 on both sides; resume in the saved layout, or train with --zero 1")
    if universal and lora is not None:
        raise ConfigError(f"checkpoint {found.root / found.tag} was saved at tp={old['tp']} pp={old['pp']} "
                          f"dp={old['dp']} ZeRO-{old['zero_stage']}; a LoRA run resumes in the layout it saved (the "
                          f"universal checkpoint has no patterns for adapters yet); resume there, or start from its "
                          f"exported model folder with --init (base and adapters)")
    nkv = getattr(model_cfg, "num_key_value_heads", None)
    if universal and nkv and max(old["tp"], par.tp) > nkv:
        raise ConfigError(f"checkpoint {found.root / found.tag} was saved at tp={old['tp']} pp={old['pp']} "
                          f"dp={old['dp']} ZeRO-{old['zero_stage']}; resuming at tp={par.tp} pp={par.pp} dp={cfg.dp} "
                          f"ZeRO-{par.zero_stage} needs DeepSpeed's universal checkpoint, which cannot reshard the "
                          f"replicated kv heads of tp > num_key_value_heads {nkv}; resume in the saved layout, or "
                          f"start from its exported model folder with --init")
    return found, universal


def plan(args, world_size: int) -> tuple:
    """``(run config, model config, checkpoint to resume or None, whether it resumes through the universal
    checkpoint)``, all checked before any process group exists."""
    cfg = config_from_args(args)
    model_cfg = validate(cfg, world_size)
    return (cfg, model_cfg, *resume_plan(cfg, model_cfg, args))


def run(args, cfg: RunConfig, model_cfg, resume, universal: bool) -> int:
    from zoo.training.trainer import Trainer, build_data

    out, family = Path(cfg.out), get_family(cfg.model.family)
    with process_group(cfg) as grid:
        rank0 = grid.rank == 0
        count = model_cfg.num_parameters() if hasattr(model_cfg, "num_parameters") else float("nan")
        per_sample = f" x {cfg.training.seq_length} tokens" if family.unit == "tokens" else ""
        start_run(cfg, grid, f"zoo: {cfg.model.family} {count / 1e6:.2f}M parameters | {layout_line(cfg, grid)} | "
                             f"global batch {cfg.global_batch_size}"
                             f"{per_sample} | {cfg.training.precision} | data: {cfg.data.source}",
                  init_without_tokenizer(cfg, model_cfg))
        with Trainer(cfg, model_cfg, grid, build_data(cfg, model_cfg, grid), log=say, resume=resume,
                     universal=universal, progress=True) as trainer:
            result = train_and_save(trainer)
            metrics = trainer.take_metrics()  # still open: the pictures drawn from the export go to the loggers (W&B)
    try:
        if rank0:
            if result.val_losses:
                say(loss_change(result.val_losses, share=True))
            say(f"done: metrics in {out / 'metrics.jsonl'} | TensorBoard: tensorboard --logdir {out / 'tb'} | "
                f"loss plot {out / 'loss.png'}" + (f" | checkpoints {out / 'checkpoints'} | model {out / 'model'}"
                                                    if cfg.training.save else ""))
        if rank0 and cfg.training.save and not args.no_sample:
            pictures = family.after_training(out / "model", say) or {}
            step = metrics.records[-1]["step"] if metrics.records else cfg.training.steps
            for key, path in pictures.items():
                metrics.image(key, path, step)
    finally:
        metrics.close()
    return 0


def main(argv=None) -> int:
    return command(parse_args(argv), plan, run)

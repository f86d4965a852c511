"""What every run command does around the loop: ``launch/train.py`` (``zoo.training.train.main``) and the
fine-tuning commands (``zoo.finetune``).

A command parses its flags (:class:`RunParser`: the layout, steps, intervals, resume and ``--set`` flags they all
take), then (:func:`command`) plans: it checks everything it can before any process group exists, and a bad
input is one ``error: ...`` line, exit status 2, nothing written. Then it runs, inside :func:`process_group`:
announces the run and writes its config (:func:`start_run`), trains and exports the layout-free model
(:func:`train_and_save` with a ``zoo.training.trainer.Trainer``), and reports the validation loss it reached
(:func:`loss_change`).
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from dataclasses import is_dataclass
from pathlib import Path

import yaml

from zoo.flags import Parser, config_key_hints
from zoo.training.checkpoint import ResumeError, SaveError
from zoo.training.config import ConfigError, RunConfig
from zoo.training.nonfinite import DivergedError
from zoo.training.signals import CollectiveError

# Other trainers' flags (Megatron-LM's) whose zoo name differs from theirs: what to write instead. A flag named as
# a run config field (Megatron's --lr, --micro-batch-size, --seq-length, ...) needs no entry (config_flag_hints).
OTHER_NAMES = {
    "--train-iters": "--steps {value}", "--tensor-model-parallel-size": "--tp {value}",
    "--pipeline-model-parallel-size": "--pp {value}", "--context-parallel-size": "--cp {value}",
    "--expert-model-parallel-size": "--ep {value}", "--zero-stage": "--zero {value}", "--save": "--out {value}",
    "--num-layers": "--set model.num_hidden_layers={value}",
    "--ffn-hidden-size": "--set model.intermediate_size={value}",
    "--lr-warmup-iters": "--set training.warmup_steps={value}", "--clip-grad": "--set training.grad_clip={value}",
    "--bf16": "--set training.precision=bf16", "--fp16": "--set training.precision=fp16",
    "--data-path": "--set data.paths=[{value}]",
    "--recompute-activations": "--set parallel.activation_checkpointing=true",
}


def config_flag_hints() -> dict[str, str]:
    """What a run command says of a flag it does not know that names a run config field (``--micro-batch-size`` ->
    ``--set training.micro_batch_size=...``; the model section: any field of a family's model config) or that
    :data:`OTHER_NAMES` lists. Built only when a flag is refused."""
    from dataclasses import asdict, fields

    from zoo.training.families import REGISTRY, get_family

    cfg = RunConfig()
    sections = {f.name: asdict(getattr(cfg, f.name)) for f in fields(cfg) if is_dataclass(getattr(cfg, f.name))}
    sections["model"].pop("overrides", None)
    for name in REGISTRY:
        try:
            config_class = get_family(name).config_class
        except ValueError:  # a family whose optional dependency is missing
            continue
        sections["model"].update({f.name: f.default for f in fields(config_class)})
    return {**config_key_hints(sections), **OTHER_NAMES}


class RunParser(Parser):
    """The argument parser of a run command: its description says what it does, where it runs, then ``more``;
    :meth:`add_run_flags` adds the flags every run command shares. An unknown flag is refused (zoo.flags), naming
    the config key to ``--set`` where it is one."""

    def __init__(self, prog: str, what: str, more: str):
        super().__init__(prog=prog, description=f"{what} Works in one process, under torchrun and under the deepspeed "
                                                f"launcher; data parallelism is world_size / (tp x cp x pp). {more}",
                         hints=config_flag_hints)

    def add_run_flags(self, *, eval_help: str = "validation loss", load_help: str = "") -> None:
        """Layout, steps, intervals, resume, --set."""
        self.add_argument("--tp", type=int, help="tensor-parallel size")
        self.add_argument("--pp", type=int, help="pipeline-parallel size")
        self.add_argument("--ep", type=int, help="expert-parallel size (mixture-of-experts models; must divide dp, "
                                                 "or with --ep-spans-tp be tp x a divisor of dp)")
        self.add_argument("--ep-spans-tp", action="store_const", const="true", default=None,
                          help="MoE: the EP groups take in the TP ranks (parallel folding; ep a multiple of tp, "
                               "ep / tp dividing dp; parallel.ep_spans_tp: true)")
        self.add_argument("--cp", type=int, help="context-parallel size: each sequence split over cp ranks (GPT)")
        self.add_argument("--cp-algorithm", choices=["ulysses", "ring"],
                          help="context-parallel attention: ulysses (all-to-all over heads, the default) or ring")
        self.add_argument("--zero", type=int, choices=[0, 1, 2, 3], help="ZeRO stage (pp > 1 allows 0 or 1)")
        self.add_argument("--compile", action="store_const", const="true", default=None,
                          help="torch.compile every block (training.compile: true); the first steps compile")
        self.add_argument("--fused-cross-entropy", action="store_const", const="true", default=None,
                          help="GPT: LM head and loss in one chunked pass, no [tokens, vocab] logits "
                               "(training.fused_cross_entropy: true)")
        self.add_argument("--steps", type=int, help="number of optimizer steps (the run's total, also when resuming)")
        self.add_argument("--eval-interval", type=int, metavar="N",
                          help=f"{eval_help} every N steps (also before step 1 and at the end); 0: never")
        self.add_argument("--save-interval", type=int, metavar="N",
                          help="checkpoint every N steps into OUT/checkpoints (the last step is always saved)")
        self.add_argument("--load", metavar="DIR",
                          help="resume from a run folder (or its checkpoints/ folder)" + load_help +
                               ". Without --load, a run resumes from OUT/checkpoints when that exists")
        self.add_argument("--load-step", type=int, metavar="N", help="with --load: that step instead of the latest")
        self.add_argument("--allow-no-manifest", action="store_true",
                          help="with --load: accept a checkpoint without manifest.json (whose files zoo cannot "
                               "check); only for checkpoints of your own runs, DeepSpeed's files are pickles")
        self.add_argument("--set", nargs="+", action="extend", default=[], metavar="SECTION.KEY=VALUE",
                          help="override any config field, e.g. --set training.lr=3e-4 training.micro_batch_size=8")


def command(args, plan, run, errors: tuple = ()) -> int:
    """A run command's main. ``plan(args, world_size)`` checks everything that can be checked before any process
    group exists and returns the arguments of ``run(args, *planned)``, which does the work and returns the exit
    status. A bad input that ``plan`` finds (a ConfigError, a ResumeError or one of ``errors``) is refused: one
    ``error: ...`` line on stderr from global rank 0, exit status 2, nothing written. A run stopped by too many
    non-finite steps in a row (``zoo.training.nonfinite``) says so in one line too, exit status 3; a rank whose
    collective failed (another rank died or stopped answering), exit status 4; a checkpoint that could not be
    written (its partial folder removed, the older ones intact), exit status 5."""
    if os.environ.get("RANK", "0") == "0" and accelerate_started_one_process(os.environ):
        print(ACCELERATE_ONE_PROCESS, file=sys.stderr, flush=True)
    try:
        planned = plan(args, int(os.environ.get("WORLD_SIZE", "1")))
        problem = accelerate_flags_problem(planned[0], os.environ)
        if problem:
            raise ConfigError(problem)
    except (ConfigError, ResumeError, *errors) as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        return run(args, *planned)
    except DivergedError as e:  # every rank stops at the same step (the skip decision is global)
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 3
    except CollectiveError as e:  # each survivor says it: rank 0 may be the rank that died
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 4
    except SaveError as e:  # every rank knows; one says it
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 5


ACCELERATE_ONE_PROCESS = ("warning: accelerate launch started one process: without several GPUs it starts "
                          "--num_processes N only with --multi_gpu (accelerate launch --multi_gpu --num_processes N "
                          "launch/train.py ...)")


def accelerate_started_one_process(env) -> bool:
    """Whether this is ``accelerate launch --num_processes N`` (N > 1) that started one plain process: its simple
    launcher (no ``--multi_gpu`` on a machine without several GPUs) sets MASTER_ADDR for N > 1 but no WORLD_SIZE."""
    from zoo.compat.accelerate import launched_settings

    return launched_settings(env)["one_process"]


def accelerate_flags_problem(cfg: RunConfig, env) -> str | None:
    """One line when ``accelerate launch`` flags ask for what the run config does not do, else None.

    accelerate's launcher passes its DeepSpeed and precision flags in the environment for an ``Accelerator`` to read;
    zoo makes the DeepSpeed config from the run config (zoo.training.config.deepspeed_config) and reads none of
    them, so a launch whose flags say otherwise is refused rather than run another way than asked."""
    from zoo.compat.accelerate import launched_settings

    launched = launched_settings(env)
    zero = launched["zero_stage"]
    if launched["deepspeed"] and zero is not None and zero != str(cfg.parallel.zero_stage):
        return (f"accelerate launch --zero_stage {zero}, but the run config has parallel.zero_stage "
                f"{cfg.parallel.zero_stage} and zoo makes the DeepSpeed config from the run config: pass --zero {zero}")
    if launched["deepspeed_config_file"]:
        return (f"accelerate launch --deepspeed_config_file {launched['deepspeed_config_file']}: zoo makes the "
                f"DeepSpeed config from the run config and would not read it; drop it and set the run config instead "
                f"(--zero, --set training.precision=...)")
    precision = launched["mixed_precision"]
    if precision in ("bf16", "fp16") and precision != cfg.training.precision:
        return (f"accelerate launch --mixed_precision {precision}, but the run config trains in "
                f"{cfg.training.precision}; pass --set training.precision={precision}")
    return None


def init_without_tokenizer(cfg: RunConfig, model_cfg) -> str | None:
    """The warning line of a text model initialized from a folder that holds no tokenizer (``validate`` takes the
    folder's own when it has one) and trained on the embedded corpus: that trains a new tokenizer, whose token ids
    are not those the imported embeddings learned. None otherwise."""
    if (cfg.training.init_from is None or cfg.data.tokenizer is not None or cfg.data.source != "embedded"
            or getattr(model_cfg, "vocab_size", None) is None):
        return None
    return (f"warning: {cfg.training.init_from} holds no tokenizer (tokenizer.json or tokenizer_config.json), so "
            f"this run trains a new one on the embedded corpus, whose token ids mean nothing to the imported "
            f"embeddings; pass the model's own with --set data.tokenizer=DIR")


def say(line: str) -> None:
    print(line, flush=True)


@contextmanager
def process_group(cfg: RunConfig):
    """The (tp, pp, cp) grid of the run, torn down on the way out (also after an error)."""
    from zoo.parallel.topology import destroy_model_parallel, initialize_model_parallel

    grid = initialize_model_parallel(cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.ep, cfg.parallel.cp,
                                     timeout_minutes=cfg.training.collective_timeout_minutes,
                                     ep_spans_tp=cfg.parallel.ep_spans_tp)
    try:
        yield grid
    finally:
        destroy_model_parallel()


def layout_line(cfg: RunConfig, grid) -> str:
    """``tp=2 pp=1 dp=2 [cp=2 (ring)] [ep=2] zero=1``: the run's layout for its first log line."""
    cp = f" cp={grid.cp} ({cfg.parallel.cp_algorithm})" if grid.cp > 1 else ""
    ep = f" ep={grid.ep}" + (" (spans tp)" if grid.ep_spans_tp else "") if grid.ep > 1 else ""
    return f"tp={grid.tp} pp={grid.pp} dp={grid.dp}{cp}{ep} zero={cfg.parallel.zero_stage}"


def start_run(cfg: RunConfig, grid, banner: str, warning: str | None = None) -> None:
    """Global rank 0: the run's first line (and a warning on stderr), then ``<out>/config.yaml``, the run config
    as resolved."""
    if grid.rank != 0:
        return
    say(banner)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def train_and_save(trainer, export: bool | None = None):
    """``trainer.fit()`` (a ``zoo.training.trainer.Trainer`` with its progress bar) to ``training.steps``, then
    (``export``; None: when ``training.save``) the model as ``<out>/model`` (``Trainer.export``: layout-free, with the
    data's tokenizer). The engine is destroyed; the trainer's metrics writer stays open until the trainer closes.
    Returns the ``RunResult`` (losses, validation losses)."""
    cfg, grid = trainer.cfg, trainer.grid
    result = trainer.fit()
    if cfg.training.save if export is None else export:
        try:
            trainer.export(Path(cfg.out) / "model")
        except OSError as e:  # on every rank alike (io.save_model tells them): one line, exit status 5
            trainer.close_engine()
            raise SaveError(f"{e}; the checkpoints in {Path(cfg.out) / 'checkpoints'} are intact: fix that and run "
                            f"the same command again, it resumes at the last step and exports") from e
        if trainer.ema is not None and grid.rank == 0:
            say(f"{Path(cfg.out) / 'model'} holds the weight average (training.ema_decay "
                f"{cfg.training.ema_decay}); the trained weights are in the checkpoints")
    trainer.close_engine()
    return result


def loss_change(val_losses: list, what: str = "validation loss", share: bool = False) -> str:
    """``"<what> <first> (step s0) -> <last> (step s1)"`` of ``(step, loss)`` pairs, with ``share``: ", N% of the
    first". A run that evaluated at one step only (a resumed run evaluates at its end, not where it resumed) says
    that one loss, and that there is nothing to compare it with."""
    (s0, v0), (s1, v1) = val_losses[0], val_losses[-1]
    if s0 == s1:
        return f"{what} {v1:.3f} (step {s1}; this run evaluated at that step only)"
    line = f"{what} {v0:.3f} (step {s0}) -> {v1:.3f} (step {s1})"
    return line + (f", {100 * v1 / v0:.0f}% of the first" if share else "")

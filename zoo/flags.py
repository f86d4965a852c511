"""Command-line flags: every entry point's parser refuses what it does not know.

A flag a command does not know is a mistake, not something to skip: ``launch/train.py --lr 1e-2`` that trains at
the config's rate, or ``launch/finetune.py --lora-rank 8`` that runs a full fine-tune, does what was not asked and
says nothing. :class:`Parser` (an ``argparse.ArgumentParser``) refuses it in one line on stderr, exit status 2,
while the command line is parsed (before any process group or data exists), and names the fix where it can: the
flag meant (``--tpp`` -> ``--tp``, by ``difflib``), or, through the ``hints`` a command passes, the config key to
``--set`` or the flag with another name (Megatron's ``--lr`` -> ``--set training.lr=1e-2``, ``--train-iters 50``
-> ``--steps 50``).

The one thing a command takes without knowing it is what launchers add: the deepspeed launcher passes
``--local_rank=N`` (newer ones ``--local-rank``) to every process; zoo reads the rank from the environment.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

LAUNCHER_FLAGS = ("--local_rank", "--local-rank")
VALUE = "..."  # a hint's value when the command line gave none


def without_launcher_flags(argv: Sequence[str]) -> list[str]:
    """``argv`` less the launchers' ``--local_rank=N`` / ``--local_rank N`` (either spelling)."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg in LAUNCHER_FLAGS and i + 1 < len(argv) and argv[i + 1].lstrip("-").isdigit():
            i += 2
            continue
        if arg.split("=", 1)[0] in LAUNCHER_FLAGS and "=" in arg:
            i += 1
            continue
        out.append(arg)
        i += 1
    return out


def config_key_hints(sections: Mapping[str, Mapping[str, object]]) -> dict[str, str]:
    """``{"--foo-bar": "--set section.foo_bar={value}"}`` for every field of every config section (``{section:
    {field: default}}``): the flag other trainers (Megatron, HF's) give for what a zoo run config holds. A boolean
    field's flag is a switch (``--sequence-parallel`` -> ``--set parallel.sequence_parallel=true``). The first
    section naming a field wins."""
    hints: dict[str, str] = {}
    for section, defaults in sections.items():
        for name, default in defaults.items():
            value = "true" if isinstance(default, bool) else "{value}"
            hints.setdefault("--" + name.replace("_", "-"), f"--set {section}.{name}={value}")
    return hints


def unknown_flags(extras: Sequence[str]) -> list[tuple[str, str | None]]:
    """``(flag, value or None)`` of each unknown flag in what argparse left over (``--lr 1e-2``, ``--lr=1e-2``);
    a stray word that follows no flag comes as ``(word, None)``."""
    found: list[tuple[str, str | None]] = []
    i = 0
    while i < len(extras):
        arg = extras[i]
        if arg.startswith("-") and "=" in arg:
            found.append(tuple(arg.split("=", 1)))
        elif arg.startswith("-") and i + 1 < len(extras) and not extras[i + 1].startswith("--"):
            found.append((arg, extras[i + 1]))
            i += 1
        else:
            found.append((arg, None))
        i += 1
    return found


def fix_for(flag: str, value: str | None, known: Sequence[str], hints: Mapping[str, str]) -> str | None:
    """What to write instead of ``flag``: a hint (its ``{value}`` filled), else the nearest known flag, else None."""
    if not flag.startswith("-"):
        return None
    if flag in hints:
        return "use " + hints[flag].format(value=VALUE if value is None else value)
    near = difflib.get_close_matches(flag, [*known, *(h for h in hints if h not in known)], n=1, cutoff=0.75)
    if not near:
        return None
    if near[0] in known:
        return f"did you mean {near[0]}?"
    return "use " + hints[near[0]].format(value=VALUE if value is None else value)


def refusal(prog: str, extras: Sequence[str], known: Sequence[str], hints: Mapping[str, str]) -> str:
    """The one line that refuses ``extras``: ``launch/train.py: unknown flag --lr (use --set training.lr=1e-2);
    see --help``."""
    parts = []
    for flag, value in unknown_flags(extras):
        fix = fix_for(flag, value, known, hints)
        parts.append(flag + (f" ({fix})" if fix else ""))
    what = "unknown flag" + ("s" if len(parts) > 1 else "")
    if all(not p.startswith("-") for p in parts):
        what = "unexpected argument" + ("s" if len(parts) > 1 else "")
    return f"error: {prog}: {what} {', '.join(parts)}; see {prog} --help"


def _subparser_actions(parser: argparse.ArgumentParser) -> list:
    return [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]


@contextmanager
def _nothing_required(parser: argparse.ArgumentParser) -> Iterator[None]:
    """Every argument of ``parser`` and its subcommands optional for a while: an unknown flag is reported before
    a missing required one (the user learns that ``--lora-rank`` is no flag before adding ``--data``)."""
    saved = []
    stack = [parser]
    while stack:
        p = stack.pop()
        for action in p._actions:
            saved.append((action, action.required))
            action.required = False
        stack += [sub for a in _subparser_actions(p) for sub in a.choices.values()]
    try:
        yield
    finally:
        for action, required in saved:
            action.required = required


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that refuses unknown flags in one line (see the module's docstring) and takes the
    launchers' ``--local_rank``. ``hints``: a function giving ``{flag: "what to write instead"}`` (``{value}`` is
    the flag's value), called only when a flag is refused."""

    def __init__(self, *args, hints: Callable[[], Mapping[str, str]] | None = None, **kwargs):
        script = os.path.basename(sys.argv[0]) if sys.argv else ""
        if script.startswith("zoo-") and str(kwargs.get("prog", "")).startswith("launch/"):
            kwargs["prog"] = script  # run as a console script: usage and refusals name the command typed
        super().__init__(*args, **kwargs)
        self.hints = hints

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args(without_launcher_flags(args), namespace)

    def parse_args(self, args=None, namespace=None) -> argparse.Namespace:
        args = sys.argv[1:] if args is None else list(args)
        with _nothing_required(self):
            seen, extras = self.parse_known_args(args, None)
        if extras:
            self.refuse(extras, seen)
        return super().parse_args(without_launcher_flags(args), namespace)

    def known_flags(self, seen: argparse.Namespace) -> tuple[str, list[str]]:
        """``(prog, flags)`` of the (sub)command the command line chose: the flags a near miss is matched against."""
        prog, flags = self.prog, [s for a in self._actions for s in a.option_strings]
        for action in _subparser_actions(self):
            sub = action.choices.get(getattr(seen, action.dest, None))
            if sub is not None:
                prog, more = sub.known_flags(seen) if isinstance(sub, Parser) else (sub.prog, [])
                flags += more
        return prog, flags

    def refuse(self, extras: Sequence[str], seen: argparse.Namespace):
        """One line on stderr (from global rank 0 only: every rank parses the same command line), exit status 2."""
        prog, known = self.known_flags(seen)
        if os.environ.get("RANK", "0") == "0":
            print(refusal(prog, extras, known, self.hints() if self.hints else {}), file=sys.stderr, flush=True)
        raise SystemExit(2)

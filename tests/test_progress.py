"""zoo.progress: in a log file plain lines in tqdm's own format and never a ``\\r``; on a terminal the bar and every
line printed meanwhile (``print``, stderr, a logging handler made before the bar, as DeepSpeed's) each keep their
own row of the screen, as a small terminal model (``screen``) renders the bytes."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tqdm import tqdm

import zoo.progress as progress
from zoo.progress import no_bars_in_logs, progress_bar

ROOT = Path(__file__).resolve().parents[1]


class Terminal(io.StringIO):
    def isatty(self):
        return True


def screen(raw: str) -> list[str]:
    """The rows a terminal shows after ``raw``: ``\\r`` goes back to column 0, ``\\n`` to the next row, any other
    character overwrites the one under the cursor."""
    rows, row, col = [""], 0, 0
    for ch in raw:
        if ch == "\r":
            col = 0
        elif ch == "\n":
            row, col = row + 1, 0
            rows.append("") if row == len(rows) else None
        else:
            line = rows[row].ljust(col)
            rows[row] = line[:col] + ch + line[col + 1:]
            col += 1
    return [r.rstrip() for r in rows if r.strip()]


def test_terminal_bar_and_lines_keep_their_rows(monkeypatch):
    term = Terminal()
    monkeypatch.setattr(sys, "stdout", term)
    monkeypatch.setattr(sys, "stderr", term)
    logger = logging.getLogger("zoo-test-progress")  # like DeepSpeed's: a handler holding the stream it was made with
    handler = logging.StreamHandler(term)
    logger.addHandler(handler)
    monkeypatch.setattr(logger, "propagate", False)
    try:
        with progress_bar(total=3, desc="train", unit="step", mininterval=0) as bar:
            for i in range(3):
                bar.update(1)
                bar.write(f"log {i}")
                print(f"printed {i}")
                print(f"to stderr {i}", file=sys.stderr)
                logger.warning(f"logged {i}")
        assert sys.stdout is term and sys.stderr is term and handler.stream is term  # all given back
    finally:
        logger.removeHandler(handler)
    rows = screen(term.getvalue())
    messages = [f"{what} {i}" for i in range(3) for what in ("log", "printed", "to stderr", "logged")]
    assert rows[:-1] == messages, rows  # each message a whole row, no bar text joined to any
    assert rows[-1].startswith("train: 100%|") and "3/3" in rows[-1]  # the bar's last state stays, below


def test_plain_lines_in_a_log_file(monkeypatch):
    log, clock = io.StringIO(), [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(sys, "stdout", log)  # `> log 2>&1`
    monkeypatch.setattr(sys, "stderr", log)
    expected = []

    def meter(n, elapsed, loss):
        return tqdm.format_meter(n, 10, elapsed, ncols=0, prefix="train", unit="step", postfix=f"loss={loss}")

    with progress_bar(total=10, desc="train", unit="step", plain_interval=30) as bar:
        for i in range(10):
            clock[0] += 10
            bar.set_postfix(loss=f"{i:.1f}")
            bar.update(1)
            if clock[0] in (130, 170, 200):  # 30 s without a line
                expected.append(meter(i + 1, clock[0] - 100, f"{i:.1f}"))
            if i == 3:  # a log line resets the wait: no progress line at 160
                bar.write("step 4/10 | loss 3.0")
                expected.append("step 4/10 | loss 3.0")
    assert "\r" not in log.getvalue()
    assert log.getvalue().splitlines() == expected  # the last line was final already: none again at close

    log.seek(0), log.truncate()
    with progress_bar(total=10, desc="train", unit="step", initial=4, plain_interval=30) as bar:
        bar.update(2)
    assert log.getvalue().splitlines() == [tqdm.format_meter(6, 10, 0, ncols=0, prefix="train", unit="step",
                                                             initial=4)]
    log.seek(0), log.truncate()
    with progress_bar(total=10, disable=True) as bar:
        bar.update(10)
        bar.write("still printed")
    assert log.getvalue() == "still printed\n"


def test_no_bars_in_logs(monkeypatch):
    for name in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS"):
        monkeypatch.delenv(name, raising=False)
    assert not no_bars_in_logs(Terminal()) and "TQDM_DISABLE" not in os.environ
    assert no_bars_in_logs(io.StringIO())
    assert os.environ["TQDM_DISABLE"] == "1" and os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
    monkeypatch.setenv("TQDM_DISABLE", "0")
    no_bars_in_logs(io.StringIO())
    assert os.environ["TQDM_DISABLE"] == "0"  # the user's setting stays


@pytest.mark.parametrize("call", [True, False])
def test_other_libraries_bars_are_off_in_a_log_file(call):
    """What the launch scripts do first, in a fresh process whose stderr is a pipe: a library's tqdm bar then draws
    nothing (without the call it writes its \\r-redrawn bar)."""
    code = ("from zoo.progress import no_bars_in_logs\n" + ("no_bars_in_logs()\n" if call else "") +
            "from tqdm import tqdm\nfor _ in tqdm(range(3)): pass\n")
    env = {k: v for k, v in os.environ.items() if k not in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])  # this checkout's zoo
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, env=env, timeout=60)  # bytes: \r kept
    assert proc.returncode == 0, proc.stderr
    assert (proc.stderr == b"") if call else (b"\r" in proc.stderr and b"3/3" in proc.stderr), proc.stderr

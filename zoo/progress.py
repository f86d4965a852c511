"""Progress of a long loop on the console: tqdm's bar on a terminal, plain lines in a log file.

On a terminal (the bar's stream is a tty) :func:`progress_bar` is tqdm's bar, and while it is entered (``with
bar:``) every line Python writes meanwhile (``print``, ``warnings``, the console handlers of ``logging``, DeepSpeed's
among them) is printed above the bar: the bar is cleared, the line written, the bar drawn again, so neither
overwrites the other (output of C++ code straight to the file descriptors is out of reach). Anywhere else (a cluster
job's log file, a pipe) a bar redrawn with ``\\r`` would pile up in the file as one endless line, so none is drawn: a
plain line in tqdm's format without the bar (``train:  40% 120/300 [01:01<01:31,  1.96step/s, loss=3.912]``) is written
when nothing was for ``plain_interval`` seconds, and once at the end.

The libraries zoo runs draw bars of their own (transformers' "Loading weights", DeepSpeed's universal-checkpoint
conversion, the Hub's downloads); :func:`no_bars_in_logs`, which every ``launch/`` script calls first, turns those
off when stderr is not a terminal.
"""

from __future__ import annotations

import logging
import os
import sys
import time

PLAIN_INTERVAL_S = 30.0  # at most this long without a line in a log file while a loop runs


def is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def no_bars_in_logs(stream=None) -> bool:
    """When ``stream`` (default stderr) is not a terminal, turn off every tqdm bar the libraries draw
    (``TQDM_DISABLE``) and huggingface_hub's (``HF_HUB_DISABLE_PROGRESS_BARS``); returns whether it did.

    Both libraries read these variables when imported, so this runs before anything imports them; a variable the
    user has set is left as it is. zoo's own bars (:func:`progress_bar`) decide for themselves."""
    if is_terminal(sys.stderr if stream is None else stream):
        return False
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    return True


def progress_bar(*, total: int | None = None, initial: int = 0, desc: str = "", unit: str = "it", file=None,
                 disable: bool = False, mininterval: float = 0.5, plain_interval: float = PLAIN_INTERVAL_S):
    """A bar on ``file`` (default stderr) with the part of tqdm's interface zoo uses: ``update``, ``set_postfix``,
    ``set_postfix_str``, ``write`` (a line on stdout, above the bar), ``close`` and ``with``.

    ``disable``: draw nothing (``write`` still prints). ``mininterval``: the terminal bar's least time between
    redraws; ``plain_interval``: the least time between plain lines when ``file`` is not a terminal."""
    file = sys.stderr if file is None else file
    if not disable and is_terminal(file):
        return TerminalProgress(total=total, initial=initial, desc=desc, unit=unit, file=file, mininterval=mininterval)
    return PlainProgress(total=total, initial=initial, desc=desc, unit=unit, file=None if disable else file,
                         interval=plain_interval)


class PlainProgress:
    """Progress as whole lines on ``file`` (None: none): one when ``interval`` seconds passed without output (a
    line of this progress or one given to ``write``), and one at ``close`` unless the last one was already final."""

    def __init__(self, *, total, initial, desc, unit, file, interval):
        self.total, self.initial, self.n, self.desc, self.unit = total, initial, initial, desc, unit
        self.file, self.interval = file, interval
        self.postfix = ""
        self.start = self.last_output = time.monotonic()
        self.shown = initial  # the count in the last line written
        self.closed = False

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.file is not None and not self.closed and time.monotonic() - self.last_output >= self.interval:
            self._line()

    def set_postfix(self, ordered_dict=None, refresh: bool = True, **kwargs) -> None:
        del refresh  # shown with the next line
        self.postfix = ", ".join(f"{k}={v}" for k, v in {**(ordered_dict or {}), **kwargs}.items())

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        del refresh
        self.postfix = str(s)

    def write(self, s: str, file=None, end: str = "\n") -> None:
        out = sys.stdout if file is None else file
        out.write(s + end)
        out.flush()  # a log file is block-buffered: keep the lines in the order they happened
        self.last_output = time.monotonic()

    def text(self) -> str:
        """The current line: tqdm's meter without the bar."""
        from tqdm import tqdm

        return tqdm.format_meter(self.n, self.total, time.monotonic() - self.start, ncols=0, prefix=self.desc,
                                 unit=self.unit, postfix=self.postfix or None, initial=self.initial)

    def _line(self) -> None:
        self.file.write(self.text() + "\n")
        self.file.flush()
        self.last_output, self.shown = time.monotonic(), self.n

    def close(self) -> None:
        if not self.closed and self.file is not None and self.n != self.shown:
            self._line()
        self.closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TerminalProgress:
    """tqdm's bar; entered, it also moves every line written through ``sys.stdout``, ``sys.stderr`` and console
    logging handlers above the bar (:class:`_LinesAbove`) until it is closed."""

    def __init__(self, *, total, initial, desc, unit, file, mininterval):
        from tqdm import tqdm

        # disable=False overrides TQDM_DISABLE, which no_bars_in_logs may have set for a stderr that is not this file.
        self.bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, file=file, mininterval=mininterval,
                        dynamic_ncols=True, disable=False)
        self._streams = None  # (sys.stdout, sys.stderr) as they were before __enter__ replaced them
        self._handlers: list[logging.StreamHandler] = []  # those __enter__ gave a _LinesAbove

    def update(self, n: int = 1) -> None:
        self.bar.update(n)

    def set_postfix(self, ordered_dict=None, refresh: bool = True, **kwargs) -> None:
        self.bar.set_postfix(ordered_dict, refresh, **kwargs)

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.bar.set_postfix_str(s, refresh)

    def write(self, s: str, file=None, end: str = "\n") -> None:
        stream = file if file is not None else self._streams[0] if self._streams else sys.stdout
        self.above(s + end, stream)

    def above(self, text: str, stream) -> None:
        """Write ``text`` (whole lines) to ``stream`` above the bar."""
        with self.bar.get_lock():
            self.bar.clear(nolock=True)
            stream.write(text)
            stream.flush()  # before the bar is drawn again, perhaps on another stream to the same screen
            self.bar.refresh(nolock=True)

    def __enter__(self):
        self._streams = sys.stdout, sys.stderr
        for handler in _console_handlers(self._streams):
            try:
                handler.setStream(_LinesAbove(self, handler.stream))
            except AttributeError:  # logging.lastResort: its stream is whatever sys.stderr is, swapped below
                continue
            self._handlers.append(handler)
        sys.stdout, sys.stderr = (_LinesAbove(self, s) for s in self._streams)
        return self

    def close(self) -> None:
        self.bar.close()  # its last state stays on the screen, its line ended
        if self._streams is not None:
            if _is_ours(sys.stdout, self):
                sys.stdout = sys.stdout.drain()
            if _is_ours(sys.stderr, self):
                sys.stderr = sys.stderr.drain()
            self._streams = None
        for handler in self._handlers:
            if _is_ours(handler.stream, self):
                handler.setStream(handler.stream.drain())
        self._handlers.clear()

    def __exit__(self, *exc) -> None:
        self.close()


def _console_handlers(streams) -> list[logging.StreamHandler]:
    """The logging handlers (of every logger made so far) that write to one of ``streams``."""
    loggers = [logging.getLogger(), *(v for v in logging.Logger.manager.loggerDict.values()
                                      if isinstance(v, logging.Logger))]
    found = [h for lg in loggers for h in lg.handlers if isinstance(h, logging.StreamHandler)
             and not isinstance(h, logging.FileHandler) and any(h.stream is s for s in streams)]
    return list(dict.fromkeys(found))  # a handler shared by several loggers, once


class _LinesAbove:
    """A text stream whose whole lines go above a :class:`TerminalProgress` bar; a partial line waits for its end
    (or for the bar's close). Anything else (``fileno``, ``encoding``, ``isatty``) is the wrapped stream's."""

    def __init__(self, progress: TerminalProgress, stream):
        self._progress, self._stream, self._pending = progress, stream, ""

    def write(self, text: str) -> int:
        head, newline, self._pending = (self._pending + text).rpartition("\n")
        if newline:
            self._progress.above(head + newline, self._stream)
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def drain(self):
        """Write the partial line left, if any; returns the wrapped stream."""
        if self._pending:
            self._stream.write(self._pending)
            self._stream.flush()
            self._pending = ""
        return self._stream

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _is_ours(stream, progress: TerminalProgress) -> bool:
    return isinstance(stream, _LinesAbove) and stream._progress is progress

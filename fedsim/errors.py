"""Exceptions that fedsim turns into one clear line instead of a traceback."""

from __future__ import annotations

import contextlib
import errno
import logging
import re
import shutil
import signal
import sys
import threading
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A configuration value is not allowed.

    Parameters
    ----------
    key : str
        Dotted config key, e.g. ``partitioner.alpha``.
    value : Any
        The offending value.
    allowed : str
        What would be accepted, e.g. ``"a float > 0"``.
    hint : str, optional
        One more sentence on how to fix it.
    """

    def __init__(self, key: str, value: Any, allowed: str, hint: str = "") -> None:
        self.key, self.value, self.allowed, self.hint = key, value, allowed, hint
        msg = f"{key}={value!r} is not allowed: expected {allowed}."
        if hint:
            msg += f" {hint}"
        super().__init__(msg)

    def with_prefix(self, prefix: str) -> ConfigError:
        """Return the same error with ``prefix.`` put in front of the key."""
        inside = self.key == prefix or self.key.startswith(prefix + ".")  # already named from the group
        key = f"{prefix}.{self.key}" if prefix and not inside else self.key
        return ConfigError(key, self.value, self.allowed, self.hint)


class OverrideError(ConfigError):
    """An override Hydra cannot compose (an unknown key or option): the message is the command line's line."""

    def __init__(self, key: str, message: str) -> None:
        ValueError.__init__(self, message)
        self.key, self.value, self.allowed, self.hint = key, None, message, ""

    def with_prefix(self, prefix: str) -> ConfigError:
        return self


class DataNotFoundError(ConfigError):
    """A data set's files are missing; the message says which files, where, and how to get them."""

    def __init__(self, key: str, value: Any, expected: str, how: str) -> None:
        super().__init__(key, value, f"a folder holding {expected}", how)


class StopRun(Exception):
    """Raised by a strategy (e.g. an exhausted privacy budget) to end the run cleanly, keeping outputs."""


class RunError(RuntimeError):
    """The run cannot go on (no client ever answers, a client stack that cannot start, ...).

    The command line prints its message as one line and exits 1; the run folder keeps what was done.
    """


class OutputError(RunError):
    """A run-folder file could not be written (full disk, read-only folder, ...); the message names the file."""


def write_error(path, exc: BaseException) -> OutputError:
    """One line naming ``path`` and why writing it failed (``the disk is full`` when that is the cause)."""
    path = Path(path)
    if isinstance(exc, OSError) and exc.strerror:
        reason = exc.strerror
    else:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[-1][:200]
    try:
        free = shutil.disk_usage(path.parent).free
    except OSError:
        free = None
    if getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or (free is not None and free < 1 << 20):
        reason = f"the disk is full ({reason}; {free if free is not None else '?'} bytes free)"
    return OutputError(f"cannot write {path}: {reason}")


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT), SIGTERM or SIGHUP during a run: handled alike; the exit status is 128 + the signal."""

    def __init__(self, signum: int) -> None:
        self.signum = int(signum)
        super().__init__(signal.Signals(self.signum).name)

    def __reduce__(self):  # pickled by a sweep launcher's worker back to its parent (joblib, submitit)
        return (type(self), (self.signum,))


class SignalGuard:
    """Turns SIGINT, SIGTERM and SIGHUP into :class:`Interrupted` while a run is on (see :func:`signals`).

    * :meth:`critical` sections (writes of checkpoint.pt, model.pt, summary.json) are never cut: a signal that
      arrives inside one is raised when the section ends.
    * once the run is :meth:`stopping` (it writes its outputs after an interrupt, or at its end), signals are
      only noted: a second Ctrl-C while plotting costs nothing.
    * :attr:`first` is the first signal received: the exit status is 128 + it.
    """

    NAMES = ("SIGINT", "SIGTERM", "SIGHUP")

    def __init__(self) -> None:
        self.first: int | None = None
        self.pending: int | None = None
        self.depth = 0
        self.is_stopping = False
        self._noted = False

    def handle(self, signum: int, frame=None) -> None:
        if self.first is None:
            self.first = signum
        if self.is_stopping:
            if not self._noted:
                self._noted = True
                logging.getLogger("fedsim").warning(
                    "%s received: writing the run's outputs first (SIGKILL stops at once, losing them)",
                    signal.Signals(signum).name,
                )
            return
        if self.depth:
            self.pending = self.pending or signum
            return
        raise Interrupted(signum)

    def critical(self):
        """Context manager: a section no signal interrupts (one arriving inside is raised at its end)."""

        @contextlib.contextmanager
        def section():
            self.depth += 1
            try:
                yield
            finally:
                self.depth -= 1
            if not self.depth and self.pending is not None and not self.is_stopping:
                signum, self.pending = self.pending, None
                raise Interrupted(signum)

        return section()

    def stopping(self) -> None:
        """From now on signals are only noted (the run is writing its outputs)."""
        self.is_stopping = True

    def check(self) -> None:
        """Raise a signal whose :class:`Interrupted` never reached the run (a check point: the end of a round).

        The handler raises where the main thread happens to be. Inside a finaliser (an object's ``__del__``, a
        weakref callback, run by the garbage collector at any allocation) Python swallows the exception and
        prints "Exception ignored in"; the run would go on to its end and exit 0. The guard's
        ``sys.unraisablehook`` keeps that print off, and this raises the signal at the next check point."""
        if (
            self.first is not None
            and not self.is_stopping
            and not self.depth
            and threading.current_thread() is threading.main_thread()
        ):
            raise Interrupted(self.first)


_PENDING: list[int] = []  # a SIGTERM/SIGHUP noted while the command starts, raised at its next check point


def _defer(signum: int, frame=None) -> None:
    """While the command starts (after its imports): note the signal; :func:`raise_pending` raises it.

    Raising at once would raise inside whatever third-party code runs (an import, Hydra), where a broad
    ``except`` can swallow it: the signal would be lost and the run would go on to its end."""
    if not _PENDING:
        _PENDING.append(signum)


def raise_pending() -> None:
    """Raise :class:`Interrupted` for a signal :func:`_defer` noted (a check point of the command's start)."""
    if _PENDING:
        signum = _PENDING[0]
        _PENDING.clear()
        raise Interrupted(signum)


def _exit_at_once(signum: int, frame=None) -> None:
    import os
    import sys

    sys.stderr.write(f"fedsim: interrupted by {signal.Signals(signum).name}\n")
    sys.stderr.flush()
    os._exit(128 + signum)


def interrupt_from_now_on(importing: bool = False) -> None:
    """For the ``fedsim`` command, from its first line: SIGTERM and SIGHUP (and, while ``importing``, Ctrl-C)
    end it with 128 + N and one line, never a bare -15 or a traceback.

    While ``importing`` (nothing written yet) the process exits at once; after that SIGTERM and SIGHUP are noted
    and raised as :class:`Interrupted` at the start's check points (:func:`raise_pending`: before the run folder
    is prepared, when a job starts, when a run's :func:`signals` guard takes over, when the command ends), and
    Ctrl-C raises ``KeyboardInterrupt`` as usual. Signals the caller ignores (``nohup``) stay ignored.
    """
    names = ("SIGTERM", "SIGHUP", "SIGINT") if importing else ("SIGTERM", "SIGHUP")
    for name in names:
        sig = getattr(signal, name, None)
        if sig is None or signal.getsignal(sig) is signal.SIG_IGN:
            continue
        if importing or signal.getsignal(sig) in (signal.SIG_DFL, _exit_at_once):
            signal.signal(sig, _exit_at_once if importing else _defer)
    if not importing and signal.getsignal(signal.SIGINT) is _exit_at_once:
        signal.signal(signal.SIGINT, signal.default_int_handler)


_GUARD: SignalGuard | None = None
# Set by the command line, whose process ends with the run: after an interrupted run, later signals are ignored
# (restoring Python's handler would let a third Ctrl-C kill the process while it exits, with status -2).
IGNORE_AFTER_INTERRUPT = False


def critical():
    """A section no signal interrupts, when a run's :func:`signals` guard is on (else a no-op)."""
    return _GUARD.critical() if _GUARD is not None else contextlib.nullcontext()


def check_signals() -> None:
    """Raise a signal the run's :func:`signals` guard received but that never reached the run (a check point:
    :meth:`SignalGuard.check`); a no-op without a guard."""
    if _GUARD is not None:
        _GUARD.check()


def signals():
    """Context manager: while it is open, SIGINT/SIGTERM/SIGHUP raise :class:`Interrupted` (main thread only).

    Yields the :class:`SignalGuard` (``None`` outside the main thread, where Python cannot catch signals).
    The previous handlers come back when it closes.
    """

    @contextlib.contextmanager
    def guard():
        global _GUARD
        if threading.current_thread() is not threading.main_thread() or _GUARD is not None:
            yield _GUARD
            return
        g = SignalGuard()
        previous = {}
        for name in SignalGuard.NAMES:
            sig = getattr(signal, name, None)
            if (
                sig is not None and signal.getsignal(sig) is not signal.SIG_IGN
            ):  # nohup, `cmd &`: stay ignored
                previous[sig] = signal.signal(sig, g.handle)
        _GUARD = g
        unraisable = sys.unraisablehook

        def hook(info) -> None:  # a signal raised inside a finaliser: raised again at g.check, not printed
            if not isinstance(info.exc_value, Interrupted):
                unraisable(info)

        sys.unraisablehook = hook
        try:
            raise_pending()  # a signal noted while the command started: the run ends before it begins
            yield g
        finally:
            if sys.unraisablehook is hook:
                sys.unraisablehook = unraisable
            _GUARD = None
            for sig, handler in previous.items():
                if g.first is not None and IGNORE_AFTER_INTERRUPT:
                    handler = signal.SIG_IGN
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)

    return guard()


# ------------------------------------------------------------------ the user's own files and code, in one line
def cause_chain(e: BaseException) -> list[BaseException]:
    """``e`` and the exceptions it was raised from (``__cause__``, else ``__context__``), outermost first."""
    out: list[BaseException] = []
    while e is not None and e not in out and len(out) < 20:
        out.append(e)
        e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    return out


def yaml_problem(e: BaseException) -> str | None:
    """``FILE, line N: not valid YAML (problem)`` when a YAML file could not be parsed, else None."""
    try:
        import yaml
    except ImportError:  # pragma: no cover  (Hydra needs it)
        return None
    for x in cause_chain(e):
        if isinstance(x, yaml.MarkedYAMLError):
            mark = x.problem_mark or x.context_mark
            where = f"{mark.name}, line {mark.line + 1}" if mark is not None else "a YAML file"
            return f"{where}: not valid YAML ({x.problem or x.context})"
    return None


def _library_file(path: str) -> bool:
    """A file of fedsim, of an installed package or of Python itself (not the user's own code)."""
    import sys
    import sysconfig

    if not path or path.startswith("<"):
        return True
    p = str(Path(path).resolve())
    roots = {str(Path(__file__).resolve().parent)}  # fedsim
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        with contextlib.suppress(KeyError):
            roots.add(str(Path(sysconfig.get_paths()[key]).resolve()))
    roots |= {str(Path(p_).resolve()) for p_ in sys.path if "site-packages" in p_ or "dist-packages" in p_}
    return any(p.startswith(r + "/") for r in roots) or "/site-packages/" in p or "/dist-packages/" in p


def where_it_failed(e: BaseException) -> str:
    """The original error of ``e`` in one line, with the file and line it came from.

    ``FILE:LINE: Type: message``: for a syntax error, the line Python could not read; otherwise the innermost
    line of the user's own code in the traceback (the frame outside fedsim, installed packages and Python),
    else the innermost line of all. Wrappers (Hydra's ``InstantiationException``, an ``ImportError`` around a
    module that failed to import) are seen through to the error they were raised from.
    """
    chain = cause_chain(e)
    for x in chain:
        if isinstance(x, SyntaxError) and x.filename:
            return f"{x.filename}:{x.lineno}: {type(x).__name__}: {x.msg}"
    original = chain[-1]
    frames = []
    tb = original.__traceback__
    while tb is not None:
        frames.append((tb.tb_frame.f_code.co_filename, tb.tb_lineno))
        tb = tb.tb_next
    user = [f for f in frames if not _library_file(f[0])]
    file, line = (user or frames or [("?", 0)])[-1]
    text = (str(original).strip().splitlines() or [""])[0][:300]
    return f"{file}:{line}: {type(original).__name__}" + (f": {text}" if text else "")


# ------------------------------------------------------------------------ a client's error, as one line
REPLY_ERROR_CHARS = 300  # characters of an error reply's message kept in its one-line summary

# the exceptions Flower and Ray wrap a ClientApp's own in (their messages repeat it without its type)
_WRAPPERS = frozenset({"ClientAppException", "RayTaskError", "RayActorError"})
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_FLOWER_REASON = re.compile(r"<class '([\w.()]+)'>:<'(.*?)'>(?=\n|$)", re.S)  # "<class 'T'>:<'message'>"
_EXCEPTION_LINE = re.compile(r"(?:[A-Za-z_]\w*\.)*([A-Za-z_]\w*)(?:\([\w.]*\))?: ?(.*)")
_CHAIN_BREAKS = ("The above exception", "During handling of the above", "Traceback (most recent")


def _exception_line(line: str) -> tuple[str, str] | None:
    """``(type, message start)`` of a traceback's last line (``KeyError: 'lr'``), else None."""
    m = _EXCEPTION_LINE.fullmatch(line)
    if m is None or not re.search(r"(Error|Exception|Exit|Interrupt|Timeout)\w*$", m.group(1)):
        return None
    return m.group(1), m.group(2)


def reply_error(reason: str, limit: int = REPLY_ERROR_CHARS) -> str:
    """One line for an error reply's ``reason``: the client's exception type and the first ``limit`` characters
    of its whole message (every line of it: the key names of ``Error(s) in loading state_dict``).

    Reads Flower's deployed form (``<class 'KeyError'>:<''lr''>``), a simulation's Ray traceback (the original
    exception, not Flower's ``ClientAppException`` wrapper around it) and fedsim's pool engine's form (both).
    """
    text = _ANSI.sub("", str(reason))
    flower = _FLOWER_REASON.match(text)
    if flower is not None:  # the message itself, then what follows it (fedsim's pool engine: a traceback)
        text = flower.group(2) + text[flower.end() :]
    found, lines = None, text.splitlines()
    for i, line in enumerate(lines):
        hit = _exception_line(line)
        if hit is not None and hit[0] not in _WRAPPERS:
            found = i, hit
    if found is not None:
        i, (kind, start) = found
        rest = []
        for line in lines[i + 1 :]:
            if line.startswith(_CHAIN_BREAKS):
                break
            rest.append(line)
        message = " ".join([start, *rest])
    else:
        kind = flower.group(1).rsplit(".", 1)[-1] if flower is not None else ""
        message = flower.group(2) if flower is not None else text
    message = " ".join(message.split())
    if len(message) > limit:
        message = message[:limit].rstrip() + " ..."
    return f"{kind}: {message}" if kind else (message or "unknown error")


# Flower's log lines about a ClientApp's exception (the Ray traceback, twice, and a notice), in its own logger
_CLIENT_TRACEBACK_MARKERS = (
    "Traceback (most recent call last)",
    "ClientAppException",
    "An exception was raised when processing a message",
)


class ClientTracebacks(logging.Filter):
    """A filter for Flower's logger that moves its records of a client's exception to the file ``path``
    (opened at the first one), off the console: the server's one-line warning per kind of failure stands for
    them (:func:`reply_error`). ``count`` is how many it moved."""

    def __init__(self, path: str | Path) -> None:
        super().__init__()
        self.path, self.count = Path(path), 0
        self._handler: logging.Handler | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        text = record.getMessage()
        if not record.exc_info and not any(m in text for m in _CLIENT_TRACEBACK_MARKERS):
            return True
        if self._handler is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._handler = logging.FileHandler(self.path, encoding="utf-8")
            self._handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        self._handler.handle(record)
        self.count += 1
        return False

    def close(self) -> None:
        """Close the file."""
        if self._handler is not None:
            self._handler.close()


@contextlib.contextmanager
def client_tracebacks_to(path: str | Path, logger: str = "flwr"):
    """Within the block, Flower's records of a client's exception go to ``path``, not to the console; on the
    way out, one warning line names the file when any went there."""
    moved = ClientTracebacks(path)
    flwr_log = logging.getLogger(logger)
    flwr_log.addFilter(moved)
    try:
        yield moved
    finally:
        flwr_log.removeFilter(moved)
        moved.close()
        if moved.count:
            logging.getLogger("fedsim").warning(
                "%d log record(s) of client exceptions (tracebacks) are in %s", moved.count, moved.path
            )

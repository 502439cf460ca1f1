"""The runner's log: one stream (stderr), two renderings, the attempt's identity, progress.

When stderr is not a terminal every line the runner writes there is one JSON object (for
log shippers); when it is, the same events render as readable lines, and long transfers
draw a live bar below them. ``FLASH_LOG_FORMAT=json|console`` (the runner's environment)
forces either. The one exception is the process's last line, its reason (CONTRACT
section 2): :func:`silence` drops every event before it is written.

Every event passes through a redaction processor holding the attempt's own redactor
(:func:`attach`): a secret value that reaches a log call is masked before it is rendered.
There is no module-level redactor: the processor in structlog's chain is the one place,
and each attempt puts its own there.

Every event carries the attempt's identity (``run_id``, ``attempt``, ``state``), bound
once where it is learned (:func:`bind`) rather than passed by hand.
One process runs one attempt, so the identity is the process's: the threads a library or
a monitor starts carry it too (``contextvars`` would not reach them).

:class:`Progress` reports long work (a download, an install, the worker) as
``<name>.progress`` events at a bounded rate: at the start, about every ``every_s``
seconds, and at the end.

:func:`quiet_libraries` keeps the libraries' own output out of that stream, for the
runner's process only: their progress bars off (set before they are imported), and what
they still write to ``sys.stderr`` (warnings, a library's log handler) turned into events.
"""

from __future__ import annotations

import io
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from contextlib import AbstractContextManager, contextmanager, suppress
from typing import Any, TextIO

import structlog

from fsm.output.redact import Redactor

__all__ = [
    "FORMAT_SETTING",
    "QUIET_SETTINGS",
    "Progress",
    "RedactEvent",
    "attach",
    "bind",
    "configure",
    "quiet_libraries",
    "silence",
]

#: The environment variable that forces a rendering: ``json`` or ``console``.
FORMAT_SETTING = "FLASH_LOG_FORMAT"
#: What turns the libraries' progress bars off (huggingface_hub reads its setting once,
#: at its first import; tqdm's own switch covers other users of tqdm). Set in the
#: runner's process only: the worker's environment is built from the payload's.
QUIET_SETTINGS: Mapping[str, str] = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1"}
#: How often a :class:`Progress` reports while work goes on.
EVERY_S = 10.0
_BAR_REDRAW_S = 0.1  # a live bar is redrawn at most this often
_CLEAR_LINE = "\r\x1b[K"

# The attempt's identity, merged into every event (see _add_identity).
_identity: dict[str, Any] = {}
_lines: _Lines | None = None  # where readable lines go (console rendering only)


class RedactEvent:
    """structlog processor: mask every secret the attempt knows in every value."""

    def __init__(self, redactor: Redactor) -> None:
        self.redactor = redactor

    def __call__(
        self, _logger: Any, _method: str, event: MutableMapping[str, Any]
    ) -> MutableMapping[str, Any]:
        return {key: self.redactor.deep(value) for key, value in event.items()}


def _add_identity(
    _logger: Any, _method: str, event: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """The identity first; an event's own ``state`` wins (the state it is about), but
    ``attempt`` always names the attempt: an event's own (a retry's try number) is kept
    as ``try``."""
    if "attempt" in _identity and "attempt" in event:
        event = dict(event)
        event.setdefault("try", event.pop("attempt"))
    return {**_identity, **event}


def configure(stream: TextIO | None = None, *, json: bool | None = None) -> None:
    """Route structlog to ``stream`` (stderr): JSON lines, or readable lines (``json``
    False) with live progress bars when the stream is a terminal. Unless ``json`` is
    given, ``FLASH_LOG_FORMAT`` decides, else JSON lines unless the stream is a terminal."""
    global _lines
    stream = stream or sys.stderr
    if isinstance(stream, _StderrEvents):
        stream = stream.real
    forced = os.environ.get(FORMAT_SETTING, "").strip().lower()
    if json is None:
        json = forced == "json" if forced in ("json", "console") else not _is_terminal(stream)
    # A JSON line is one write of the line and its newline: an outlet's one offer.
    logger = _Lines(stream, live=not json and _is_terminal(stream))
    _lines = None if json else logger
    renderer: Any = structlog.processors.JSONRenderer() if json else _render_line
    structlog.configure(
        processors=[
            _add_identity,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            RedactEvent(Redactor()),
            # The message goes to "msg"; a transition's trigger ("_event") becomes "event".
            structlog.processors.EventRenamer("msg", replace_by="_event"),
            renderer,
        ],
        logger_factory=lambda *_args: logger,
        cache_logger_on_first_use=False,
    )
    if forced not in ("", "json", "console"):
        structlog.get_logger("fsm.log").warning(
            "log.format_unknown", setting=FORMAT_SETTING, value=os.environ[FORMAT_SETTING],
            using="json" if json else "console",
        )


def attach(redactor: Redactor) -> None:
    """Make ``redactor`` (the attempt's) the one every log event passes through from now,
    and forget the identity of an attempt before (a new attempt starts)."""
    _identity.clear()
    # Also where someone else configured structlog (a test, an embedding program): the
    # redaction goes just before the renderer.
    processors = [p for p in structlog.get_config()["processors"]
                  if not isinstance(p, RedactEvent)]
    processors.insert(max(0, len(processors) - 1), RedactEvent(redactor))
    structlog.configure(processors=processors)


def bind(**fields: Any) -> None:
    """Add ``fields`` to the identity every event carries from now (None: remove one)."""
    # Kept in a fixed order (run_id, attempt, state, then the rest): the JSON lines start alike.
    merged = {**dict.fromkeys(("run_id", "attempt", "state")), **_identity, **fields}
    _identity.clear()
    _identity.update((key, value) for key, value in merged.items() if value is not None)


def _drop(_logger: Any, _method: str, _event: MutableMapping[str, Any]) -> Any:
    raise structlog.DropEvent


def silence() -> None:
    """Drop every log event from here on: the process's last stderr line is its reason
    (CONTRACT section 2), whatever a lingering thread still has to say."""
    if isinstance(sys.stderr, _StderrEvents):
        sys.stderr.release()  # what a library left half-written is an event; then pass through
    structlog.configure(processors=[_drop])
    if _lines is not None:
        with suppress(OSError, ValueError):  # a stream closed already
            _lines.close()


# --- the libraries' output ------------------------------------------------------------------


def quiet_libraries(environ: MutableMapping[str, str] | None = None) -> None:
    """Keep the libraries' output out of the runner's stderr format (the runner's process
    only; call it before ``huggingface_hub`` is imported): :data:`QUIET_SETTINGS` into
    ``environ`` (``os.environ``), and with JSON lines, whatever is still written to
    ``sys.stderr`` (a warning, a library's log handler, a traceback) becomes a
    ``library.stderr`` event per line, until :func:`silence`."""
    (os.environ if environ is None else environ).update(QUIET_SETTINGS)
    if _lines is None and not isinstance(sys.stderr, _StderrEvents):
        sys.stderr = _StderrEvents(sys.stderr)


class _StderrEvents(io.TextIOBase):
    """``sys.stderr`` while the runner logs JSON lines: each line written to it becomes a
    ``library.stderr`` event (of a line redrawn with ``\\r``, the last drawing), so no
    library text lands between, or inside, the JSON lines. After :meth:`release` it
    passes everything through to the real stream (the process's last line)."""

    def __init__(self, real: TextIO) -> None:
        super().__init__()
        self.real = real
        self._pending = ""
        self._lock = threading.RLock()
        self._released = False
        self._inside = False

    def write(self, text: str) -> int:
        with self._lock:
            if self._released or self._inside:  # after silence(), or a renderer's own write
                with suppress(Exception):
                    self.real.write(text)
                return len(text)
            self._pending += text
            *lines, self._pending = self._pending.split("\n")
            _, redrawn, drawing = self._pending.rpartition("\r")
            if redrawn and drawing:  # a bar redrawn in place: only its last drawing counts
                self._pending = drawing
            for line in lines:
                self._emit(line)
        return len(text)

    def _emit(self, line: str) -> None:
        text = line.rstrip("\r").rsplit("\r", 1)[-1].strip()
        if not text:
            return
        self._inside = True
        try:
            structlog.get_logger("fsm.log").warning("library.stderr", text=text)
        finally:
            self._inside = False

    def release(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, ""
            self._emit(pending)
            self._released = True

    def flush(self) -> None:
        with suppress(Exception):
            self.real.flush()

    def fileno(self) -> int:
        return self.real.fileno()

    def isatty(self) -> bool:
        return self.real.isatty()

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:  # type: ignore[override]  # the real stream's
        return getattr(self.real, "encoding", "utf-8")


# --- readable lines and live bars -------------------------------------------------------------


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError, OSError):
        return False


class _Lines:
    """structlog's logger: each rendered event is written as a line and flushed, and a
    stream that fails never raises into the caller (``fsm.output.outlet``: under ``run``
    the stream never blocks either). With readable lines on a terminal (``live``) the live
    progress bars stay below the lines."""

    def __init__(self, stream: TextIO, *, live: bool) -> None:
        self.stream = stream
        self.live = live
        self._bars: dict[int, str] = {}
        self._lock = threading.RLock()  # a stream whose write logs does not deadlock

    def msg(self, line: str) -> None:
        with suppress(Exception), self._lock:  # a log line never breaks what it reports
            self.stream.write((_CLEAR_LINE if self._bars else "") + line + "\n")
            self._draw()

    log = debug = info = warn = warning = fatal = failure = err = error = critical = msg
    exception = msg

    def show(self, key: int, bar: str | None) -> None:
        """Draw (None: remove) the bar ``key``; every bar shares the last line."""
        with self._lock:
            if not self.live:  # not a terminal, or closed
                return
            if bar is None:
                self._bars.pop(key, None)
            else:
                self._bars[key] = bar
            with suppress(Exception):
                self.stream.write(_CLEAR_LINE)
                self._draw()

    def close(self) -> None:
        """Clear the bars and draw no more, as if not live (the process's last line comes
        next)."""
        with self._lock:
            if self._bars:
                self.stream.write(_CLEAR_LINE)
            self._bars.clear()
            self.live = False
            self.stream.flush()

    def _draw(self) -> None:
        if self._bars:
            text = " | ".join(self._bars.values())
            self.stream.write(text[: _width(self.stream) - 1])
        self.stream.flush()


def _width(stream: TextIO) -> int:
    try:
        columns = os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, ValueError, OSError):
        columns = 0
    return columns if columns > 20 else 100  # a pty nobody sized says 0


#: Fields a readable line leaves out: the person at the terminal watches one attempt.
_HIDDEN = ("run_id", "attempt", "level", "timestamp", "msg", "state", "exception")


def _render_line(_logger: Any, _method: str, event: MutableMapping[str, Any]) -> str:
    """One readable line: ``12:00:01 info    [Preload] preload.progress  3/5 files, ...``."""
    when = str(event.get("timestamp", ""))[11:19]
    state = event.get("state")
    head = f"{when} {event.get('level', '')!s:<7} " + (f"[{state}] " if state else "")
    msg = str(event.get("msg", ""))
    fields = {k: v for k, v in event.items() if k not in _HIDDEN}
    if msg.endswith(".progress"):
        summary = _summary(fields)
        fields = {k: v for k, v in fields.items() if k not in _PROGRESS_KEYS}
        msg = f"{msg} {fields.pop('report', '')}  {summary}".rstrip()
    elif msg == "state.changed" and {"from", "event", "to"} <= fields.keys():
        msg += f"  {fields.pop('from')} --{fields.pop('event')}--> {fields.pop('to')}"
    line = head + msg + "".join(f"  {k}={_shown(v)}" for k, v in fields.items())
    exc = event.get("exception")
    return f"{line}\n{exc}" if exc else line


def _shown(value: object) -> str:
    if isinstance(value, str):
        return value if value and " " not in value else json.dumps(value)
    return json.dumps(value, default=str, separators=(",", ":"))


# --- progress ----------------------------------------------------------------------------------

_PROGRESS_KEYS = ("files_done", "files_total", "bytes_done", "bytes_total", "bytes_per_s",
                  "seconds")


def _size(n: float) -> str:
    for unit in ("B", "kB", "MB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def _summary(fields: Mapping[str, Any]) -> str:
    """``3/5 files, 12.3 MB of 40.0 MB (30%), 5.1 MB/s, 8s`` from a progress event."""
    parts = []
    if "files_done" in fields:
        total = fields.get("files_total")
        parts.append(f"{fields['files_done']}/{'?' if total is None else total} files")
    if "bytes_done" in fields:
        done, total = fields["bytes_done"], fields.get("bytes_total")
        parts.append(f"{_size(done)} of {_size(total)} ({100 * done // total}%)" if total
                     else _size(done))
    if fields.get("bytes_per_s"):
        parts.append(f"{_size(fields['bytes_per_s'])}/s")
    if "seconds" in fields:
        parts.append(f"{fields['seconds']:.0f}s")
    return ", ".join(parts)


class Progress(AbstractContextManager["Progress"]):
    """Long work's progress as ``<name>.progress`` events, at a bounded rate.

    One event when created (``report: start``), then at most one every ``every_s``
    seconds while the work advances (:meth:`advance`, :meth:`set`) or is watched
    (:meth:`watch`), and one at the end (:meth:`done`, ``report: end``). Each carries
    ``files_done``/``files_total`` and ``bytes_done``/``bytes_total`` (those it counts),
    ``bytes_per_s`` (since the start), ``seconds`` (since the start), the attempt's
    identity, and ``fields`` (the latest values). On a terminal a transfer (one with a
    total) also draws a live bar. Thread-safe; it never raises into the work it reports.
    As a context manager it ends with the block (``ok`` False when the block raised)::

        with Progress("fetch", total_files=len(paths), total_bytes=size) as progress:
            for path in paths:
                ...  # fetch it
                progress.advance(files=1, bytes=path_size)
    """

    def __init__(
        self,
        name: str,
        *,
        total_files: int | None = None,
        total_bytes: int | None = None,
        every_s: float = EVERY_S,
        clock: Callable[[], float] = time.monotonic,
        **fields: Any,
    ) -> None:
        self.name = name
        self.total_files = total_files
        self.total_bytes = total_bytes
        self.files = self.bytes = 0
        self.fields = dict(fields)
        self.every_s = every_s
        self._clock = clock
        self._lock = threading.RLock()
        self._started = self._last = clock()
        self._drawn = float("-inf")
        self._ended = False
        self._log = structlog.get_logger("fsm.progress")
        self._emit("start")  # nobody else holds it yet: no lock

    def advance(self, *, files: int = 0, bytes: int = 0, **fields: Any) -> None:
        """``files`` more files and ``bytes`` more bytes are done (``fields``: the latest
        values of other fields)."""
        with self._lock:
            self.set(files=self.files + files, bytes=self.bytes + bytes, **fields)

    def set(
        self, *, files: int | None = None, bytes: int | None = None, **fields: Any
    ) -> None:
        """``files`` files and ``bytes`` bytes are done in all (a measurement)."""
        with self._lock:
            if self._ended:
                return
            self.files = self.files if files is None else files
            self.bytes = self.bytes if bytes is None else bytes
            self.fields.update(fields)
            now = self._clock()
            if now - self._last >= self.every_s:
                self._emit("update")
            if _lines is not None and _lines.live and now - self._drawn >= _BAR_REDRAW_S:
                self._drawn = now
                if (bar := self._bar()) is not None:
                    _lines.show(id(self), bar)

    def done(self, *, ok: bool = True, **fields: Any) -> None:
        """The end event (once; later calls, and updates after it, do nothing)."""
        with self._lock:
            if self._ended:
                return
            self.fields.update(fields)
            self._ended = True
            if _lines is not None:
                _lines.show(id(self), None)  # the end line replaces the bar
            self._emit("end", ok=ok)

    def __exit__(self, exc_type: object, *_exc: object) -> None:
        self.done(ok=exc_type is None)  # unless done already

    @contextmanager
    def watch(
        self, measure: Callable[[], Mapping[str, Any]] | None = None, *,
        poll_s: float | None = None,
    ) -> Iterator[Progress]:
        """While the block runs, a daemon thread calls ``measure()`` every ``poll_s``
        seconds and :meth:`set` s what it returns (``files``, ``bytes``, other fields), so
        the events come about every ``every_s`` seconds even while the work is silent;
        ``measure`` is asked once more at the end of the block. A failing ``measure`` is
        skipped."""
        live = _lines is not None and _lines.live
        poll = poll_s if poll_s is not None else min(self.every_s, 0.25 if live else 1.0)
        stop = threading.Event()

        def look() -> None:
            # A measurement that fails (a file gone while it was counted) is not reported.
            with suppress(Exception):
                self.set(**(measure() if measure is not None else {}))

        def run() -> None:
            while not stop.wait(poll):
                look()

        thread = threading.Thread(target=run, name=f"progress-{self.name}", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join(timeout=poll + 1.0)
            if measure is not None:
                look()

    # --- internals ------------------------------------------------------------------------

    def _emit(self, report: str, **extra: Any) -> None:
        self._last = now = self._clock()
        event: dict[str, Any] = {"report": report}
        if self.total_files is not None or self.files:
            event.update(files_done=self.files, files_total=self.total_files)
        if self.total_bytes is not None or self.bytes:
            event.update(bytes_done=self.bytes, bytes_total=self.total_bytes)
            seconds = now - self._started
            if seconds > 0:
                event["bytes_per_s"] = round(self.bytes / seconds)
        event["seconds"] = round(now - self._started, 1)
        with suppress(Exception):  # a report never breaks the work it reports
            self._log.info(f"{self.name}.progress", **event, **self.fields, **extra)

    def _bar(self) -> str | None:
        if self.total_bytes:
            done, total = self.bytes, self.total_bytes
        elif self.total_files:
            done, total = self.files, self.total_files
        else:
            return None
        share = min(1.0, done / total)
        cells = round(20 * share)
        label = " ".join([self.name, *(v for v in self.fields.values() if isinstance(v, str))])
        seconds = self._clock() - self._started
        rate = self.bytes / seconds if seconds > 0 else 0
        amounts = (f"{_size(self.bytes)}/{_size(total)}  {_size(rate)}/s" if self.total_bytes
                   else f"{done}/{total} files")
        return f"{label} [{'#' * cells}{'.' * (20 - cells)}] {share:4.0%}  {amounts}"

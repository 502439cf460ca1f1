"""The runner's own output: its stdout and stderr as outlets that can never cost the marker.

Every byte the runner writes to a descriptor it does not own (its log lines on stderr, the
worker's console passed on to stdout, the process's last line) is handed to a daemon
thread that writes it, through a bounded buffer. Handing it over never raises, and it
blocks for no more than a short bound:

* a descriptor whose reader is gone (``EPIPE``: a dead log shipper, a killed ``| tee``),
  closed, or failing is given up at the first failed write: what was waiting and what is
  offered afterwards is dropped and counted;
* a descriptor nobody reads (a full pipe: Docker's blocking log mode with its collector
  down) blocks only the writer thread: the buffer fills, and what does not fit is dropped
  and counted. An outlet may let an offer wait a little for room (``wait_s``: the worker's
  console keeps its backpressure on a slow reader); once such a wait ended in vain, offers
  drop at once until the writer catches up again, so a reader that stopped for good costs
  one wait, not one per chunk.

The counts go into the marker's evidence (``output``, :func:`evidence`). Nothing here logs:
the log is what it carries.

:func:`reopen_closed` is the first thing ``flash-bootstrap`` does: descriptors 0, 1 and 2
that are closed are opened on ``/dev/null``, so no file the runner opens later (the
attempt's lock, the console) can take their number and receive what is written there.
:func:`install` puts the outlets under ``sys.stdout`` and ``sys.stderr`` for ``run``;
:func:`leave` gives them a short bound to drain and ends the process.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import io
import os
import select
import sys
import threading
import time

__all__ = [
    "STDOUT",
    "Outlet",
    "evidence",
    "install",
    "leave",
    "reopen_closed",
    "settle",
]

#: How long :func:`leave` waits, in all, for the outlets to write what they hold.
LEAVE_BOUND_S = 2.0
#: Buffer sizes: the log's lines, and the worker's console passed on to stdout.
STDERR_CAPACITY = 1 << 20
STDOUT_CAPACITY = 8 << 20
#: How long one chunk of the worker's console may wait for room in the stdout buffer.
STDOUT_WAIT_S = 1.0
_POLL_MS = 1000  # a writer on a descriptor someone made non-blocking looks again this often


class Outlet:
    """One descriptor written by a daemon thread from a bounded buffer.

    :meth:`offer` queues bytes and returns at once (after at most ``wait_s`` when the
    buffer is full); it never raises. What is dropped is counted in ``dropped_writes`` and
    ``dropped_bytes``; ``broken`` names the error that ended writing (``"EPIPE"``), if any.
    """

    def __init__(self, fd: int, name: str, *, capacity: int, wait_s: float = 0.0) -> None:
        self.fd = fd
        self.name = name
        self.capacity = capacity
        self.wait_s = wait_s
        self.broken: str | None = None
        self.dropped_writes = 0
        self.dropped_bytes = 0
        self._queue: collections.deque[bytes] = collections.deque()
        #: Bytes offered and not yet written (the chunk being written too).
        self.pending = 0
        self._cond = threading.Condition(threading.Lock())
        self._thread: threading.Thread | None = None
        self._stalled = False
        self._closing = False
        self._writing_since: float | None = None  # monotonic start of the write under way

    def __repr__(self) -> str:
        return f"Outlet({self.name!r}, fd={self.fd}, broken={self.broken!r})"

    def offer(self, data: bytes) -> bool:
        """Hand ``data`` over for writing; False when it was dropped instead."""
        if not data:
            return True
        with self._cond:
            wait = not self._no_wait(data) and self.wait_s > 0 and not self._stalled
            if wait and not self._cond.wait_for(lambda: self._no_wait(data), timeout=self.wait_s):
                self._stalled = True  # the reader stopped: no more waiting for it
            if self.broken is not None or self._closing or not self._no_wait(data):
                self.dropped_writes += 1
                self.dropped_bytes += len(data)
                return False
            self._queue.append(data)
            self.pending += len(data)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"flash-outlet-{self.name}", daemon=True)
                self._thread.start()
            self._cond.notify_all()
            return True

    def _no_wait(self, data: bytes) -> bool:
        """Whether ``data`` fits now, or never will be written (broken): no use waiting."""
        fits = self.pending + len(data) <= self.capacity or not self.pending
        return fits or self.broken is not None

    def drain(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until everything offered so far is written (or given
        up); True when nothing is left waiting."""
        with self._cond:
            return self._cond.wait_for(
                lambda: not self.pending or self.broken is not None, timeout=max(0.0, timeout_s))

    def close(self, drain_s: float) -> None:
        """Drain (bounded), then let the writer end; later offers are dropped. A writer
        blocked on its descriptor is left to the process's end (it is a daemon)."""
        self.drain(drain_s)
        with self._cond:
            self._closing = True
            self._cond.notify_all()

    def stuck_s(self) -> float:
        """How long the write under way has been waiting for its reader (0: none)."""
        since = self._writing_since
        return 0.0 if since is None else time.monotonic() - since

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    if self._closing:
                        return
                    self._cond.wait()
                chunk = self._queue.popleft()
                self._writing_since = time.monotonic()
            try:
                _write_all(self.fd, chunk)
            except OSError as exc:
                with self._cond:
                    self.broken = errno.errorcode.get(exc.errno or 0, type(exc).__name__)
                    self.dropped_writes += 1 + len(self._queue)
                    self.dropped_bytes += self.pending
                    self._queue.clear()
                    self.pending = 0
                    self._cond.notify_all()
                return
            with self._cond:
                self._writing_since = None
                self.pending -= len(chunk)
                if self.pending <= self.capacity // 2:
                    self._stalled = False  # the reader keeps up again
                self._cond.notify_all()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:  # someone made the descriptor non-blocking: wait for room
            poll = select.poll()
            poll.register(fd, select.POLLOUT)
            poll.poll(_POLL_MS)


class OutletStream(io.TextIOBase):
    """A text stream over an :class:`Outlet` (``sys.stdout``, ``sys.stderr`` of ``run``):
    whole lines are offered as they complete, the rest at :meth:`flush`. Never raises,
    never blocks beyond the outlet's own bound."""

    def __init__(self, outlet: Outlet) -> None:
        super().__init__()
        self.outlet = outlet
        self._pending = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            self._pending += text
            head, newline, rest = self._pending.rpartition("\n")
            if newline:
                self._pending = rest
                self.outlet.offer((head + newline).encode("utf-8", "backslashreplace"))
        return len(text)

    def flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, ""
        if pending:
            self.outlet.offer(pending.encode("utf-8", "backslashreplace"))

    @property
    def buffer(self) -> _BinaryView:
        """For code that writes bytes to ``sys.stdout.buffer`` (a library in the runner's
        process): through the same outlet, after the text before it."""
        return _BinaryView(self)

    def fileno(self) -> int:
        return self.outlet.fd

    def isatty(self) -> bool:
        return os.isatty(self.outlet.fd)  # False for a closed descriptor, never raises

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:  # type: ignore[override]  # always UTF-8
        return "utf-8"

    @property
    def errors(self) -> str:  # type: ignore[override]
        return "backslashreplace"


class _BinaryView:
    def __init__(self, stream: OutletStream) -> None:
        self._stream = stream

    def write(self, data: bytes) -> int:
        self._stream.flush()
        self._stream.outlet.offer(bytes(data))
        return len(data)

    def flush(self) -> None:
        self._stream.flush()


#: The process's outlets once :func:`install` ran (``flash-bootstrap run``), else None.
STDOUT: Outlet | None = None
STDERR: Outlet | None = None


def reopen_closed() -> None:
    """Open ``/dev/null`` on each of descriptors 0, 1 and 2 that is closed (and give
    Python a stream for it), so that no file opened later takes their number."""
    for fd, name in enumerate(("stdin", "stdout", "stderr")):
        with contextlib.suppress(OSError):
            os.fstat(fd)
            continue  # open
        try:  # the lower descriptors are open by now, so this is the lowest free one
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            os.set_inheritable(fd, True)
        except OSError:
            continue
        if getattr(sys, name) is None:
            with contextlib.suppress(OSError, ValueError):
                setattr(sys, name, open(fd, "r" if fd == 0 else "w", closefd=False))  # noqa: SIM115


def install() -> None:
    """Put outlets under ``sys.stdout`` and ``sys.stderr`` (``flash-bootstrap run``): from
    here on nothing the runner writes there can raise or block it."""
    global STDOUT, STDERR
    _flush()  # what Python buffered before goes first
    STDOUT = Outlet(1, "stdout", capacity=STDOUT_CAPACITY, wait_s=STDOUT_WAIT_S)
    STDERR = Outlet(2, "stderr", capacity=STDERR_CAPACITY)
    sys.stdout = OutletStream(STDOUT)
    sys.stderr = OutletStream(STDERR)


def _flush() -> None:
    """Flush Python's ``sys.stdout`` and ``sys.stderr``, whatever they are (None, closed)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def settle(bound_s: float) -> None:
    """The log's lines offered so far written, or stopped by their error, within
    ``bound_s`` (before :func:`evidence` reads what was lost)."""
    if STDERR is not None:
        STDERR.drain(bound_s)


def evidence(*outlets: Outlet | None) -> dict[str, object] | None:
    """What the outlets could not write so far, for the marker (None when nothing was
    lost): lines of the log (stderr) or bytes of the worker's console (stdout) dropped,
    the error that broke one, and for one whose reader stopped reading, how long it has
    waited (``stuck_s``: a write under way when the marker is built; a reader that keeps up
    takes microseconds) and the bytes still waiting (``pending_bytes``)."""
    found: dict[str, object] = {}
    for outlet in (*outlets, STDERR):
        if outlet is None or outlet.name in found:
            continue
        stuck = outlet.stuck_s()
        if not (outlet.dropped_writes or outlet.broken or stuck > 0):
            continue
        entry: dict[str, object] = (
            {"dropped_lines": outlet.dropped_writes} if outlet is STDERR
            else {"dropped_bytes": outlet.dropped_bytes})
        if outlet.broken:
            entry["error"] = outlet.broken
        if stuck > 0:
            entry.update(stuck_s=round(stuck, 3), pending_bytes=outlet.pending)
        found[outlet.name] = entry
    return found or None


def leave(code: int) -> None:
    """End the process with ``code``: flush Python's streams, give the outlets
    :data:`LEAVE_BOUND_S` in all to write what they hold (the last line among it), then
    ``os._exit`` (threads a library left behind cannot keep the process alive)."""
    _flush()
    end = time.monotonic() + LEAVE_BOUND_S
    if STDERR is not None:  # the last line first: most of the bound is its
        STDERR.drain(LEAVE_BOUND_S * 0.75)
    if STDOUT is not None:
        STDOUT.drain(end - time.monotonic())
    os._exit(code)

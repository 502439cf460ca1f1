"""Short commands run under a bound: each in a session of its own, read together, and
killed with its process group when the bound passes. nvidia-smi's queries
(``fsm.host.gpus``) and py-spy (``fsm.worker.stacks``) run through :class:`Runs`; the
worker, which runs long and is watched, through ``fsm.worker.supervise``.

Standard library only (and ``fsm.clock``): the GPUs' reader imports it on the runner's
start path.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from fsm.clock import os_timeout

__all__ = ["KILL_GRACE_S", "Ran", "Runs", "run", "spawn"]

#: How often the bound (which can move) is read again while commands run.
POLL_S = 0.25
#: How long a command whose output streams closed is waited for at a time to exit.
EXIT_POLL_S = 0.02
#: After the bound, how long a killed command is waited for before it is left to a reaper
#: thread (a process stuck in a driver may not even die of SIGKILL).
KILL_GRACE_S = 0.2
#: Output beyond this (per stream) is read and dropped.
OUTPUT_CAP = 1 << 20


@dataclass(frozen=True)
class Ran:
    """How one command ended and what it printed. ``status`` is None when it was killed
    at its bound (``hung``) or could not be started (``start_error``, the OS's words)."""

    stdout: bytes = b""
    stderr: bytes = b""
    status: int | None = None
    hung: bool = False
    seconds: float = 0.0
    start_error: str | None = None


def spawn(argv: Sequence[str], env: Mapping[str, str]) -> subprocess.Popen[bytes]:
    """One command, in a session of its own (its group is killed at its bound)."""
    return subprocess.Popen(
        list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, env=dict(env), start_new_session=True,
    )


@dataclass
class _Run:
    proc: subprocess.Popen[bytes]
    started: float
    out: bytearray
    err: bytearray
    open_streams: int = 2


class Runs:
    """Commands read together, each ending on its own: its exit, or ``deadline()``
    (monotonic, read again every :data:`POLL_S`), when it is killed with its group."""

    def __init__(self, deadline: Callable[[], float], *, reaper: str = "bounded-reaper") -> None:
        self._deadline = deadline
        self._reaper = reaper
        self._runs: dict[str, _Run] = {}
        self._ready: list[tuple[str, Ran]] = []
        self._sel = selectors.DefaultSelector()

    def start(self, name: str, argv: Sequence[str], env: Mapping[str, str]) -> None:
        try:
            proc: subprocess.Popen[bytes] | OSError = spawn(argv, env)
        except OSError as exc:
            proc = exc
        self.adopt(name, proc, time.monotonic())

    def adopt(self, name: str, proc: subprocess.Popen[bytes] | OSError, started: float) -> None:
        """Read ``proc`` (started at ``started``, monotonic; one :func:`spawn` made), or
        answer why it could not be started."""
        if isinstance(proc, OSError):
            self._ready.append((name, Ran(start_error=proc.strerror or str(proc))))
            return
        run = _Run(proc, started, bytearray(), bytearray())
        self._runs[name] = run
        assert proc.stdout is not None and proc.stderr is not None
        self._sel.register(proc.stdout, selectors.EVENT_READ, (name, run.out))
        self._sel.register(proc.stderr, selectors.EVENT_READ, (name, run.err))

    def answers(self) -> Iterator[tuple[str, Ran]]:
        """Each command's end as it comes (one started meanwhile is read too)."""
        try:
            while self._ready or self._runs:
                while self._ready:
                    yield self._ready.pop(0)
                if self._runs:
                    self._step()
        finally:
            self._sel.close()

    def _step(self) -> None:
        left = self._deadline() - time.monotonic()
        if left <= 0:
            self._kill([run.proc for run in self._runs.values()])
            for name in list(self._runs):
                self._end(name, None)
            return
        exiting = any(run.open_streams == 0 for run in self._runs.values())
        for key, _ in self._sel.select(os_timeout(min(left, EXIT_POLL_S if exiting else POLL_S))):
            name, buf = key.data
            chunk = os.read(key.fd, 65536)
            if chunk:
                if len(buf) < OUTPUT_CAP:
                    buf += chunk[: OUTPUT_CAP - len(buf)]
                continue
            self._sel.unregister(key.fileobj)
            self._runs[name].open_streams -= 1
        for name, run in list(self._runs.items()):
            if run.open_streams == 0:  # at once when it has exited already
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._end(name, run.proc.wait(EXIT_POLL_S))

    def _end(self, name: str, status: int | None) -> None:
        run = self._runs.pop(name)
        for stream in (run.proc.stdout, run.proc.stderr):
            if stream is not None:
                with contextlib.suppress(KeyError, ValueError):
                    self._sel.unregister(stream)
                stream.close()
        self._ready.append((name, Ran(bytes(run.out), bytes(run.err), status, status is None,
                                      time.monotonic() - run.started)))

    def _kill(self, procs: Sequence[subprocess.Popen[bytes]]) -> None:
        """SIGKILL their process groups (not reaped yet, so no group id was reused); wait
        :data:`KILL_GRACE_S` for them all; leave any still there to a daemon reaper."""
        for proc in procs:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
        grace = time.monotonic() + KILL_GRACE_S
        for proc in procs:
            try:
                proc.wait(max(0.0, grace - time.monotonic()))
            except subprocess.TimeoutExpired:
                threading.Thread(target=proc.wait, name=self._reaper, daemon=True).start()


def run(argv: Sequence[str], env: Mapping[str, str], until: float,
        *, reaper: str = "bounded-reaper") -> Ran:
    """One command, killed with its group at ``until`` (monotonic)."""
    runs = Runs(lambda: until, reaper=reaper)
    runs.start("run", argv, env)
    ended = [ran for _, ran in runs.answers()]  # read to the end: the selector closes
    return ended[0]

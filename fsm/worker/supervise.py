"""The worker's process: start it, pump its console, stop it, and leave nothing behind.

The worker runs in its own session and process group. Its stdout and stderr are one pipe,
pumped in large binary chunks to an output fd (the container's stdout) and to the console
file; bytes are never decoded, so any output is safe. Stopping the worker means SIGTERM to
the group, a grace period that never runs past the attempt deadline, then SIGKILL to the
group. Whatever way the worker ends, the group gets a SIGKILL before :func:`supervise`
returns, so no grandchild survives holding a GPU or the pipe.

Every wait is on a file descriptor: a watcher thread, the pump and the interrupt listener
each write a byte to a self-pipe, and the main thread blocks in ``poll`` with the time left
as its timeout. Writing to a pipe is safe inside a signal handler, where taking a lock is
not. Every timeout handed to the OS goes through :func:`fsm.clock.os_timeout`: ``poll`` and
``threading`` refuse waits of about a month (TRAPS), so a longer wait wakes and waits again.

What left the group (a ``setsid`` helper, an orphan re-parented to the runner, which is a
child subreaper) is found by the process table and the run's token (``fsm.worker.procs``): it
gets the group's SIGTERM, and is SIGKILLed, waited for and reaped before this returns, so
nothing the worker started lands an upload after the marker. While the worker runs, every
wake of the main thread (SIGCHLD wakes it) reaps the group's orphans that died, never the
leader. Every process started here begins with ``oom_score_adj`` 1000.

The leader is watched with ``waitid(WNOWAIT)`` and reaped only after the last signal to
its group: while it is an unreaped zombie its pid, and so the group id, cannot be reused,
so ``killpg`` never reaches a stranger.

The stall watch (``stall_s`` > 0) calls the worker *stalled* once it has shown no sign of
progress for ``stall_s`` seconds. A sign is the worker's start, a chunk the pump read from
the console pipe (the pump stamps each read with the monotonic clock, watch or no watch:
one store, nothing more), or a change of ``progress_file`` (of its inode, modification time
or change time; a missing file is no sign). There is no thread and no loop for it: the main
thread's one wait wakes at the earliest of the deadline and the time the watch falls due
(the last sign known, plus ``stall_s``). Only at that wake does it look at the file, since
a file's times cannot wake a ``poll``. A change is dated by the file's change time
(``st_ctime``: the kernel sets it from its wall clock at every write and touch, whatever
modification time the touch sets), taken onto the monotonic clock with the wall clock's
lead over it at this look or at the previous one, whichever dates it later, so a step of
the wall clock between the change and the look does not date it early. A date outside the
time between the two looks cannot be right (the change was seen at this look and not at the
previous one: the wall clock stepped further, or the file system keeps no such time) and
becomes the time of this look. So a change is never dated before it happened (beyond the
file system's timestamp granularity, a few milliseconds), and the file never brings a stall
early. If the file changed, the watch falls due later and the wait goes on. Otherwise the
worker is stalled, unless the leader exited or a signal arrived first: the main thread
checks both before it calls a stall, and once called the stall stays the reason, whatever
comes next. When the deadline and a stall are both due at one wake, the one that fell due
first wins.

Before the group is stopped for a stall or at the deadline, ``before_stop`` runs on the
main thread (where the caller takes the group's stacks); it is not called on an interrupt,
since the host is going away. Then the stop is the same for both: SIGTERM, the grace,
SIGKILL, and a cap line on the console saying why.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import random
import secrets
import select
import signal
import subprocess
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import structlog

from fsm.clock import DEADLINE_RECHECK_S, Deadline, os_timeout, wait_up_to
from fsm.interrupt import InterruptFlag, wakeup_fd
from fsm.oom import oom_first
from fsm.output.outlet import STDOUT_CAPACITY, Outlet
from fsm.worker import procs

__all__ = ["TAIL_BYTES", "StopReason", "WorkerExit", "read_tail", "supervise"]

TAIL_BYTES = 64_000
"""How much of the console's end is uploaded as the tail."""

_CHUNK = 1 << 20  # the pump moves up to 1 MiB per read
_PIPE_SIZE = 1 << 20  # asked of the kernel for the console pipe (the unprivileged maximum)
_KILL_WAIT_S = 5.0  # after SIGKILL: how long to wait for the group to be gone
_ESCAPEE_ROUNDS = 4  # looks for processes outside the group, each after killing those found
_JOIN_S = 2.0  # how long to wait for the pump thread to finish once told to stop
_OUT_WAIT_S = 1.0  # how long a chunk may wait for room there (a slow reader is followed)
_OUT_DRAIN_S = 2.0  # how long such an outlet gets to write what it holds, at the end

ExitReason = Literal["exited", "deadline", "interrupted", "stalled", "host", "superseded"]
StopReason = Literal["stalled", "deadline", "host", "superseded"]
"""Why the group is about to be stopped (``before_stop`` is told all but ``superseded``)."""


class Watch(Protocol):
    """Something the supervision loop looks at while the worker runs (the GPUs' health,
    the lease): ``due()`` says when it next wants a look (monotonic), ``look()`` takes it
    without blocking (it may start or collect work done elsewhere) and says whether the
    worker must be stopped, for the reason the watch was given with."""

    def due(self) -> float: ...

    def look(self) -> bool: ...


@dataclass(frozen=True)
class WorkerExit:
    """How the worker ended.

    ``reason`` says who ended it: ``"exited"`` when the leader exited before the supervisor
    had to stop it, ``"deadline"``, ``"stalled"`` or ``"interrupted"`` when the supervisor
    stopped the group (after a stall the leader's exit is never its own, even when it came
    while the group was being stopped). ``returncode`` is set when the leader exited
    normally, ``signal`` when a signal killed it; both are ``None`` when the worker was never
    started (the deadline had passed or the runner was interrupted already) or could not be
    reaped. ``silent_s`` is set for a stall: how long the worker had shown no sign of
    progress when the stall was called (at least ``stall_s``).
    """

    reason: ExitReason
    returncode: int | None
    signal: int | None
    duration_s: float
    console_path: Path
    console_bytes: int  # the console file's size when supervise returned, cap line included
    silent_s: float | None = None
    #: The console file as this process holds it open (``/proc/self/fd/N``), for as long as
    #: this object lives: what the worker deletes or replaces at ``console_path`` changes
    #: nothing read through it. None where it could not be held.
    console_held: Path | None = None


def read_tail(path: Path, limit: int = TAIL_BYTES) -> bytes:
    """The last ``limit`` bytes of the file at ``path``; seeks, so the cost does not grow
    with the console. Raises ``OSError`` when the file cannot be opened."""
    if limit <= 0:
        return b""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(0, size - limit))
        return f.read(limit)


def supervise(
    argv: Sequence[str],
    *,
    cwd: Path,
    env: Mapping[str, str],
    console_path: Path,
    deadline: Deadline,
    stop_by: Deadline,
    interrupt: InterruptFlag,
    grace_s: float = 10.0,
    signal_stop_s: float | None = None,
    out_fd: int | Outlet | None = 1,
    on_output: Callable[[bytes], None] | None = None,
    tail_sink: Callable[[bytes], None] | None = None,
    tail_interval_s: float = 30.0,
    drain_timeout_s: float = 2.0,
    on_group: Callable[[int | None], None] | None = None,
    stall_s: float = 0.0,
    progress_file: Path | None = None,
    before_stop: Callable[[StopReason], None] | None = None,
    watches: Sequence[tuple[StopReason, Watch]] = (),
    name: str = "worker",
) -> WorkerExit:
    """Run ``argv`` as the worker until it exits, ``deadline`` passes or ``interrupt`` fires.

    The console (stdout and stderr, one stream) goes to ``out_fd`` (None: nowhere) and to
    ``console_path`` (truncated first), and each chunk of it to ``on_output`` (called on
    the pump's thread: keep it quick; what it raises is logged and it is called no more).
    On the deadline, a stall or an interrupt the group gets SIGTERM, then up to ``grace_s``
    (never past ``stop_by``, and once a signal came, before the stop or during it, never
    past ``signal_stop_s`` seconds after it: the host is going away) to end, then SIGKILL;
    a cap line saying why is appended to the console. After the leader exits, descendants
    get ``drain_timeout_s`` to release the pipe; then the whole group is killed.

    ``on_group`` (keep it trivial) gets the worker's process-group id once it is started,
    and ``None`` before the leader is reaped (when the id could stop naming the group): what
    a watchdog may ``killpg`` meanwhile.

    ``stall_s`` (0: off; the caller validates the setting) turns the stall watch on (see the
    module's docstring): after ``stall_s`` seconds without a sign of progress, neither a
    byte on the console nor a change of ``progress_file`` (None: no file), the group is
    stopped as at the deadline, the cap line says for how long the worker made no progress,
    and ``reason`` is ``"stalled"``. ``before_stop(why)`` is called on this thread before
    the first signal to the group, when it is stopped for a stall (``"stalled"``) or at the
    deadline (``"deadline"``), never on an interrupt. It bounds its own time: the grace is
    reckoned after it returns, still never past ``stop_by``. What it raises (an
    ``Exception``) is logged and the stop goes on; the leader is not reaped before it
    returns, so the group id it may use (``on_group``) still names the worker's group.

    Each of ``watches`` (``(reason, watch)``) is one more deadline of the same wait: when
    it is due the loop calls its ``look()``, and when that says so the group is stopped
    with that ``reason``: as for a stall (``before_stop(reason)`` first) for ``"host"``;
    for ``"superseded"`` (a later attempt of the run took over, CONTRACT section 10) at
    once, SIGKILL without a grace or a ``before_stop``: nothing of the worker's may land
    after that.

    With ``tail_sink``, a daemon thread calls ``tail_sink(read_tail(console_path))`` every
    ``tail_interval_s`` seconds (give or take a fifth, at random); ticks are skipped while
    a call is in flight and exceptions are logged and swallowed. A call may still be in
    flight when this returns: a caller whose final upload must land last should serialise
    it with the sink (a shared lock).

    ``name`` (``"pip"`` for the installer) names the log events and the process in the cap
    line. Raises ``OSError`` when the worker cannot be started or the console file created.

    ``out_fd`` is passed on through an :class:`~fsm.output.outlet.Outlet` (a descriptor number gets
    one for the call, drained before this returns, within a bound): a reader of it that is
    gone or stuck never blocks the pump, so never the worker; what it cannot take is
    dropped there and counted (the console file keeps everything).
    """
    if not stall_s >= 0:  # NaN too
        raise ValueError(f"stall_s must be 0 (off) or positive, got {stall_s!r}")
    log = structlog.get_logger()
    started = time.monotonic()
    console_fd = os.open(
        console_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC, 0o644
    )
    # Read back through this descriptor, never by the path: the worker may empty its
    # scratch dir, and the console is the runner's evidence (issue 26).
    fd_path = Path(f"/proc/self/fd/{console_fd}")
    held = fd_path if fd_path.exists() else None  # no /proc: the path is all there is
    keep_open = False
    out = Outlet(out_fd, "out", capacity=STDOUT_CAPACITY, wait_s=_OUT_WAIT_S) if isinstance(
        out_fd, int) else out_fd
    waker = _Waker()
    unsubscribe = interrupt.subscribe(lambda _signum: waker.wake())
    try:
        # A trigger that came before subscribe() was not delivered: look at the flag too.
        if interrupt.is_set() or deadline.expired():
            reason: ExitReason = "interrupted" if interrupt.is_set() else "deadline"
            log.warning(f"{name}.not_started", reason=reason)
            _append_console(console_fd, _cap_line(reason, interrupt, name, after=b""), name)
            keep_open = True
            return _result(reason, None, started, console_path, console_fd, held)
        run = _Run(
            argv,
            cwd=cwd,
            env=env,
            console_fd=console_fd,
            out=out,
            on_output=on_output,
            waker=waker,
            on_group=on_group,
            name=name,
        )
        log.info(f"{name}.started", pid=run.pid, executable=argv[0], cwd=str(cwd))
        stop_ticks = _start_ticks(tail_sink, held or console_path, tail_interval_s, name)
        try:
            stall = _StallWatch(stall_s, progress_file, run, deadline) if stall_s > 0 else None
            reason = _wait_and_stop(
                run,
                deadline=deadline,
                stop_by=stop_by,
                interrupt=interrupt,
                grace_s=grace_s,
                signal_stop_s=signal_stop_s,
                drain_timeout_s=drain_timeout_s,
                watches=[("stalled", stall), *watches] if stall else watches,
                before_stop=before_stop,
            )
            silent_s = stall.silent_s if stall and reason == "stalled" else None
            if reason != "exited":
                line = _cap_line(reason, interrupt, name, after=run.last_byte,
                                 silent_s=silent_s)
                _append_console(console_fd, line, name)
                if run.pump_joined and out is not None:  # after the pump's last chunk
                    out.offer(line)
        finally:
            stop_ticks.set()
            run.close()
        result = _result(reason, run.proc.returncode, started, console_path, console_fd, held,
                         silent_s)
        keep_open = True
        log.info(
            f"{name}.exited",
            reason=result.reason,
            returncode=result.returncode,
            signal=result.signal,
            duration_s=round(result.duration_s, 3),
            console_bytes=result.console_bytes,
        )
        return result
    finally:
        unsubscribe()
        if not keep_open:  # else closed with the result that holds it
            os.close(console_fd)
        if out is not None and out is not out_fd:  # this call's own: what it holds goes now
            out.close(drain_s=_OUT_DRAIN_S)
        if out is not None and out.broken:
            log.error(f"{name}.console_write_failed", target="out", error=out.broken,
                      dropped_bytes=out.dropped_bytes)


def _wait_and_stop(
    run: _Run,
    *,
    deadline: Deadline,
    stop_by: Deadline,
    interrupt: InterruptFlag,
    grace_s: float,
    signal_stop_s: float | None,
    drain_timeout_s: float,
    watches: Sequence[tuple[StopReason, Watch]],
    before_stop: Callable[[StopReason], None] | None,
) -> ExitReason:
    """Wait for the worker's end, stop it if it does not come, kill what is left of the group.

    Returns why it ended."""
    log = structlog.get_logger()
    waker, exited, eof = run.waker, run.exited.is_set, run.eof.is_set
    reason = _wait(run, deadline, interrupt, watches)
    if reason == "superseded":
        log.warning(f"{run.name}.stopping", reason=reason, pgid=run.pid, grace_s=0)
    elif reason != "exited":
        if reason != "interrupted" and before_stop is not None:
            try:
                before_stop(reason)
            except Exception as exc:  # the evidence is optional; the stop is not
                log.error(f"{run.name}.before_stop_failed", why=reason,
                          error=f"{type(exc).__name__}: {exc}")
        # Reckoned after before_stop: it may have taken its time, and a signal may have come.
        grace_end = min(time.monotonic() + stop_by.bound(grace_s),
                        _signal_cut(interrupt, signal_stop_s))
        log.warning(f"{run.name}.stopping", reason=reason, pgid=run.pid,
                    grace_s=round(max(0.0, grace_end - time.monotonic()), 3))
        _killpg(run.pid, signal.SIGTERM)
        # Those that left the group (setsid) get the same SIGTERM, found by the process table.
        procs.stop_all(run.escapees(), signal.SIGTERM)

        # The grace ends early when the leader exits, and is cut when a signal comes now.
        def over() -> bool:
            return exited() or _signal_cut(interrupt, signal_stop_s) < grace_end

        while waker.wait_until(over, grace_end) and not exited():
            grace_end = min(grace_end, _signal_cut(interrupt, signal_stop_s))
        # The rest of the group got the same SIGTERM: it may close the pipe within the grace.
        if exited():
            waker.wait_until(eof, min(grace_end, time.monotonic() + drain_timeout_s))
    elif not waker.wait_until(eof, time.monotonic() + stop_by.bound(drain_timeout_s)):
        log.warning(f"{run.name}.pipe_held", pgid=run.pid, drain_timeout_s=drain_timeout_s)

    # Whatever is left of the group goes now. The leader is not reaped yet (at worst a
    # zombie), so the group id still names this worker's group.
    survivors = procs.group_members(run.pid)
    if survivors:
        log.warning(f"{run.name}.killing", pgid=run.pid, pids=survivors)
    _killpg(run.pid, signal.SIGKILL)
    kill_end = time.monotonic() + _KILL_WAIT_S
    run.kill_escapees(kill_end)  # before the reap: the leader's pid still names the run
    if not waker.wait_until(lambda: exited() and eof(), kill_end):
        log.error(f"{run.name}.kill_unconfirmed", pgid=run.pid, leader_exited=exited(), eof=eof())
    run.stop_pump()
    if exited():
        run.reap()
    left = _await_group_gone(run.pid, kill_end)
    if left:
        log.error(f"{run.name}.survivors", pgid=run.pid, pids=left)
    return reason


def _wait(
    run: _Run,
    deadline: Deadline,
    interrupt: InterruptFlag,
    watches: Sequence[tuple[StopReason, Watch]],
) -> ExitReason:
    """Wait until the leader exits, a signal comes, the deadline passes, or a watch (the
    stall watch first) says the worker must be stopped.

    The leader's exit and a signal are looked at before a watch's look, and again before
    another watch than the stall watch is obeyed: whichever the main thread sees first
    decides, and the exit before the signal, as always."""
    exited = run.exited.is_set

    def ended() -> bool:
        # Every wake (a SIGCHLD wakes the signal descriptor too) reaps the group's orphans
        # that died meanwhile: as PID 1 or subreaper nobody else would (fsm.worker.procs).
        procs.reap_orphans(run.pid)
        return exited() or interrupt.is_set()

    while True:
        # The deadline is looked at again after every wake: it can move while it is waited
        # for (the attempt's deadline follows a backward wall-clock step, fsm.clock).
        until = min([deadline.mono_at, time.monotonic() + DEADLINE_RECHECK_S,
                     *(other.due() for _, other in watches)])
        if not run.waker.wait_until(ended, until) and not ended():
            # The reason of the first due watch whose look says stop (the rest wait).
            stop = next((why for why, watch in watches
                         if time.monotonic() >= watch.due() and watch.look()), None)
            if stop == "stalled":  # called, and logged, by the stall watch: it stands
                return stop
            if stop is not None and not ended():
                structlog.get_logger().warning(f"{run.name}.watch_stops", reason=stop,
                                               pgid=run.pid)
                return stop
            if time.monotonic() < deadline.mono_at:
                continue
        if exited():
            return "exited"
        return "interrupted" if interrupt.is_set() else "deadline"


def _signal_cut(interrupt: InterruptFlag, signal_stop_s: float | None) -> float:
    """When the stop must be over after a signal (monotonic); infinity: no signal, no bound."""
    if signal_stop_s is None or interrupt.at_mono is None:
        return math.inf
    return interrupt.at_mono + signal_stop_s


#: What the cap line says for each reason the supervisor ended the worker.
_CAPS = {
    "deadline": "{name} hit the run wall deadline; stopped",
    "stalled": "{name} made no progress for {silent}; stopped",
    "host": "the host's GPUs failed under the {name}; stopped",
    "superseded": "a later attempt of the run took over; {name} killed",
    "interrupted": "runner got {sig}; {name} stopped",
}


def _cap_line(
    reason: ExitReason, interrupt: InterruptFlag, name: str, *, after: bytes,
    silent_s: float | None = None,
) -> bytes:
    """The line that says why the console ends here, on a line of its own after ``after``."""
    sig = signal.Signals(interrupt.signum).name if interrupt.signum else "a signal"
    why = _CAPS[reason].format(name=name, silent=f"{silent_s or 0:.0f} s", sig=sig)
    text = f"--- flash-bootstrap: {why} ---\n"
    return (b"\n" if after not in (b"", b"\n") else b"") + text.encode()


def _append_console(console_fd: int, data: bytes | memoryview, name: str) -> bool:
    """Write ``data`` to the console file; False (and logged) when that failed."""
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(console_fd, view) :]
    except OSError as exc:
        structlog.get_logger().error(
            f"{name}.console_write_failed", target="console", error=str(exc)
        )
        return False
    return True


def _result(reason: ExitReason, returncode: int | None, started: float, console_path: Path,
            console_fd: int, held: Path | None, silent_s: float | None = None) -> WorkerExit:
    """The result; it owns ``console_fd`` from here on (closed when it is collected)."""
    sig = -returncode if returncode is not None and returncode < 0 else None
    result = WorkerExit(
        reason=reason,
        returncode=None if sig is not None else returncode,
        signal=sig,
        duration_s=time.monotonic() - started,
        console_path=console_path,
        console_bytes=os.fstat(console_fd).st_size,
        silent_s=silent_s,
        console_held=held,
    )
    weakref.finalize(result, procs.close_fds, console_fd)
    return result


class _Waker:
    """A self-pipe: ``wake()`` from any thread or a signal handler, ``wait_until`` in one.

    The fds close when the last reference goes, never earlier: a thread or a listener that
    still holds the waker can never write into an fd number that was closed and reused.
    ``wait_until`` also wakes when any thread caught a signal (the process's wakeup
    descriptor, ``fsm.interrupt``): Python then runs the handler on this thread at once.
    """

    def __init__(self) -> None:
        self.fd, self._w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        weakref.finalize(self, procs.close_fds, self.fd, self._w)
        self._poll = select.poll()
        self._poll.register(self.fd, select.POLLIN)
        self._signals: int | None = None  # the wakeup descriptor registered, if any

    def wake(self) -> None:
        # One write(2), no lock: safe inside a signal handler. A full pipe is awake already.
        with contextlib.suppress(BlockingIOError):
            os.write(self._w, b"\0")

    def wait_until(self, done: Callable[[], bool], until_mono: float) -> bool:
        """Block until ``done()`` or the monotonic time ``until_mono``; returns ``done()``."""
        signals = self._watch_signals()
        while True:
            for fd in (self.fd,) if signals is None else (self.fd, signals):
                with contextlib.suppress(OSError):  # drain before looking: no lost wake-up
                    while os.read(fd, 4096):
                        pass
            if done():
                return True
            left = until_mono - time.monotonic()
            if left <= 0:
                return False
            self._poll.poll(procs.poll_ms(left))  # at most MAX_OS_WAIT_S: a longer wait loops

    def _watch_signals(self) -> int | None:
        """Poll the process's signal wakeup descriptor too (it may change between waits)."""
        current = wakeup_fd()
        if current != self._signals:
            if self._signals is not None:
                with contextlib.suppress(KeyError, ValueError):
                    self._poll.unregister(self._signals)
            if current is not None:
                self._poll.register(current, select.POLLIN)
            self._signals = current
        return current


class _StallWatch:
    """The last sign of progress, and whether the worker is stalled (the module's docstring):
    the loop's first :class:`Watch`, for ``"stalled"``.

    Used by the main thread only; the pump's share is its ``last_read`` stamp."""

    def __init__(self, stall_s: float, progress_file: Path | None, run: _Run,
                 deadline: Deadline) -> None:
        self.stall_s = stall_s
        self._file = progress_file
        self._run = run
        self._deadline = deadline
        self._start = run.last_read  # the worker's start is the first sign
        self._file_at = self._start  # the last change of the file seen, dated (monotonic)
        self._complained = False
        self._looked, self._lead = self._clocks()  # the last look at the file
        self._key = self._stat()
        #: How long the worker had shown no sign of progress when :meth:`look` called a stall.
        self.silent_s: float | None = None

    def due(self) -> float:
        """When the worker is stalled unless a sign comes first (monotonic); the file is
        not looked at for this."""
        return max(self._run.last_read, self._file_at) + self.stall_s

    def look(self) -> bool:
        """Called once due: whether the worker is stalled, the file looked at first. A stall
        that fell due at or after the deadline is not called (the deadline was first)."""
        key = self._stat()
        now, lead = self._clocks()
        if key is not None and key != self._key:
            # The change time, on the monotonic clock by the wall clock's lead at the last
            # look or now, whichever is later; outside the time between the two looks, now.
            at = key[3] / 1e9 - min(self._lead, lead)
            self._file_at = max(self._file_at, at if self._looked < at <= now else now)
        self._key, self._looked, self._lead = key, now, lead
        console = self._run.last_read
        last = max(console, self._file_at)
        silent_s = time.monotonic() - last
        if silent_s < self.stall_s or last + self.stall_s >= self._deadline.mono_at:
            return False
        self.silent_s = silent_s
        kind = ("start" if last == self._start
                else "console" if console >= self._file_at else "progress_file")
        structlog.get_logger().warning(
            f"{self._run.name}.stalled", pgid=self._run.pid, silent_s=round(silent_s, 3),
            stall_s=self.stall_s, last_sign=kind,
        )
        return True

    def _stat(self) -> tuple[int, int, int, int] | None:
        """What tells a change of the file (its inode and times), None when it is missing."""
        if self._file is None:
            return None
        try:
            st = os.stat(self._file)
        except FileNotFoundError:
            return None
        except OSError as exc:  # unreadable: no sign either, and said once
            if not self._complained:
                self._complained = True
                structlog.get_logger().warning(f"{self._run.name}.progress_file_unreadable",
                                               path=str(self._file), error=str(exc))
            return None
        return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns

    @staticmethod
    def _clocks() -> tuple[float, float]:
        """The monotonic time now, and the wall clock's lead over it."""
        mono = time.monotonic()
        return mono, time.time() - mono


class _Run:
    """A started worker: its process, the pump that copies its console, and the clean-up
    that kills its group.

    The pump (a thread) copies the console pipe to the console file and ``out`` in 1 MiB
    chunks, and owns the pipe's read end. A write error drops the console file and the pump
    keeps draining; ``out`` is an outlet, which never blocks it and never raises. So the
    worker never blocks on a full pipe because a destination failed.
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        cwd: Path,
        env: Mapping[str, str],
        console_fd: int,
        out: Outlet | None,
        on_output: Callable[[bytes], None] | None,
        waker: _Waker,
        on_group: Callable[[int | None], None] | None,
        name: str,
    ) -> None:
        self.name = name
        self.waker = waker
        self._on_group: Callable[[int | None], None] | None = None
        #: Marks every process of this run, so an orphan that left the group is found.
        self.token = secrets.token_hex(8)
        self.eof = threading.Event()  # the pump ended
        self.exited = threading.Event()  # the leader exited (not reaped: a zombie at worst)
        self.pump_joined = False  # the pump ended and was joined: its last chunk is written
        self.last_byte = b""  # the console's last byte so far
        self._console_fd: int | None = console_fd  # None once a write to it failed
        self._out = out
        self._on_output = on_output
        self._stop = _Waker()
        self._pump = threading.Thread(target=self._pump_all, name=f"{name}-pump", daemon=True)
        r, w = os.pipe()  # both ends close-on-exec; Popen dup2()s w onto the worker's 1 and 2
        try:
            with contextlib.suppress(OSError):  # a bigger pipe means fewer wake-ups; optional
                fcntl.fcntl(r, fcntl.F_SETPIPE_SZ, _PIPE_SIZE)
            with oom_first():  # the OOM killer's first choice, and its children's
                self.proc = subprocess.Popen(
                    list(argv),
                    cwd=cwd,
                    env={**env, procs.TOKEN_VAR: self.token},
                    stdin=subprocess.DEVNULL,
                    stdout=w,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # (and close_fds, Popen's default)
                )
        except BaseException:
            os.close(r)
            raise
        finally:
            os.close(w)  # only the worker's group holds the write end: its exit means EOF
        self.pid = self.proc.pid
        self._pipe_fd = r
        #: When the pump last read a chunk from the pipe (monotonic); the start before any.
        self.last_read = time.monotonic()
        try:
            self._pump.start()
            threading.Thread(target=self._watch_leader, name=f"worker-watch-{self.pid}",
                             daemon=True).start()
            self._on_group = on_group
            if on_group is not None:
                on_group(self.pid)
        except BaseException:
            self.close()
            raise

    def _watch_leader(self) -> None:
        """Set ``exited`` when the leader exits, without reaping it (a daemon thread)."""
        with contextlib.suppress(ChildProcessError):  # reaped by someone else: gone anyway
            os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT)
        self.exited.set()
        self.waker.wake()

    def stop_pump(self) -> None:
        """Stop pumping (what the pipe holds is copied first); sets ``pump_joined`` once ended."""
        if self.pump_joined:
            return
        self._stop.wake()
        self._pump.join(os_timeout(_JOIN_S))
        if self._pump.is_alive():  # blocked writing the console file: leave it its fds
            structlog.get_logger().error(f"{self.name}.pump_stuck")
            return
        self.pump_joined = True
        os.close(self._pipe_fd)

    def _pump_all(self) -> None:
        view = memoryview(bytearray(_CHUNK))
        monotonic = time.monotonic
        poll = select.poll()
        poll.register(self._pipe_fd, select.POLLIN)
        poll.register(self._stop.fd, select.POLLIN)
        stopping = False
        try:
            while True:
                # Without a stop request, wait as long as the OS allows; waking early is a no-op.
                ready = {fd for fd, _ in poll.poll(0 if stopping else procs.poll_ms(None))}
                if self._stop.fd in ready:
                    poll.unregister(self._stop.fd)
                    stopping = True
                if self._pipe_fd not in ready:
                    if stopping:
                        return  # told to stop and nothing is left to copy
                    continue
                n = os.readv(self._pipe_fd, [view])
                if n == 0:
                    return
                self.last_read = monotonic()  # the stall watch's sign: nothing else to do here
                self._copy(view[:n])
        except OSError as exc:
            structlog.get_logger().error(f"{self.name}.pump_failed", error=str(exc))
        finally:
            self.eof.set()
            self.waker.wake()

    def _copy(self, chunk: memoryview) -> None:
        if self._console_fd is not None and not _append_console(self._console_fd, chunk, self.name):
            self._console_fd = None
        self.last_byte = bytes(chunk[-1:])
        data = bytes(chunk) if self._out is not None or self._on_output is not None else b""
        if self._out is not None:
            self._out.offer(data)
        if self._on_output is not None:
            try:
                self._on_output(data)
            except Exception as exc:
                structlog.get_logger().error(f"{self.name}.output_reader_failed",
                                             error=f"{type(exc).__name__}: {exc}")
                self._on_output = None

    def escapees(self) -> list[procs.Proc]:
        """The run's live processes outside its group (``setsid``, or orphaned and
        re-parented to the runner): ``killpg`` does not reach them."""
        return [p for p in procs.descendants(self.pid, self.token) if p.pgrp != self.pid]

    def kill_escapees(self, until_mono: float) -> None:
        """SIGKILL every process of the run outside its group, until none is found (an
        escapee's children are orphaned by its death and found at the next look)."""
        for _ in range(_ESCAPEE_ROUNDS):
            found = self.escapees()
            if not found:
                return
            structlog.get_logger().warning(f"{self.name}.escapees_killed", pgid=self.pid,
                                           pids=[p.pid for p in found])
            left = procs.stop_all(found, signal.SIGKILL, wait_until=until_mono)
            if left:
                structlog.get_logger().error(f"{self.name}.escapees_survive", pids=left)
                return

    def reap(self, timeout: float | None = None) -> None:
        """Wait for the leader and collect its status (the caller forgets the group first)."""
        on_group, self._on_group = self._on_group, None
        if on_group is not None:
            on_group(None)
        self.proc.wait(None if timeout is None else os_timeout(timeout))

    def close(self) -> None:
        """Make sure the group is dead and the leader reaped (also when unwinding)."""
        if self.proc.returncode is None:
            _killpg(self.pid, signal.SIGKILL)  # unreaped leader: the group id is still ours
            self.kill_escapees(time.monotonic() + _KILL_WAIT_S)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.reap(_KILL_WAIT_S)
        if self._pump.ident is not None:  # else the pump thread could not be started
            self.stop_pump()
        procs.reap_orphans(self.pid, leader_too=True)


def _start_ticks(
    sink: Callable[[bytes], None] | None, console_path: Path, interval_s: float, name: str
) -> threading.Event:
    """Start the periodic tail uploads (when there is a sink); returns what stops them."""
    stop = threading.Event()
    if sink is None:
        return stop

    def tick() -> None:
        log = structlog.get_logger()
        # Each wait is jittered by up to a fifth either way: runners started together (a
        # fleet sharing one repo) drift apart instead of committing in step, where their
        # fenced tails would refuse each other (412).
        while not wait_up_to(stop.wait, interval_s * random.uniform(0.8, 1.2)):
            try:
                sink(read_tail(console_path))
            except Exception as exc:
                log.warning(f"{name}.tail_upload_failed", error=f"{type(exc).__name__}: {exc}")

    threading.Thread(target=tick, name=f"{name}-tail", daemon=True).start()
    return stop


def _killpg(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _await_group_gone(pgid: int, until_mono: float) -> list[int]:
    """Wait (bounded) until no live process is left in group ``pgid``; returns the rest.

    Waits on pidfds, which turn readable when their process exits. Without pidfds (an old
    kernel, a seccomp profile that denies them) it takes one look instead.
    """
    fds: list[int] = []
    try:
        for pid in procs.group_members(pgid):
            try:
                fds.append(os.pidfd_open(pid))
            except ProcessLookupError:
                continue
            except OSError:
                return procs.group_members(pgid)
        procs.await_exit(fds, until_mono)
        return procs.group_members(pgid) if fds else []
    finally:
        procs.close_fds(*fds)

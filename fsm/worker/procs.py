"""The runner's hold on what it starts: every descendant found, orphans reaped, and the
OOM killer pointed at the worker, never at the runner.

**Subreaper.** The runner makes itself a child subreaper (``PR_SET_CHILD_SUBREAPER``): a
descendant whose parent dies is re-parented to the runner, not to the host's init, so it
stays in reach. A child that calls ``setsid`` leaves the worker's process group, and
``killpg`` no longer reaches it (TRAPS); it is found instead by walking the process table:
every process whose parent chain leads to the worker's leader, and every child of the
runner (an orphan re-parented to it) whose environment carries the run's token
(:data:`TOKEN_VAR`, set in the environment of every supervised process), with everything
under them. What cannot be found that way is a process that cleared its environment *and*
was orphaned: documented (docs/workers.md).

**Orphans.** Re-parented descendants are the runner's children: when they die they stay
zombies until the runner reaps them (as PID 1 nobody else does, and under a pids limit the
zombies count against the worker's own forks). :func:`reap_orphans` reaps the zombies of a
worker's process group, never its leader (whose status the supervisor reads), and never a
child the runner started itself (those are leaders of their own groups).

**OOM.** A supervised process is started with ``oom_score_adj``
:data:`fsm.oom.CHILD_OOM_SCORE_ADJ` (``fsm.oom.oom_first``) and the runner lowers its own
(``fsm.oom``, its :func:`lower_own_oom_score` re-exported here).

Standard library only: the supervisor imports it while a worker starts.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import select
import signal
import time
from collections.abc import Iterable
from typing import NamedTuple

from fsm.clock import os_timeout
from fsm.oom import lower_own_oom_score

__all__ = [
    "TOKEN_VAR",
    "Proc",
    "await_exit",
    "become_subreaper",
    "close_fds",
    "descendants",
    "group_members",
    "lower_own_oom_score",
    "poll_ms",
    "reap_orphans",
    "stop_all",
]

PR_SET_CHILD_SUBREAPER = 36
#: The environment variable whose value marks a supervised run's processes.
TOKEN_VAR = "FLASH_PROCESS_TOKEN"


class Proc(NamedTuple):
    """A process as ``/proc/<pid>/stat`` shows it."""

    pid: int
    state: bytes
    ppid: int
    pgrp: int
    start: int  # start time in clock ticks after boot: tells a reused pid from the process

    @property
    def alive(self) -> bool:
        return self.state not in (b"Z", b"X")


def become_subreaper() -> bool:
    """Make this process a child subreaper (orphaned descendants become its children)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):  # not Linux, or no prctl: nothing to be had
        return False


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def _stat(pid: int) -> Proc | None:
    data = _read(f"/proc/{pid}/stat") or b""  # unreadable: no fields, no Proc
    # pid (comm) state ppid pgrp session tty tpgid flags 11 counters priority nice threads
    # itreal starttime: comm may hold anything, so split after its last ')'.
    fields = data[data.rfind(b")") + 2 :].split()
    try:
        return Proc(pid, fields[0], int(fields[1]), int(fields[2]), int(fields[19]))
    except (IndexError, ValueError):
        return None


def _table() -> dict[int, Proc]:
    try:
        names = os.listdir("/proc")
    except OSError:
        return {}
    stats = (_stat(int(name)) for name in names if name.isdigit())
    return {proc.pid: proc for proc in stats if proc is not None}


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``, from /proc: the leader
    first (when it is alive), then the others by pid. Empty when /proc cannot be read."""
    members = (p.pid for p in _table().values() if p.pgrp == pgid and p.alive)
    return sorted(members, key=lambda pid: (pid != pgid, pid))


def _has_token(pid: int, needle: bytes) -> bool:
    return needle in b"\0" + (_read(f"/proc/{pid}/environ") or b"")


def descendants(leader: int, token: str) -> list[Proc]:
    """Every live process of a run but its leader: the leader's descendants by parent
    chain (whatever their group or session), and the runner's children that carry the
    run's ``token`` (orphans re-parented to it), with their descendants."""
    procs = _table()
    children: dict[int, list[int]] = {}
    for proc in procs.values():
        children.setdefault(proc.ppid, []).append(proc.pid)
    needle = f"\0{TOKEN_VAR}={token}\0".encode()
    found: dict[int, Proc] = {}
    todo = [leader, *(pid for pid in children.get(os.getpid(), ())
                      if pid != leader and _has_token(pid, needle))]
    while todo:
        pid = todo.pop()
        for child in children.get(pid, ()):
            if child not in found and child != leader:
                found[child] = procs[child]
                todo.append(child)
        if pid != leader and pid in procs:
            found.setdefault(pid, procs[pid])
    return [proc for proc in found.values() if proc.alive]


def _pidfd(proc: Proc) -> int | None:
    """A pidfd on exactly ``proc`` (None when it is gone, or its pid now names another)."""
    try:
        fd = os.pidfd_open(proc.pid)
    except OSError:
        return None
    now = _stat(proc.pid)
    if now is None or now.start != proc.start:
        os.close(fd)
        return None
    return fd


def stop_all(procs: Iterable[Proc], sig: int, *, wait_until: float | None = None) -> list[int]:
    """Send ``sig`` to each of ``procs`` (by pidfd: never a stranger that took a pid over);
    with ``wait_until`` (monotonic) wait for them to be gone and reap those that are this
    process's children. Returns the pids still alive."""
    fds: dict[int, int] = {}
    try:
        for proc in procs:
            fd = _pidfd(proc)
            if fd is None:
                continue
            fds[fd] = proc.pid
            try:
                signal.pidfd_send_signal(fd, sig)
            except OSError:
                os.close(fds.pop(fd))
        if wait_until is None:
            return list(fds.values())
        pending = await_exit(fds, wait_until)
        for pid in fds.values():
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, os.WNOHANG)  # an orphan re-parented to us: no zombie left
        return [fds[fd] for fd in pending]
    finally:
        close_fds(*fds)


def await_exit(pidfds: Iterable[int], until_mono: float) -> set[int]:
    """Wait (bounded, monotonic) until each pidfd turns readable, that is its process
    exited; returns the pidfds still pending."""
    poll = select.poll()
    pending = set(pidfds)
    for fd in pending:
        poll.register(fd, select.POLLIN)
    while pending:
        left = until_mono - time.monotonic()
        if left <= 0:
            break
        for fd, _ in poll.poll(poll_ms(left)):  # at most MAX_OS_WAIT_S: a longer wait loops
            poll.unregister(fd)
            pending.discard(fd)
    return pending


def poll_ms(seconds: float | None) -> int:
    """A ``poll(2)`` timeout in milliseconds for ``seconds`` (None: as long as allowed):
    within what ``poll`` accepts (TRAPS)."""
    return math.ceil(os_timeout(seconds) * 1000)


def close_fds(*fds: int) -> None:
    """Close each of ``fds``, whatever closing one of them raises."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def reap_orphans(pgid: int, *, leader_too: bool = False) -> None:
    """Reap the zombies of group ``pgid`` that are this process's children (orphans
    re-parented to a PID 1 or subreaper runner), never its leader (pid ``pgid``) unless
    ``leader_too``: its status is the supervisor's to read. Looked at without reaping
    first, so the leader's exit is never taken."""
    while True:
        try:
            info = os.waitid(os.P_PGID, pgid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except (ChildProcessError, OSError):
            return
        if info is None or (info.si_pid == pgid and not leader_too):
            return  # nothing to reap, or the leader first: the supervisor's turn
        with contextlib.suppress(ChildProcessError):
            os.waitpid(info.si_pid, 0)



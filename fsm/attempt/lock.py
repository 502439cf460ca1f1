"""The attempt's lock: only the owner writes.

A runner holds the attempt's ``flock`` (:class:`AttemptLock`) before anything is written
for the attempt: no marker, no persisted result, no upload (DESIGN, "An attempt's writes
belong to its owner").
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Literal

import structlog

from fsm.budget import Budget

__all__ = ["LOCK_POLL_S", "AttemptLock", "LockWait"]

#: How often a runner waiting for the attempt's lock looks again.
LOCK_POLL_S = 0.1
log = structlog.get_logger("fsm.marker")


LockWait = Literal["held", "busy", "interrupted", "deadline"]


class AttemptLock:
    """An exclusive ``flock`` on the attempt, held for the life of the process.

    Until a runner holds it, it writes nothing for the attempt: no marker, no persisted
    result, no upload (DESIGN, "An attempt's writes belong to its owner").
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, timeout_s: float, budget: Budget) -> LockWait:
        """Take the lock, waiting up to ``timeout_s`` for a previous runner to let go; a
        signal or the deadline ends the wait at once.

        A lock file that exists but cannot be opened for writing (a payload directory
        mounted read-only since) is locked read-only: ``flock`` needs no write access. One
        that cannot be made at all raises the ``OSError`` (a storage errno is the host's
        storage, ``fsm.host.storage``): a lock that does not exist is never "held"."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            try:
                fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                raise OSError(exc.errno, f"the attempt's lock cannot be written: {exc.strerror}",
                              str(self.path)) from None
        give_up = budget.clock() + timeout_s
        said = False
        while True:
            with contextlib.suppress(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._fd = fd
                return "held"
            ended: LockWait | None = ("interrupted" if budget.interrupt.is_set()
                                      else "deadline" if budget.expired()
                                      else "busy" if budget.clock() >= give_up else None)
            if ended is not None:
                os.close(fd)
                return ended
            if not said:
                said = True
                log.info("attempt.lock_wait", lock=str(self.path), timeout_s=timeout_s)
            # flock has no timeout: poll it, in the budget's short, signal-watching naps
            budget.wait(min(LOCK_POLL_S, max(0.0, give_up - budget.clock())))

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
        self._fd = None

"""The worker's console tail in the store while the worker runs: redacted, fenced (it
never lands after the marker), and never allowed to block the run. The final tail goes
up with the marker (``fsm.outcome.attach_tail``)."""

from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path

import structlog

from fsm.clock import os_timeout
from fsm.context import Context
from fsm.supervise import TAIL_BYTES

log = structlog.get_logger("fsm.console")


def console_name(ctx: Context) -> str:
    return f"console_{ctx.require_payload().phase}.txt"


def console_path(ctx: Context) -> Path:
    return ctx.scratch / console_name(ctx)


def upload_tail(ctx: Context) -> bool:
    """Upload the redacted last 64,000 bytes of the console; False (logged) on failure.

    The tail is read from the console file here, never taken already cut: the redactor
    reads a wider window and masks before it cuts, so no secret straddling the tail's
    start leaves as a fragment."""
    try:
        path = console_path(ctx)
        tail = ctx.redactor.tail_of(path, TAIL_BYTES) if path.exists() else b""
        text = tail.decode("utf-8", "replace")
        fd, tmp = tempfile.mkstemp(dir=ctx.scratch, prefix=f".{console_name(ctx)}.")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            # Fenced: once Mark seals the fence no periodic tail lands, not even one that
            # is in flight now (the marker's commit outdates it at the store).
            ctx.exit_store().commit(
                {ctx.require_payload().dest.path(console_name(ctx)): Path(tmp)},
                message=f"Console tail {console_name(ctx)}",
                fence=ctx.fence,
            )
        finally:
            Path(tmp).unlink(missing_ok=True)
    except Exception as exc:  # best effort: the tail never decides how the attempt ends
        log.warning("console.upload_failed", exc_type=type(exc).__name__,
                    error=ctx.redactor.text(str(exc)))
        return False
    return True


class PeriodicTail:
    """The sink for periodic tail uploads. After ``close`` no upload is in flight and none
    starts, so the final tail and the marker really are the last writes."""

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx
        self._busy = threading.Lock()
        self._closed = False

    def __call__(self, _tail: bytes) -> None:
        with self._busy:
            if not self._closed:
                upload_tail(self._ctx)  # reads (and redacts) the tail itself

    def close(self, timeout_s: float) -> None:
        """Stop uploading; wait up to ``timeout_s`` for an upload in flight to finish."""
        self._closed = True
        end = time.monotonic() + timeout_s
        # Lock.acquire refuses very long timeouts: wait in pieces the OS accepts.
        while not self._busy.acquire(timeout=os_timeout(end - time.monotonic())):
            if time.monotonic() >= end:
                log.warning("console.periodic_upload_still_running", waited_s=timeout_s)
                return
        self._busy.release()

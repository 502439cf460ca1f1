"""The worker's console tail in the store: redacted, and never allowed to block the run."""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path

import structlog

from fsm.context import Context
from fsm.supervise import TAIL_BYTES, read_tail

log = structlog.get_logger("fsm.console")


def console_name(ctx: Context) -> str:
    return f"console_{ctx.require_payload().phase}.txt"


def console_path(ctx: Context) -> Path:
    return ctx.scratch / console_name(ctx)


def upload_tail(ctx: Context, *, tail: bytes | None = None) -> bool:
    """Upload the redacted last 64,000 bytes of the console; False (logged) on failure."""
    try:
        if tail is None:
            path = console_path(ctx)
            tail = read_tail(path, TAIL_BYTES) if path.exists() else b""
        text = ctx.redactor.bytes(tail).decode("utf-8", "replace")
        fd, tmp = tempfile.mkstemp(dir=ctx.scratch, prefix=f".{console_name(ctx)}.")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            ctx.exit_store().upload_file(
                Path(tmp), ctx.require_payload().dest.path(console_name(ctx))
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

    def __call__(self, tail: bytes) -> None:
        with self._busy:
            if not self._closed:
                upload_tail(self._ctx, tail=tail)

    def close(self, timeout_s: float) -> None:
        """Stop uploading; wait up to ``timeout_s`` for an upload in flight to finish."""
        self._closed = True
        if self._busy.acquire(timeout=max(0.0, timeout_s)):
            self._busy.release()
        else:
            log.warning("console.periodic_upload_still_running", waited_s=timeout_s)

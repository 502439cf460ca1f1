"""The attempt's commits while the worker runs: the console tail, redacted, and the lease
(CONTRACT section 10), which rides in a tail's commit when one is due. Both are fenced
(neither lands after the marker) and never allowed to block the run. The final tail goes
up with the marker (``fsm.attempt.outcome.attach_tail``), whose commit removes the lease."""

from __future__ import annotations

import contextlib
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import structlog

from fsm import rules
from fsm.attempt.lease import LeaseKeeper, lease_name
from fsm.clock import wait_up_to
from fsm.context import Context
from fsm.errors import RetriableError, StoreUnavailable
from fsm.worker.supervise import TAIL_BYTES

log = structlog.get_logger("fsm.console")


def console_name(ctx: Context) -> str:
    return f"console_{ctx.require_payload().phase}.txt"


def console_path(ctx: Context) -> Path:
    """The worker's console: once the worker ran, as the runner holds it open (whatever the
    worker did to its scratch dir), else where it is written."""
    result = ctx.worker.exit
    if result is not None and result.console_held is not None:
        return result.console_held
    return ctx.scratch / console_name(ctx)


def progress_path(ctx: Context) -> Path:
    """``FLASH_PROGRESS_FILE``: the worker touches it in a long silent phase (a sign of
    progress for the stall watch, CONTRACT section 7)."""
    return ctx.scratch / "progress"


#: After a 429 or 5xx the interval between periodic tails doubles, up to this.
MAX_INTERVAL_S = 600.0


def _commit_fenced(ctx: Context, contents: dict[str, bytes], message: str) -> bool:
    """Commit ``contents`` (name under the prefix: bytes) in one fenced commit: False when
    the fence was sealed. Once Mark seals the fence none of them lands, not even one in
    flight now (the marker's commit outdates it at the store)."""
    dest = ctx.require_payload().dest
    files: dict[str, Path] = {}
    try:
        for name, data in contents.items():
            with tempfile.NamedTemporaryFile(dir=ctx.scratch, prefix=f".{name}.",
                                             delete=False) as f:
                files[dest.path(name)] = Path(f.name)
                f.write(data)
        return ctx.tail_store().commit(
            files, message=message, fence=ctx.fence,
            optional=list(files),  # a repo whose .gitignore matches them keeps none: no error
        )
    finally:
        for local in files.values():
            local.unlink(missing_ok=True)


def superseded(later: str) -> RetriableError:
    """The attempt's end once its lease found ``later`` (a later attempt's file)."""
    return RetriableError(
        f"superseded: a later attempt of the run is under the prefix ({later}); this "
        "attempt stopped its work", rule=rules.SUPERSEDED)


def start_lease(ctx: Context, state: str) -> LeaseKeeper | None:
    """Start keeping the attempt's lease (None when ``FLASH_LEASE_S`` is 0): written now,
    renewed from a thread of its own, and kept in ``ctx.lease`` for the marker's commit."""
    period = ctx.tuning.lease_s
    if period <= 0:
        return None
    dest = ctx.require_payload().dest
    name = lease_name(dest.arm, dest.attempt)

    identity = {"run_id": ctx.evidence.get("run_id"), "state": state,
                "host": {"id": ctx.host_id(), "hostname": ctx.hostname()}}
    signs = (console_path(ctx), progress_path(ctx))

    def describe() -> dict[str, Any]:
        # The last sign of progress the stall watch can see (CONTRACT section 7): the
        # console's last write, the progress file's last touch (the host's clock).
        times = []
        for path in signs:
            with contextlib.suppress(OSError):
                times.append(path.stat().st_mtime)
        return {"progress_at": round(max(times), 3) if times else None}

    keeper = LeaseKeeper(
        arm=dest.arm, attempt=dest.attempt, period_s=period, identity=identity,
        write=lambda body: _commit_fenced(ctx, {name: body}, f"Lease {name}"),
        list_names=lambda: ctx.tail_store().list_folder(dest.hf_prefix),
        describe=describe,
        on_superseded=lambda later: ctx.halt_with(superseded(later)),
    )
    ctx.lease = keeper
    keeper.start()
    return keeper


class PeriodicTail:
    """The sink for periodic tail uploads, paced to spare the account's commit quota,
    which a fleet of runners shares with every attempt's marker.

    Called on every tick of the supervisor (``console_upload_interval_s``), it commits
    only when it is time and there is news:

    * a tail identical to the last one committed is skipped;
    * after a 429 or a 5xx (or no answer) the interval doubles, up to ``MAX_INTERVAL_S``,
      and never ends before the store's ``Retry-After``; each tail that lands takes one
      base interval off again (a slow recovery: a throttled fleet does not stampede);
    * within one interval of the work deadline none is started: the final tail goes up
      with the marker, and the marker does not wait behind an optional commit.

    Each try is a single call (the store does not retry an optional write). After
    ``close`` no upload is in flight and none starts, so the final tail and the marker
    really are the last writes.
    """

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx
        self._busy = threading.Lock()
        self._closed = False
        self._base_s = ctx.tuning.console_upload_interval_s if ctx is not None else 30.0
        self.interval_s = self._base_s
        self._next_at = 0.0
        self._last: bytes | None = None

    def __call__(self, _tail: bytes) -> None:
        with self._busy:
            if self._closed or time.monotonic() < self._next_at:
                return  # closed, or backing off
            ctx = self._ctx
            if ctx.work_deadline.remaining() < self._base_s:
                return  # the marker's time is near: the final tail goes with it
            if ctx.lease is not None and ctx.lease.superseded is not None:
                return  # a later attempt owns the prefix's console now
            try:
                path = console_path(ctx)
                # Read and redacted here, never taken already cut: the redactor reads a wider
                # window and masks before it cuts (no secret leaves as a fragment).
                tail = ctx.redactor.tail_of(path, TAIL_BYTES) if path.exists() else b""
                if tail == self._last:
                    return  # nothing new: no commit
                self._commit(tail)
            except StoreUnavailable as exc:  # back off: the interval doubles, up to the cap
                self.interval_s = min(MAX_INTERVAL_S, self.interval_s * 2)
                wait = max(self.interval_s, exc.retry_after or 0.0)
                self._next_at = time.monotonic() + wait
                log.warning("console.upload_backoff", interval_s=self.interval_s,
                            next_in_s=round(wait, 3), error=ctx.redactor.text(str(exc)))
                return
            except Exception as exc:  # best effort: the tail never decides how the attempt ends
                log.warning("console.upload_failed", exc_type=type(exc).__name__,
                            error=ctx.redactor.text(str(exc)))
                return
            self._last = tail
            self.interval_s = max(self._base_s, self.interval_s - self._base_s)
            self._next_at = time.monotonic() + self.interval_s - 0.5 * self._base_s

    def _commit(self, tail: bytes) -> None:
        """The tail, with the lease when it is due (one commit carries both)."""
        ctx, lease = self._ctx, self._ctx.lease
        name = console_name(ctx)
        tail = tail.decode("utf-8", "replace").encode("utf-8")
        if lease is None or (body := lease.riding()) is None:
            _commit_fenced(ctx, {name: tail}, f"Console tail {name}")
            return
        landed = False
        try:
            landed = _commit_fenced(ctx, {name: tail, lease.name: body},
                                    f"Console tail {name} and lease")
        finally:
            lease.carried(landed)

    def close(self, timeout_s: float) -> None:
        """Stop uploading; wait up to ``timeout_s`` for an upload in flight to finish."""
        self._closed = True
        # Lock.acquire refuses very long timeouts: wait in pieces the OS accepts.
        if not wait_up_to(lambda timeout: self._busy.acquire(timeout=timeout), timeout_s):
            log.warning("console.periodic_upload_still_running", waited_s=timeout_s)
            return
        self._busy.release()

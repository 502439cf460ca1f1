"""The attempt marker: built, persisted for restart safety, and published exactly once.

Mark is the only state that publishes a marker on the normal path; the deadline
watchdog is the one other caller, when the main thread is stuck. ``Publisher.claim``
makes sure only one of them ever publishes.

The result is persisted next to the payload (in production the bind-mounted
``/root/flash``, which survives the container) before it is uploaded. A runner started
again for the same attempt finds it and replays it instead of training again; an
exclusive lock keeps two live runners off one attempt.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import structlog

from fsm.clock import Deadline
from fsm.errors import DeadlineExceeded, FlashError, StoreAuthError
from fsm.payload import Destination
from fsm.redact import Redactor
from fsm.store.base import Store

MAX_ERROR_CHARS = 2_000
log = structlog.get_logger("fsm.marker")


def build(
    *,
    ok: bool,
    retriable: bool,
    error: str,
    dest: Destination,
    redactor: Redactor,
    evidence: dict[str, Any],
    ts: float | None = None,
) -> dict[str, Any]:
    """The marker of CONTRACT section 4 plus evidence, redacted, error capped."""
    marker: dict[str, Any] = {
        "ok": ok,
        "ts": time.time() if ts is None else ts,
        "attempt": dest.attempt,
        "retriable": bool(retriable) and not ok,
        "error": "" if ok else redactor.text(error)[:MAX_ERROR_CHARS],
    }
    for key, value in evidence.items():
        marker.setdefault(key, redactor.deep(value))
    return marker


def result_path(payload_path: Path, dest: Destination) -> Path:
    """Where the attempt's result is persisted: next to the payload."""
    return payload_path.parent / f".flash-{dest.arm}_attempt{dest.attempt}.result.json"


def lock_path(payload_path: Path, dest: Destination) -> Path:
    return payload_path.parent / f".flash-{dest.arm}_attempt{dest.attempt}.lock"


def read_result(path: Path) -> dict[str, Any] | None:
    """The persisted marker of a finished attempt, or None (absent or unreadable)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if isinstance(data, dict) and isinstance(data.get("ok"), bool):
        return data
    return None


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class AttemptLock:
    """An exclusive ``flock`` on the attempt, held for the life of the process."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def acquire(self, timeout_s: float) -> bool:
        """Take the lock, waiting up to ``timeout_s`` for a previous runner to let go.
        True when held (or when the lock file cannot be made: a read-only payload
        directory has nothing to protect)."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            return True
        give_up = time.monotonic() + timeout_s
        delay = 0.05
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if time.monotonic() >= give_up:
                    os.close(fd)
                    return False
                time.sleep(min(delay, max(0.0, give_up - time.monotonic())))
                delay = min(delay * 2, 1.0)
                continue
            self._fd = fd
            return True

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


class Publisher:
    """Publishes the attempt's one marker: persist, local copy, upload with retries."""

    def __init__(self) -> None:
        self._claim = threading.Lock()
        self._claimed = False
        self.done = threading.Event()

    def claim(self) -> bool:
        """True for the first caller only; everyone else must not publish."""
        with self._claim:
            if self._claimed:
                return False
            self._claimed = True
            return True

    def publish(
        self,
        marker: dict[str, Any],
        *,
        dest: Destination,
        store: Store | None,
        result_file: Path | None,
        scratch_dir: Path,
        deadline: Deadline,
        tries: int = 5,
        base_delay_s: float = 1.0,
    ) -> bool:
        """Persist, then upload the marker. True when it reached the store."""
        try:
            if result_file is not None:
                try:
                    write_json_atomic(result_file, marker)
                except OSError as exc:
                    log.warning("marker.persist_failed", path=str(result_file), error=exc.strerror)
            local = scratch_dir / dest.marker_name
            try:
                write_json_atomic(local, marker)
            except OSError as exc:
                # An unwritable scratch directory must not cost the marker: upload it from
                # the system's temporary directory instead.
                log.warning("marker.local_copy_failed", path=str(local), error=exc.strerror)
                local = Path(tempfile.gettempdir()) / f".flash-{os.getpid()}-{dest.marker_name}"
                write_json_atomic(local, marker)
            if store is None:
                log.warning("marker.no_store", reason="the marker's destination is unknown")
                return False
            return _upload(store, local, dest, deadline, tries, base_delay_s)
        finally:
            self.done.set()


def _upload(
    store: Store,
    local: Path,
    dest: Destination,
    deadline: Deadline,
    tries: int,
    base_delay_s: float,
) -> bool:
    target = dest.path(dest.marker_name)
    for attempt in range(1, tries + 1):
        try:
            store.upload_file(local, target)
        except (StoreAuthError, DeadlineExceeded) as exc:
            log.error("marker.upload_failed", path=target, error=str(exc), final=True)
            return False
        except (FlashError, OSError) as exc:
            delay = base_delay_s * 2 ** (attempt - 1) * random.uniform(0.5, 1.0)
            last = attempt == tries or deadline.remaining() < delay
            log.warning(
                "marker.upload_retry", path=target, attempt=attempt, error=str(exc), final=last
            )
            if last:
                return False
            time.sleep(delay)
        else:
            log.info("marker.published", path=target)
            return True
    return False  # pragma: no cover - the loop returns


def acquire_lock(payload_path: Path, dest: Destination, timeout_s: float) -> AttemptLock | None:
    """The attempt lock, or None when another live runner holds it past ``timeout_s``."""
    lock = AttemptLock(lock_path(payload_path, dest))
    with contextlib.suppress(OSError):
        if lock.acquire(timeout_s):
            return lock
        return None
    return lock

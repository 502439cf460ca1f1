"""The attempt's marker published exactly once.

Mark is the only state that publishes a marker on the normal path; the deadline
watchdog is the one other caller, when the main thread is stuck. ``Publisher.claim`` makes
sure only one of them ever publishes, and both build their record with
``fsm.attempt.outcome.record``. Publishing persists the result first
(``fsm.attempt.result``), then makes one commit of the end-of-attempt artifacts with the
marker last, after the fence that keeps optional uploads from landing later is sealed.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

import structlog

from fsm import exits
from fsm.attempt.result import Persisted, persist
from fsm.budget import Budget, GaveUp, backoff
from fsm.errors import (
    DeadlineExceeded,
    FlashError,
    StoreAuthError,
    StoreNotFound,
    StoreRefused,
    StoreUnavailable,
)
from fsm.files import write_atomic
from fsm.payload import Destination
from fsm.store.base import PRELOAD_RESULT_NAME, Fence, Store

__all__ = ["READBACK_S", "Published", "Publisher"]

#: The end of the marker's budget kept for reading the marker back, when a commit may have
#: landed with its answer lost (a hung try, a 5xx): the exit status says what is true.
READBACK_S = 1.0
#: How often the marker's commit is tried.
TRIES = 5
log = structlog.get_logger("fsm.marker")


class Published:
    """How publishing went: the marker landed, or why not; where the result is kept;
    and, when the store refused it for good, what has to change before any rerun can
    publish it (``refused``, one line)."""

    def __init__(self) -> None:
        self.landed = False
        self.error = ""
        self.persisted: Path | None = None
        #: Why the result could not be persisted next to the payload (one line), if so.
        self.persist_error: str | None = None
        self.refused: str | None = None
        #: Whether a try may have landed the marker and the read-back could not tell.
        self.unconfirmed = False

    def unpublished(self) -> tuple[int, str]:
        """The exit status and the words of a marker that did not land: only what is
        true of the persisted result and of what a rerun of the payload would do."""
        if self.refused is not None:
            kept = (f"the result is kept at {self.persisted}, and a rerun publishes it once "
                    "that is fixed" if self.persisted else
                    "the result could not be kept next to the payload either")
            return exits.REFUSED.code, (
                f"marker NOT published: the store refuses it for good ({self.error}); no "
                f"rerun of this payload can publish it until this is fixed: {self.refused}; "
                f"{kept}")
        if self.persisted is not None:
            said = ("marker NOT confirmed published (a try may have landed it and the store "
                    "did not answer when it was read back: "
                    if self.unconfirmed else "marker NOT published (")
            return exits.UNPUBLISHED.code, (
                f"{said}{self.error}); the result is persisted at "
                f"{self.persisted} and running the same payload again publishes it")
        return exits.UNPERSISTED.code, (
            f"marker NOT published ({self.error}), and the result could not be persisted "
            "next to the payload either: running the same payload again runs the attempt "
            "again")


class Publisher:
    """Publishes the attempt's one marker: persist, then one commit of the end-of-attempt
    artifacts with the marker last. Mark and the deadline watchdog both go through here;
    ``claim`` lets only the first of them publish."""

    def __init__(self) -> None:
        self._claim = threading.Lock()  # taken by the first claim, never released
        self.done = threading.Event()
        self.result = Published()
        #: What was (or is being) published, by whichever caller claimed first.
        self.record: Persisted | None = None

    def claim(self) -> bool:
        """True for the first caller only; everyone else must not publish."""
        return self._claim.acquire(blocking=False)

    def publish(self, record: Persisted, *, dest: Destination, store: Store | None,
                result_file: Path | None, ident: dict[str, Any], scratch_dir: Path,
                budget: Budget, fence: Fence, base_delay_s: float = 1.0,
                max_delay_s: float = 30.0, readback: Store | None = None) -> Published:
        """Persist the result at once, then commit the artifacts and the marker. Every try
        carries the same files, so a try abandoned at its time bound that lands late only
        repeats what landed; sealing ``fence`` first means no optional write of the attempt
        (a periodic console tail) lands after the marker.

        ``store``'s calls end :data:`READBACK_S` before ``budget`` does; ``readback`` (a
        handle bounded by the whole of it) then reads the marker back when the tries did
        not get it landed but one of them may have (its answer lost): a marker found there
        as it was sent is published, whatever the tries said."""
        result = self.result
        self.record = record
        try:
            if result_file is not None:
                try:
                    persist(result_file, ident, record)
                    result.persisted = result_file
                except OSError as exc:
                    log.warning("result.persist_failed", path=str(result_file),
                                error=exc.strerror)
                    result.persist_error = (f"the result could not be persisted in "
                                            f"{result_file.parent} ({exc.strerror})")
            fence.seal()
            if store is None:
                result.error = "the marker's store could not be opened"
                return result
            files = _local_copies(record, dest, scratch_dir)
            result.landed, result.error, result.refused = _commit(
                store, files, dest, budget.reserving(READBACK_S) if readback else budget,
                base_delay_s, max_delay_s,
                delete=[dest.path(name) for name in record.remove])
            if not result.landed and result.refused is None and readback is not None:
                target = dest.path(dest.marker_name)
                found = _landed(readback, target, files[target])
                result.landed, result.unconfirmed = found is True, found is None
            return result
        finally:
            self.done.set()


def _local_copies(record: Persisted, dest: Destination, scratch_dir: Path) -> dict[str, Path]:
    """The files of the final commit, written locally (the marker last): the scratch
    directory, else the system's temporary directory (an unwritable scratch directory
    must not cost the marker)."""
    files: dict[str, Path] = {}
    for name, text in [*record.artifacts.items(), (dest.marker_name, json.dumps(record.marker))]:
        local = scratch_dir / name
        try:
            write_atomic(local, text)
        except OSError as exc:
            log.warning("marker.local_copy_failed", path=str(local), error=exc.strerror)
            local = Path(tempfile.gettempdir()) / f".flash-{os.getpid()}-{name}"
            write_atomic(local, text)
        files[dest.path(name)] = local
    return files


def _commit(store: Store, files: dict[str, Path], dest: Destination, budget: Budget,
            base_delay_s: float, max_delay_s: float, *, delete: list[str],
            ) -> tuple[bool, str, str | None]:
    """Commit the files (removing ``delete`` where present), retried; (landed, why not,
    what to fix when refused for good)."""
    target = dest.path(dest.marker_name)

    # What may be left out when the repo's .gitignore matches it: the console tail and the
    # stacks. The marker and the preload's result may not (StoreRefused names the file).
    optional = [path for path in files if path != target
                and path.rsplit("/", 1)[-1] != PRELOAD_RESULT_NAME]

    def once(_attempt: int) -> None:
        store.commit(files, message=f"Attempt marker {dest.marker_name}", optional=optional,
                     delete=delete)

    def delay(attempt: int, exc: Exception) -> float | None:
        if (isinstance(exc, StoreAuthError | StoreNotFound | StoreRefused | DeadlineExceeded)
                or not isinstance(exc, FlashError | OSError | ValueError)):
            return None  # another try cannot help
        wait = budget.capped_backoff(backoff(attempt, base_s=base_delay_s, max_s=max_delay_s))
        # A throttled store names its wait: honoured, as far as the budget allows
        # (a wait that would pass the marker's deadline is not started).
        asked = exc.retry_after if isinstance(exc, StoreUnavailable) else None
        return max(wait, asked) if asked is not None else wait

    try:
        budget.retry(once, tries=TRIES, delay=delay, what=f"marker {target}")
    except GaveUp as gave_up:
        error = str(gave_up.last) or type(gave_up.last).__name__
        refused = _refused_for_good(gave_up.last, dest)
        log.error("marker.upload_failed", path=target, error=error, tries=gave_up.tries,
                  ended_by=gave_up.why, refused_for_good=refused is not None)
        return False, error, refused
    log.info("marker.published", path=target, files=len(files))
    return True, "", None


def _landed(store: Store, target: str, local: Path) -> bool | None:
    """Whether the marker is in the store as it was sent (read back: a try whose answer
    was lost may have landed it); None when the store did not say."""
    sent = local.read_bytes()
    try:
        found = store.read_file(target, len(sent))
    except StoreNotFound:
        found = b""
    except Exception as exc:  # the store did not say: neither can the runner
        log.warning("marker.readback_failed", path=target, exc_type=type(exc).__name__)
        return None
    landed = found == sent
    log.info("marker.readback", path=target, landed=landed)
    return landed


def _refused_for_good(exc: BaseException, dest: Destination) -> str | None:
    """What has to change when the store's answer is one no rerun can change, or None
    (a store that failed, hung or throttled may take the marker next time)."""
    if isinstance(exc, StoreRefused):
        return exc.fix
    if isinstance(exc, StoreAuthError):
        return (f"the store refuses the token (HTTP 401/403): give HF_TOKEN a token that may "
                f"write to {dest.hf_repo}")
    if isinstance(exc, StoreNotFound):
        return f"the repo {dest.hf_repo} is not on the store: create it, or fix hf_repo"
    return None

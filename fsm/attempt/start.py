"""The attempt's first start, persisted next to the payload: the budget belongs to the attempt.

Once LoadPayload holds the attempt's lock, and before any work, it looks for
``.flash-<arm>_attempt<N>.start.json`` next to the payload (``fsm.attempt.result.start_path``). When
there is none, this process starts the attempt and writes it (atomically, flushed to disk):
a version, the attempt's identity (the same one a persisted result carries), ``started_at``
(epoch seconds), the kernel's boot id and the ``time.monotonic`` reading of that moment.
A runner restarted for the same attempt (after a SIGKILL, an OOM kill, a container
restart) reads it back and continues the budget instead of starting a fresh one.

On the same boot the deadline is anchored on the recorded monotonic reading:
``CLOCK_MONOTONIC`` is host-wide, so it survives a container restart, and it is immune to
wall-clock steps. On another boot (or where the boot id is unknown) the epoch is all there
is. A file that is unreadable, malformed, of another version or of another attempt is
ignored and replaced (``attempt.start_ignored``); one that cannot be written leaves the
attempt running on this process's start (``attempt.start_unpersisted``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, NamedTuple

import structlog

from fsm.attempt.result import read_own
from fsm.clock import Deadline
from fsm.files import finite_number, write_atomic

#: The start file's format; a file of any other version is ignored and replaced.
START_VERSION = 1
log = structlog.get_logger("fsm.attempt_start")


class AttemptStart(NamedTuple):
    """When the attempt first started: on the wall clock, and on the monotonic clock of
    the boot named by ``boot_id`` (None where the boot id could not be read)."""

    started_at: float
    monotonic: float
    boot_id: str | None

    def same_boot(self, boot_id: str | None) -> bool:
        """Whether the monotonic reading can be compared with ``time.monotonic`` now."""
        return self.boot_id is not None and self.boot_id == boot_id

    def deadline(self, at: float, boot_id: str | None) -> Deadline:
        """The attempt's deadline at epoch ``at``: on the monotonic clock ``at - started_at``
        seconds after the start when this is the start's boot, else anchored on the epoch."""
        if self.same_boot(boot_id):
            return Deadline.for_attempt(at, mono_at=self.monotonic + (at - self.started_at))
        return Deadline.for_attempt(at)

    def spent_s(self, boot_id: str | None) -> float:
        """Seconds since the attempt's start (monotonic on the same boot, else by the epoch)."""
        if self.same_boot(boot_id):
            return time.monotonic() - self.monotonic
        return time.time() - self.started_at


def begin(
    path: Path, ident: dict[str, Any], started_at: float, boot: str | None
) -> tuple[AttemptStart, bool]:
    """The attempt's start and whether it was persisted by an earlier runner (True: this
    runner continues the attempt). Without a usable start file, this process's start
    (``started_at``, epoch) is the attempt's, and it is persisted at ``path`` now. Call it
    only while holding the attempt's lock: it writes."""
    found = _load(path, ident, boot)
    if isinstance(found, AttemptStart):
        return found, True
    if found is not None:
        log.warning("attempt.start_ignored", path=str(path), reason=found)
    # This process's start on the monotonic clock: as long ago as on the wall clock.
    start = AttemptStart(started_at, time.monotonic() - max(0.0, time.time() - started_at), boot)
    data = {"version": START_VERSION, "identity": ident, **start._asdict()}
    try:
        write_atomic(path, json.dumps(data), durable=True)
    except OSError as exc:  # the attempt still runs; a restart would start a fresh budget
        log.warning("attempt.start_unpersisted", path=str(path), error=exc.strerror)
    return start, False


def _load(path: Path, ident: dict[str, Any], boot: str | None) -> AttemptStart | str | None:
    """The persisted start of this attempt, else why the file there is not (None: no file)."""
    try:
        raw = read_own(path, ident, version=START_VERSION, what="start")
    except OSError as exc:
        return f"unreadable ({exc.strerror})"
    if not isinstance(raw, dict):
        return raw
    for name in ("started_at", "monotonic"):
        if finite_number(raw.get(name)) is None:
            return f"'{name}' is not a finite number"
    recorded_boot = raw.get("boot_id")
    if recorded_boot is not None and not isinstance(recorded_boot, str):
        return "'boot_id' is not text"
    start = AttemptStart(float(raw["started_at"]), float(raw["monotonic"]), recorded_boot)
    if start.same_boot(boot) and start.monotonic > time.monotonic():
        return "a monotonic reading later than now on the same boot"
    return start

"""The host's storage under the runner's own writes: named, with its evidence, and classed.

A write of the runner's (the code tree in the code root, the console and the spilled spec
in the scratch dir, the lock, start and result next to the payload, the weight cache) that
fails with ENOSPC, EDQUOT or EROFS is no defect and no worker failure: the host's storage
pushed back. The driver turns such an ``OSError`` (anywhere on the failure's cause chain)
into a failure of rule ``host-storage`` or ``host-storage-filled`` (``fsm.rules``), whose
marker names the filesystem (its mount point and type), its free space and inodes, and
what they were when the attempt started (evidence ``storage``).

The class is the evidence's (docs/policy.md, "The host's storage"):

* read-only (EROFS, or the filesystem is mounted read-only): the host's fault, retriable
  (``host-storage``);
* full (ENOSPC, EDQUOT, or no inode left) on a filesystem that was already short when the
  attempt started (less than :data:`FLOOR_BYTES` free, ``FLASH_STORAGE_FLOOR_BYTES``; or
  no free inode): the host came full (a previous tenant's leftovers), retriable
  (``host-storage``);
* full on a filesystem that had that room at the start: the attempt itself ran out of it,
  and a fresh host of the same shape runs out again, fatal (``host-storage-filled``). The
  free space *now* cannot tell: a failed write's partial file is usually removed before
  anyone looks. A filesystem without a start to compare with (first met later) is judged
  the same way: fatal.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from fsm import rules
from fsm.errors import FatalError, FlashError, RetriableError, causes

__all__ = ["FLOOR_BYTES", "STORAGE_ERRNOS", "Usage", "came_short", "classify", "floor",
           "snapshot", "usage"]

STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EROFS, errno.EDQUOT})
#: Less free than this at the start: the host came short of room (a GPU job needs more).
FLOOR_BYTES = 256 << 20
_NO_START = "full, with no start to compare: taken as the attempt's own need"
_CAME_FULL = "already short of room when the attempt started: the host came full"
_FILLED = ("it had room when the attempt started, and the attempt ran out of it: a fresh "
           "host of the same shape runs out again")


class Usage(NamedTuple):
    """A filesystem as ``statvfs`` and the mount table show it."""

    path: str  # the directory looked at
    mount: str | None
    fstype: str | None
    free_bytes: int
    size_bytes: int
    free_inodes: int
    inodes: int
    read_only: bool

    @property
    def full(self) -> bool:
        return self.free_bytes <= 0 or (self.inodes > 0 and self.free_inodes <= 0)


def _existing(path: Path) -> Path:
    """``path``, or its nearest ancestor that exists (what the write would have gone in)."""
    chain = [path, *path.parents]
    return next((folder for folder in chain if folder.exists()), chain[-1])


def _mount_of(path: Path) -> tuple[str | None, str | None]:
    """The mount point and filesystem type that hold ``path`` (the longest match)."""
    try:
        lines = Path("/proc/self/mountinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None, None
    try:
        real = str(path.resolve())
    except (OSError, RuntimeError):
        real = str(path)
    best: tuple[str | None, str | None] = (None, None)
    for line in lines.splitlines():
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) < 5 or not right:
            continue
        point = fields[4].replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best[0] or ""):
            best = (point, right.split()[0])
    return best


def usage(path: Path) -> Usage | None:
    """The filesystem holding ``path`` (or its nearest existing ancestor), or None."""
    where = _existing(path)
    try:
        st = os.statvfs(where)
    except OSError:
        return None
    return Usage(
        str(path), *_mount_of(where),  # the path, then its mount point and type
        free_bytes=st.f_bavail * st.f_frsize, size_bytes=st.f_blocks * st.f_frsize,
        free_inodes=st.f_favail, inodes=st.f_files,
        read_only=bool(st.f_flag & os.ST_RDONLY),
    )


def snapshot(dirs: Iterable[Path]) -> dict[str, Usage]:
    """The filesystems under the runner's directories at the start of the attempt, by
    mount point (one entry per filesystem)."""
    seen: dict[str, Usage] = {}
    for found in filter(None, map(usage, dirs)):
        seen.setdefault(found.mount or found.path, found)
    return seen


def came_short(before: Usage, floor_bytes: int) -> bool:
    """Whether a filesystem was already short of room when the attempt started: less than
    ``floor_bytes`` free, or no free inode. A full disk is then the host's fault, for the
    runner's own writes (``classify``) and for the worker's (``fsm.policy.HOST_EVIDENCE``)."""
    return before.free_bytes < floor_bytes or (before.inodes > 0 and before.free_inodes <= 0)


def floor(environ: Mapping[str, str]) -> int:
    """``FLASH_STORAGE_FLOOR_BYTES`` (a whole number of bytes), else :data:`FLOOR_BYTES`."""
    try:
        value = int(environ.get("FLASH_STORAGE_FLOOR_BYTES", ""))
    except ValueError:
        return FLOOR_BYTES
    return value if value >= 0 else FLOOR_BYTES


def classify(
    exc: BaseException,
    *,
    state: str,
    candidates: Iterable[Path],
    start: Mapping[str, Usage],
    environ: Mapping[str, str],
) -> tuple[FlashError, dict[str, Any]] | None:
    """A typed failure for a storage error of the runner's own (None: ``exc`` is none),
    and its evidence. ``candidates`` are the directories the failing state writes in, most
    likely first: the error's own file name, when it has one, comes before them."""
    if isinstance(exc, FlashError):
        return None  # classified already by whoever raised it
    # the first OSError of a storage errno on ``exc`` or down its cause chain
    os_error = next((e for e in causes(exc)
                     if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS), None)
    if os_error is None:
        return None
    paths = [Path(str(name)) for name in (os_error.filename, os_error.filename2) if name]
    looked = [u for u in (usage(p) for p in [*paths, *candidates]) if u is not None]
    if not looked:
        return None
    # The file's own filesystem when the error names one; else the first that is read-only
    # or full; else the first candidate.
    fs = looked[0] if paths else next((u for u in looked if u.read_only or u.full), looked[0])
    where = fs.mount or fs.path
    before = start.get(where)
    code = errno.errorcode.get(os_error.errno or 0, "?")
    if os_error.errno == errno.EROFS or fs.read_only:
        verdict, why = rules.HOST_STORAGE, "read-only: the host's disk"
    elif before is None:
        verdict, why = rules.HOST_STORAGE_FILLED, _NO_START
    elif came_short(before, floor(environ)):
        verdict, why = rules.HOST_STORAGE, _CAME_FULL
    else:
        verdict, why = rules.HOST_STORAGE_FILLED, _FILLED
    message = (
        f"{state}: the host's storage refused the runner's write ({code}: "
        f"{os_error.strerror}{' on ' + str(paths[0]) if paths else ''}): "
        f"{where} ({fs.fstype or 'unknown type'}) "
        f"has {_size(fs.free_bytes)} of {_size(fs.size_bytes)} and {fs.free_inodes:,} inodes "
        f"free{'' if before is None else f' (at the start: {_size(before.free_bytes)})'}"
        f"{', mounted read-only' if fs.read_only else ''}; {why}"
    )
    evidence = {"errno": code, **fs._asdict(), "verdict": why}
    if before is not None:
        evidence["at_start"] = {"free_bytes": before.free_bytes,
                                "free_inodes": before.free_inodes}
    return (RetriableError if verdict.retriable else FatalError)(message, rule=verdict), evidence


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


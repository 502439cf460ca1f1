"""The host's filesystems as evidence (issue 24): how much room the scratch, code and cache
filesystems had before setup, and /dev/shm's size.

LoadPayload measures them before any setup (``statvfs``: microseconds, no process), and
VerifyRemote again after a worker died: a console saying a disk is full is the host's
fault when a filesystem was already short before the attempt wrote anything (a previous
tenant's files), the job's when the attempt itself filled it (``fsm.policy.HOST_EVIDENCE``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsm.errors import PayloadError

__all__ = ["SHM", "Space", "measure", "short", "space"]

#: A filesystem with less free than this before setup is short (``FLASH_DISK_SHORT_MIB``).
DEFAULT_SHORT_MIB = 1024
#: ... or with less than this share of its blocks or inodes free.
SHORT_FRACTION = 0.01
SHM = Path("/dev/shm")
MIB = 1 << 20


@dataclass(frozen=True)
class Space:
    """One filesystem, as ``statvfs`` saw it through ``path`` (its nearest existing
    ancestor when ``path`` does not exist yet)."""

    role: str
    path: str
    device: int
    total_bytes: int
    free_bytes: int
    total_inodes: int
    free_inodes: int

    def evidence(self) -> dict[str, Any]:
        facts: dict[str, Any] = {
            "path": self.path,
            "total_mib": self.total_bytes // MIB,
            "free_mib": self.free_bytes // MIB,
        }
        if self.total_inodes:
            facts["free_inodes"] = self.free_inodes
        return facts


def space(role: str, path: Path) -> Space | None:
    """``path``'s filesystem (through its nearest existing ancestor), or None."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        st = os.statvfs(probe)
        device = os.stat(probe).st_dev
    except OSError:
        return None
    return Space(role, str(path), device, st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize,
                 st.f_files, st.f_favail)


def measure(paths: Iterable[tuple[str, Path]]) -> tuple[Space, ...]:
    """Each distinct filesystem of ``paths`` once (by device), in the order given."""
    seen: set[int] = set()
    found: list[Space] = []
    for role, path in paths:
        got = space(role, path)
        if got is not None and got.device not in seen:
            seen.add(got.device)
            found.append(got)
    return tuple(found)


def short(fs: Space, short_mib: int = DEFAULT_SHORT_MIB) -> bool:
    """Whether ``fs`` had too little room to start a run on: less than ``short_mib`` MiB
    free, or less than :data:`SHORT_FRACTION` of its blocks or its inodes."""
    if fs.total_bytes <= 0:
        return False
    if fs.free_bytes < short_mib * MIB or fs.free_bytes < fs.total_bytes * SHORT_FRACTION:
        return True
    return bool(fs.total_inodes) and fs.free_inodes < fs.total_inodes * SHORT_FRACTION


def short_mib(env: Mapping[str, str]) -> int:
    """``FLASH_DISK_SHORT_MIB`` (a whole number of MiB, at least 1), else the default."""
    raw = env.get("FLASH_DISK_SHORT_MIB")
    if raw is None or not raw.strip():
        return DEFAULT_SHORT_MIB
    text = raw.strip()
    if not text.isdigit() or int(text) < 1:
        raise PayloadError(
            f"FLASH_DISK_SHORT_MIB={text[:40]!r} is unusable: it must be a whole number of "
            "MiB, at least 1"
        )
    return int(text)

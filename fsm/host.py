"""What the runner learns about its host: the GPUs ``nvidia-smi`` reports, and the kernel's
OOM kills counted by the container's memory cgroup.

``HostProbe`` asks the GPUs once (``fsm.gpus``), in the background, from the runner's
first step: LoadPayload waits for the answer, never more than ``PROBE_S``, before any
setup, and ends the attempt on a sick or busy GPU (CONTRACT section 8; a hung
``nvidia-smi``, the classic sign of a GPU that fell off the bus, is killed and reported,
never waited for). Its facts ride in every marker as the ``host`` evidence, so the control
plane can stop renting a bad machine; the snapshot is the baseline the host watch and the
after-death check compare with.

``oom_kills`` reads the ``oom_kill`` count of the runner's memory cgroup (cgroup v2
``memory.events``, v1 ``memory.oom_control``): Train reads it before and after the worker,
and a rise means the kernel's OOM killer ended (part of) the worker.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from fsm import gpus

#: The longest the attempt waits for ``nvidia-smi``; then it is killed and called hung.
PROBE_S = gpus.SNAPSHOT_S
#: Overrides where the memory cgroup's OOM count is read (unusual mounts, tests).
MEMORY_EVENTS_VAR = "FLASH_MEMORY_EVENTS"


class Gpu(NamedTuple):
    name: str
    uuid: str
    memory_mib: int | None


class HostFacts(NamedTuple):
    """What ``nvidia-smi`` said. ``problem`` is None when it answered: else ``"absent"``
    (not on PATH), ``"failed"`` (non-zero exit or unreadable output) or ``"hung"``."""

    hostname: str
    gpus: tuple[Gpu, ...] = ()
    driver: str | None = None
    problem: str | None = None
    #: what went wrong, in words (the failing nvidia-smi's own last line)
    detail: str = ""

    def evidence(self) -> dict[str, Any] | None:
        """The marker's ``host`` evidence (CONTRACT section 4): None without nvidia-smi."""
        if self.problem == "absent":
            return None
        facts: dict[str, Any] = {
            "hostname": self.hostname,
            "gpus": [gpu._asdict() for gpu in self.gpus],
            "driver": self.driver,
        }
        if self.problem is not None:
            facts["error"] = self.describe_problem()
        return facts

    def describe_problem(self) -> str:
        return {
            None: "nvidia-smi answered",
            "absent": "nvidia-smi is not on PATH (no NVIDIA driver visible)",
            "hung": f"nvidia-smi did not answer within {PROBE_S:g}s (a hung GPU or driver)",
            "failed": f"nvidia-smi failed: {self.detail}",
        }.get(self.problem, self.problem or "")


class HostProbe:
    """The GPUs asked once (``fsm.gpus``: ``--query-gpu``, ``--query-remapped-rows`` and
    ``--query-compute-apps`` together) in a daemon thread, started at the runner's first
    step. ``snapshot(wait_s)`` waits at most ``wait_s`` for the whole answer (it takes at
    most ``PROBE_S`` plus the kill grace: a hung ``nvidia-smi`` is killed and reported);
    ``facts(wait_s)`` is the same answer as the marker's ``host`` evidence."""

    def __init__(self, environ: Mapping[str, str], *, timeout_s: float = PROBE_S) -> None:
        self._hostname = os.uname().nodename
        self._timeout_s = timeout_s
        self._started = time.monotonic()
        self.path = environ.get("PATH")
        self._pending = gpus.start(environ, timeout_s)

    @classmethod
    def start_early(cls, environ: Mapping[str, str]) -> None:
        """Ask the GPUs at the runner's first instruction (``fsm.cli``), so that the answer
        is in by the time LoadPayload needs it: it overlaps the runner's imports."""
        global _early
        _early = cls(environ)

    @classmethod
    def for_attempt(cls, environ: Mapping[str, str]) -> HostProbe:
        """The probe started early, when it asked with the same PATH; else a new one."""
        global _early
        early, _early = _early, None
        if early is not None and early.path == environ.get("PATH"):
            return early
        return cls(environ)

    @property
    def hostname(self) -> str:
        return self._hostname

    def snapshot(self, wait_s: float) -> gpus.Snapshot | None:
        """The snapshot, waiting at most ``wait_s`` for it (None while it is under way)."""
        return self._pending.result(max(0.0, wait_s))

    def facts(self, wait_s: float) -> HostFacts | None:
        """The answer, waiting at most ``wait_s`` for it: ``hung`` once ``nvidia-smi`` has
        had its time, None while it still may answer."""
        left = self._started + self._timeout_s + gpus.KILL_GRACE_S - time.monotonic()
        snap = self.snapshot(min(wait_s, max(0.0, left)))
        if snap is not None:
            return facts_of(self._hostname, snap)
        if wait_s < left:
            return None
        return HostFacts(self._hostname, problem="hung")


_early: HostProbe | None = None


def facts_of(hostname: str, snap: gpus.Snapshot) -> HostFacts:
    """A snapshot as the host facts every marker carries."""
    drivers = [gpu.driver for gpu in snap.gpus if gpu.driver]
    listed = tuple(Gpu(gpu.name or "", gpu.uuid or "", gpu.memory_total_mib) for gpu in snap.gpus)
    return HostFacts(hostname, listed, drivers[0] if drivers else None, snap.problem,
                     snap.detail)


# --- the kernel's OOM kills ---------------------------------------------------------------

CGROUP_ROOT = Path("/sys/fs/cgroup")


def memory_events_path(environ: Mapping[str, str]) -> Path | None:
    """The file holding this process's memory cgroup ``oom_kill`` count, or None."""
    override = environ.get(MEMORY_EVENTS_VAR)
    if override:
        return Path(override)
    for candidate in _cgroup_candidates():
        if candidate.is_file():
            return candidate
    return None


def _cgroup_candidates() -> list[Path]:
    """cgroup v2 ``memory.events`` first, then v1 ``memory.oom_control``: in the process's
    own cgroup, then at the mount's root (a container whose cgroup namespace is private
    sees its own cgroup there, while /proc/self/cgroup may name the host's path)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        lines = []
    v2: list[str] = []
    v1: list[str] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            v2.append(path.lstrip("/"))
        elif "memory" in controllers.split(","):
            v1.append(path.lstrip("/"))
    found: list[Path] = []
    for mount in (CGROUP_ROOT, CGROUP_ROOT / "unified"):
        found += [mount / rel / "memory.events" for rel in v2 if rel] + [mount / "memory.events"]
    memory = CGROUP_ROOT / "memory"
    found += [memory / rel / "memory.oom_control" for rel in v1 if rel]
    found.append(memory / "memory.oom_control")
    return found


def oom_kills(path: Path | None) -> int | None:
    """The ``oom_kill`` count in ``path`` (either cgroup version's format), or None."""
    if path is None:
        return None
    try:
        text = path.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value)
    return None

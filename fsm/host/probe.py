"""What the runner learns about its host: the GPUs ``nvidia-smi`` reports, and the kernel's
OOM kills counted by the container's memory cgroup.

``HostProbe`` asks the GPUs once (``fsm.host.gpus``), in the background, from the runner's
first step, and judges each answer the moment it comes (``fsm.host.gpus.before_setup``, the one
rule every start-time reading follows). Setup (extras, code, spec) goes on meanwhile:
:meth:`HostProbe.watch` reports a fault the answers show while setup runs, and
:meth:`HostProbe.settle` waits for the verdict before the worker starts. Only what the GPUs
say decides; ``--query-gpu`` unanswered at its bound (``FLASH_GPU_QUERY_S``) is the one
silence that does: the driver is not answering (CONTRACT section 8). The answer's facts
ride in every marker as the ``host`` evidence, so the control plane can stop renting a bad
machine; the whole snapshot is the baseline the host watch and the after-death check
compare with.

``oom_kills`` reads the ``oom_kill`` count of the runner's memory cgroup (cgroup v2
``memory.events``, v1 ``memory.oom_control``): Train reads it before and after the worker,
and a rise means the kernel's OOM killer ended (part of) the worker.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

from fsm.host import gpus
from fsm.host.queries import Asked

#: How long the marker waits for nvidia-smi's answer to carry its facts: evidence, not
#: worth holding the marker for (a slow nvidia-smi is normal).
FACTS_WAIT_S = 2.0
#: The slice of :meth:`HostProbe.settle`'s wait (a signal's handler runs between slices).
SETTLE_SLICE_S = 0.1


class HostFacts(NamedTuple):
    """What ``nvidia-smi`` said. ``problem`` is None when ``--query-gpu`` answered: else
    ``"absent"`` (not on PATH), ``"failed"`` (non-zero exit or unreadable output),
    ``"hung"`` (killed at its bound) or ``"pending"`` (not answered yet)."""

    hostname: str
    #: as ``--query-gpu`` listed them
    gpus: tuple[gpus.Gpu, ...] = ()
    driver: str | None = None
    problem: str | None = None
    #: what went wrong, in words (a failing nvidia-smi's own last line among them)
    detail: str = ""
    #: what names the machine (CONTRACT section 9): ``host_id``
    id: str | None = None

    def evidence(self) -> dict[str, Any] | None:
        """The marker's ``host`` evidence (CONTRACT section 4): None without nvidia-smi."""
        if self.problem == "absent":
            return None
        facts: dict[str, Any] = {
            "id": self.id,
            "hostname": self.hostname,
            "gpus": [{"name": gpu.name or "", "uuid": gpu.uuid or "",
                      "memory_mib": gpu.memory_total_mib} for gpu in self.gpus],
            "driver": self.driver,
        }
        if self.problem is not None:
            facts["error"] = self.detail
        return facts


def query_bound(environ: Mapping[str, str]) -> float:
    """``FLASH_GPU_QUERY_S`` of ``environ`` when usable, else the default: the bound the
    early probe starts with (the payload's value replaces it once read, and an unusable
    one is refused there: ``fsm.context.Tuning``)."""
    try:
        value = float(environ.get("FLASH_GPU_QUERY_S") or gpus.DEFAULT_QUERY_S)
    except ValueError:
        return gpus.DEFAULT_QUERY_S
    return value if math.isfinite(value) and value >= gpus.MIN_QUERY_S else gpus.DEFAULT_QUERY_S


Fault = Callable[[gpus.StartVerdict, gpus.Snapshot], None]


class HostProbe:
    """The GPUs asked once (``fsm.host.gpus``: ``--query-gpu``, ``--query-remapped-rows`` and
    ``--query-compute-apps`` together, each ending on its own) in a daemon thread, started
    at the runner's first step."""

    #: The probe :meth:`start_early` started, until :meth:`for_attempt` takes it.
    _early: ClassVar[HostProbe | None] = None

    def __init__(self, environ: Mapping[str, str], *, asked: Asked | None = None) -> None:
        self.hostname = os.uname().nodename
        self.path = environ.get("PATH") if asked is None else asked.path
        self._pending = gpus.PendingSnapshot(environ, query_bound(environ), asked=asked)
        self._fired = threading.Lock()

    @classmethod
    def start_early(cls, environ: Mapping[str, str], asked: Asked) -> None:
        """Read the queries the runner started among its first instructions
        (``fsm.launch``, ``fsm.host.queries.ask``): their answer overlaps the runner's
        imports and its setup."""
        cls._early = cls(environ, asked=asked)

    @classmethod
    def for_attempt(cls, environ: Mapping[str, str]) -> HostProbe:
        """The probe started early, when it asked with the same PATH; else a new one."""
        early, cls._early = cls._early, None
        if early is not None and early.path == environ.get("PATH"):
            return early
        return cls(environ)

    def limit(self, query_s: float) -> None:
        """Each query's bound: ``query_s`` from the probe's start (``FLASH_GPU_QUERY_S``)."""
        self._pending.limit(query_s)

    def watch(self, expected: int | None, on_fault: Fault) -> None:
        """Call ``on_fault(verdict, snapshot)`` once, the moment the answers report a fault
        (from the probe's thread, or from here when one is in already)."""
        def look() -> None:
            snap = self._pending.partial()
            verdict = gpus.before_setup(snap, expected)
            if verdict.kind is not None and self._fired.acquire(blocking=False):
                on_fault(verdict, snap)

        self._pending.subscribe(look)

    def settle(self, expected: int | None, stopped: Callable[[], bool] = lambda: False
               ) -> tuple[gpus.StartVerdict, gpus.Snapshot]:
        """Wait until the verdict is decided (a fault, or every query ended: at most the
        bound plus the kill grace), in slices; ``stopped()`` ends the wait early (the
        verdict then undecided)."""
        while True:
            snap = self._pending.partial()
            verdict = gpus.before_setup(snap, expected)
            if verdict.decided or stopped():
                return verdict, snap
            self._pending.wait(SETTLE_SLICE_S)

    def facts(self, wait_s: float) -> HostFacts:
        """The answer's facts, waiting at most ``wait_s`` for the whole snapshot; else
        what has answered so far (``pending`` while ``--query-gpu`` has not)."""
        snap = self._pending.result(max(0.0, wait_s))
        return facts_of(self.hostname, snap if snap is not None else self._pending.partial())


def facts_of(hostname: str, snap: gpus.Snapshot) -> HostFacts:
    """A snapshot as the host facts every marker carries."""
    detail = snap.describe_problem() if snap.problem is not None else ""
    driver = next((gpu.driver for gpu in snap.gpus if gpu.driver), None)
    return HostFacts(hostname, snap.gpus, driver, snap.problem, detail,
                     host_id(hostname, snap.gpus))


def boot_id() -> str | None:
    """The kernel's boot id (one per boot, shared by every container of the host), or None."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text(encoding="ascii").strip() or None
    except (OSError, ValueError):
        return None


def host_id(hostname: str, listed: tuple[gpus.Gpu, ...] = ()) -> str:
    """What names the machine (CONTRACT section 9): its GPUs' UUIDs, sorted, when
    ``nvidia-smi`` listed them; else the kernel's boot id with the hostname (a container
    shares its host's boot id; the hostname tells two hosts apart where it is unreadable)."""
    uuids = sorted(gpu.uuid for gpu in listed if gpu.uuid)
    return ",".join(uuids) or f"boot:{boot_id() or 'unknown'}@{hostname}"


# --- the kernel's OOM kills ---------------------------------------------------------------

CGROUP_ROOT = Path("/sys/fs/cgroup")


def memory_events_path(environ: Mapping[str, str]) -> Path | None:
    """The file holding this process's memory cgroup ``oom_kill`` count, or None.
    ``FLASH_MEMORY_EVENTS`` overrides where it is read (unusual mounts, tests)."""
    if override := environ.get("FLASH_MEMORY_EVENTS"):
        return Path(override)
    return next((candidate for candidate in _cgroup_candidates() if candidate.is_file()), None)


def _cgroup_candidates() -> list[Path]:
    """cgroup v2 ``memory.events`` first, then v1 ``memory.oom_control``: in the process's
    own cgroup, then at the mount's root (a container whose cgroup namespace is private
    sees its own cgroup there, while /proc/self/cgroup may name the host's path)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        lines = []
    # hierarchy-id:controllers:path, the controllers empty for v2's one hierarchy
    entries = [parts[1:] for parts in (line.split(":", 2) for line in lines) if len(parts) == 3]
    v2 = [path.lstrip("/") for controllers, path in entries if controllers == ""]
    v1 = [path.lstrip("/") for controllers, path in entries if "memory" in controllers.split(",")]
    # each mount's own cgroup first, then its root ("": the same file again when the own
    # cgroup is the root, which changes nothing: the first that exists is taken)
    found = [mount / rel / "memory.events"
             for mount in (CGROUP_ROOT, CGROUP_ROOT / "unified") for rel in (*v2, "")]
    return found + [CGROUP_ROOT / "memory" / rel / "memory.oom_control" for rel in (*v1, "")]


def oom_kills(path: Path | None) -> int | None:
    """The ``oom_kill`` count in ``path`` (either cgroup version's format), or None."""
    try:
        text = path.read_text() if path is not None else ""
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value)
    return None

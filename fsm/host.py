"""What the runner learns about its host: the GPUs ``nvidia-smi`` reports, and the kernel's
OOM kills counted by the container's memory cgroup.

``HostProbe`` runs ``nvidia-smi`` once, in the background, from LoadPayload: the attempt
never waits on it for more than ``PROBE_S`` (a hung ``nvidia-smi``, the classic sign of a
GPU that fell off the bus, is killed and reported, never waited for). Its facts ride in
every marker as the ``host`` evidence, so the control plane can stop renting a bad machine.

``oom_kills`` reads the ``oom_kill`` count of the runner's memory cgroup (cgroup v2
``memory.events``, v1 ``memory.oom_control``): Train reads it before and after the worker,
and a rise means the kernel's OOM killer ended (part of) the worker.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

#: The longest the attempt waits for ``nvidia-smi``; then it is killed and called hung.
PROBE_S = 2.0
QUERY = ("--query-gpu=name,uuid,memory.total,driver_version", "--format=csv,noheader,nounits")
#: A failing ``nvidia-smi``'s message is its last output line, at most this long.
MESSAGE_CHARS = 300
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
    """``nvidia-smi`` started at once in a daemon thread; ``facts(wait_s)`` waits at most
    ``wait_s`` (and never past ``PROBE_S`` after the start) for its answer."""

    def __init__(self, environ: Mapping[str, str], *, timeout_s: float = PROBE_S) -> None:
        self._hostname = os.uname().nodename
        self._timeout_s = timeout_s
        self._started = time.monotonic()
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._facts = HostFacts(self._hostname, problem="hung")  # until it answers
        exe = shutil.which("nvidia-smi", path=environ.get("PATH", os.defpath))
        if exe is None:
            self._settle(HostFacts(self._hostname, problem="absent"))
            return
        env = {k: v for k, v in environ.items() if k in ("PATH", "LANG", "LC_ALL", "HOME")}
        threading.Thread(
            target=self._run, args=(exe, env), name="host-probe", daemon=True
        ).start()

    def facts(self, wait_s: float) -> HostFacts | None:
        """The answer, waiting at most ``wait_s`` for it: ``hung`` once ``nvidia-smi`` has
        had its time, None while it still may answer."""
        left = self._started + self._timeout_s - time.monotonic()
        if self._done.wait(max(0.0, min(wait_s, left))):
            return self._facts
        if wait_s < left:
            return None
        # Its time is up: hung, for good (an answer arriving later does not change what
        # was already reported).
        self._settle(HostFacts(self._hostname, problem="hung"))
        return self._facts

    def _settle(self, facts: HostFacts) -> None:
        with self._lock:
            if not self._done.is_set():
                self._facts = facts
                self._done.set()

    def _run(self, exe: str, env: dict[str, str]) -> None:
        try:
            proc = subprocess.Popen(
                [exe, *QUERY], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, env=env, start_new_session=True,
            )
        except OSError as exc:
            self._settle(self._failed(f"could not start ({exc.strerror or exc})"))
            return
        try:
            out, err = proc.communicate(timeout=self._timeout_s)
        except subprocess.TimeoutExpired:
            self._settle(HostFacts(self._hostname, problem="hung"))
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()  # may never return (a process stuck in the driver): a daemon thread
            return
        text = out.decode("utf-8", "replace")
        if proc.returncode != 0:
            # Its message may be on either stream (a driver warning on stderr is no failure
            # of a run that exits 0: the rows are on stdout).
            said = _last_line(err.decode("utf-8", "replace") + "\n" + text)
            self._settle(self._failed(f"exit {proc.returncode}: {said}"))
            return
        self._settle(_parse(self._hostname, text))

    def _failed(self, detail: str) -> HostFacts:
        return HostFacts(self._hostname, problem="failed", detail=detail[:MESSAGE_CHARS])


def _parse(hostname: str, text: str) -> HostFacts:
    gpus: list[Gpu] = []
    drivers: list[str] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = [f.strip() for f in line.rsplit(",", 3)]
        if len(fields) != 4:
            return HostFacts(
                hostname, problem="failed", detail=f"unreadable output: {line[:MESSAGE_CHARS]}"
            )
        name, uuid, memory, driver = fields
        gpus.append(Gpu(name, uuid, int(memory) if memory.isdigit() else None))
        drivers.append(driver)
    return HostFacts(hostname, tuple(gpus), drivers[0] if drivers else None)


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


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

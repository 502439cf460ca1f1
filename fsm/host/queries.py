"""What the runner asks ``nvidia-smi``, and starting the asking.

On a big host ``nvidia-smi`` can take 30 s to answer (Azure/aks-gpu#105), and no worker
starts before it has: its answer is the longest wait before the worker. So ``flash-bootstrap
run`` starts the three queries among its first instructions (:func:`ask`, from
``fsm.launch``), before it imports anything it does not need to start a process, and
``fsm.host.gpus`` reads their answers later (``PendingSnapshot(asked=...)``). Standard library
only, and the cheap part of it: no ``shutil`` (its compression imports cost milliseconds),
so the executable is looked up here.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Mapping

FORMAT = "--format=csv,noheader,nounits"
#: The health fields of :data:`GPU_FIELDS`: one that nvidia-smi refuses (``Field "..." is
#: not a valid field to query.``, a driver that renamed or dropped it) is dropped and the
#: GPUs are asked again (its value unknown).
GPU_HEALTH_FIELDS = ("ecc.errors.uncorrected.volatile.total", "retired_pages.pending")
#: ``name`` last: a row is split into at most this many fields, so a comma in a product
#: name cannot shift the others.
GPU_FIELDS = ("index", "uuid", "pci.bus_id", "memory.total", "memory.used", "driver_version",
              *GPU_HEALTH_FIELDS, "name")
#: Never dropped when nvidia-smi refuses a field of :data:`GPU_FIELDS`.
GPU_BASE_FIELDS = tuple(field for field in GPU_FIELDS if field not in GPU_HEALTH_FIELDS)
REMAP_FIELDS = (
    "gpu_uuid",
    "gpu_bus_id",
    "remapped_rows.correctable",
    "remapped_rows.uncorrectable",
    "remapped_rows.pending",
    "remapped_rows.failure",
)
#: ``process_name`` last, for the same reason as ``name`` above (a path may hold a comma).
#: ``used_gpu_memory`` is the name ``used_memory`` is an alias of.
APP_FIELDS = ("gpu_uuid", "pid", "used_gpu_memory", "process_name")
QUERIES: dict[str, tuple[str, ...]] = {
    "gpu": (f"--query-gpu={','.join(GPU_FIELDS)}", FORMAT),
    "remapped-rows": (f"--query-remapped-rows={','.join(REMAP_FIELDS)}", FORMAT),
    "compute-apps": (f"--query-compute-apps={','.join(APP_FIELDS)}", FORMAT),
}
#: What of the runner's environment nvidia-smi gets.
ENV_KEYS = ("PATH", "LANG", "LC_ALL", "HOME")


def find(path: str | None) -> str | None:
    """``nvidia-smi``'s path on ``path`` (a PATH value; the default path when None), as
    ``shutil.which`` finds it: the first executable file of that name (none on an empty
    PATH; an empty entry is the working directory)."""
    if path == "":
        return None
    for folder in (path if path is not None else os.defpath).split(os.pathsep):
        candidate = os.path.join(folder or os.curdir, "nvidia-smi")
        if os.access(candidate, os.X_OK) and not os.path.isdir(candidate):
            return candidate
    return None


class Asked:
    """The queries started (monotonic ``started``): ``exe`` None when there is no
    nvidia-smi on ``path``; each query's process, or why it could not be started. (A plain
    class: ``dataclasses`` imports ``inspect``, milliseconds before the first query.)"""

    def __init__(self, path: str | None, exe: str | None, env: dict[str, str]) -> None:
        self.path = path
        self.exe = exe
        self.env = env
        self.started = time.monotonic()
        self.procs: dict[str, subprocess.Popen[bytes] | OSError] = {}

    def fds(self) -> list[int]:
        """The runner's ends of the queries' pipes (a process forked now must close them)."""
        return [stream.fileno() for proc in self.procs.values()
                if not isinstance(proc, OSError)
                for stream in (proc.stdout, proc.stderr) if stream is not None]


def ask(environ: Mapping[str, str]) -> Asked:
    """Start every query of :data:`QUERIES` at once, each in a session of its own (its group
    is killed at its bound); never raises for what the OS says."""
    path = environ.get("PATH")
    asked = Asked(path, find(path), {k: v for k, v in environ.items() if k in ENV_KEYS})
    if asked.exe is not None:
        for name, args in QUERIES.items():
            try:
                asked.procs[name] = subprocess.Popen(
                    [asked.exe, *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, env=asked.env, start_new_session=True)
            except OSError as exc:
                asked.procs[name] = exc
    return asked

"""The window before the runner has a SIGTERM handler: how long after exec it stays open.

As PID 1 of a container the kernel drops a signal that has no handler; behind an init the
default action kills the process with no marker. Either way the window is the time from
exec until ``fsm.interrupt.install_early`` ran. Measured here from outside: the runner is
started (as PID 1 of a fresh PID namespace where ``unshare`` allows it) and its
``/proc/<pid>/status`` ``SigCgt`` mask is polled in a tight loop until SIGTERM's bit is set.

    python benchmarks/bench_signal_window.py [--runs 20] [--entry module|script] [--tree DIR]...

``--entry script`` starts the installed ``flash-bootstrap`` console script (the image's
ENTRYPOINT), ``module`` starts ``python -m fsm``. Run it from a directory outside the
repository, with ``PYTHONDONTWRITEBYTECODE`` unset (byte-compiled imports, as in the image).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIGTERM_BIT = 1 << (signal.SIGTERM - 1)


def _caught(pid: int) -> bool | None:
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"SigCgt:"):
                    return bool(int(line.split()[1], 16) & SIGTERM_BIT)
    except OSError:
        return None
    return None


def _inner(pid: int, until: float) -> int | None:
    """The process that runs the runner: ``pid`` itself, or unshare's one child."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    while time.monotonic() < until:
        try:
            children = path.read_text().split()
        except OSError:
            return None
        if children:
            return int(children[0])
        time.sleep(0.0002)
    return None


def once(argv: list[str], pid1: bool, env: dict[str, str]) -> float | None:
    start = time.monotonic()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=env)
    try:
        pid = _inner(proc.pid, start + 5) if pid1 else proc.pid
        if pid is None:
            return None
        while time.monotonic() < start + 5:
            if _caught(pid):
                return time.monotonic() - start
            time.sleep(0.0002)  # a measurement's resolution, not a synchronisation: spare a core
        return None
    finally:
        proc.kill()
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--entry", choices=["module", "script"], default="module")
    parser.add_argument("--tree", action="append", default=[], metavar="DIR",
                        help="a source tree to measure (PYTHONPATH); repeat to compare trees")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="window-"))
    payload = root / "payload.json"
    payload.write_text("{}")  # unusable: the runner exits 2 soon after its handler is up
    runner = ([shutil.which("flash-bootstrap") or "flash-bootstrap"] if args.entry == "script"
              else [sys.executable, "-m", "fsm"])
    unshare = shutil.which("unshare")
    pid1 = unshare is not None and subprocess.run(
        [unshare, "--pid", "--fork", "true"], capture_output=True, check=False).returncode == 0
    front = [unshare, "--pid", "--fork"] if pid1 and unshare is not None else []
    # A baseline: the interpreter alone, to the first Python handler it can have.
    commands: dict[str, tuple[list[str], dict[str, str]]] = {
        "interpreter alone": ([*front, sys.executable, "-c",
                               "import signal,time; signal.signal(15, print); time.sleep(5)"],
                              dict(os.environ)),
    }
    for tree in args.tree or [""]:
        env = dict(os.environ)
        if tree:
            env["PYTHONPATH"] = tree
        commands[f"runner {tree}".strip()] = (
            [*front, *runner, "run", "--payload", str(payload), "--scratch-dir", str(root)], env)
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(args.runs):  # interleaved: the machine's load weighs on each alike
        for name, (argv, env) in commands.items():
            if (t := once(argv, pid1, env)) is not None:
                times[name].append(t)
    results = {
        name: {"runs": len(ts), "median_ms": round(statistics.median(ts) * 1000, 1),
               "min_ms": round(min(ts) * 1000, 1)}
        for name, ts in times.items() if ts
    }
    print(json.dumps({"pid1": pid1, "entry": args.entry, **results}, indent=2))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

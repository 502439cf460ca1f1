"""The host watch's CPU share while a worker trains (issue 24: goal under 1 % of a core).

    python benchmarks/bench_gpu_watch.py [--window 30] [--rounds 2] [--watch 5]

The runner supervises a worker that only sleeps, on a host of 8 healthy H100s answered by
the fake ``nvidia-smi`` (``fsm.testing.nvidia_smi``), with ``FLASH_HOST_WATCH_S`` at
``--watch`` seconds and with the watch off, interleaved round by round. Over a window of
``--window`` seconds while the worker runs, the CPU time of the runner's own process (every
thread: ``utime + stime`` of ``/proc/<pid>/stat``) and of the children it reaped
(``cutime + cstime``: the nvidia-smi calls; the worker is still running and not counted)
are read at the window's two ends.

runner share = runner CPU / window; the watch's share is the difference between the watch
on and off. The fake is a Python process per call, far more CPU than the real tool's
binary: its share is printed apart and is not the runner's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fsm.testing.nvidia_smi import FakeHost, FakeNvidiaSmi

WORKER = """
import sys, time
print("ready", flush=True)
time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else {hold})
"""
TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> tuple[float, float]:
    """(own, reaped children's) CPU seconds of ``pid``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    utime, stime, cutime, cstime = (int(fields[i]) for i in (11, 12, 13, 14))
    return (utime + stime) / TICK, (cutime + cstime) / TICK


def _one(root: Path, env: dict[str, str], window_s: float) -> tuple[float, float]:
    (root / "flash" / ".flash-instance_attempt0.result.json").unlink(missing_ok=True)
    (root / "flash" / ".flash-instance_attempt0.start.json").unlink(missing_ok=True)
    argv = [sys.executable, "-m", "fsm", "run", "--payload", str(root / "flash" / "payload.json"),
            "--store", (root / "store").as_uri(), "--code-root", str(root / "runcode"),
            "--scratch-dir", str(root / "scratch")]
    proc = subprocess.Popen(argv, cwd=root, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert b"ready" in line, line
    time.sleep(1.0)  # past the worker's start: the window is steady supervision
    own0, kids0 = _cpu_s(proc.pid)
    t0 = time.monotonic()
    time.sleep(window_s)
    own1, kids1 = _cpu_s(proc.pid)
    elapsed = time.monotonic() - t0
    proc.kill()
    proc.wait()
    return (own1 - own0) / elapsed, (kids1 - kids0) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--window", type=float, default=30.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--watch", type=float, default=5.0)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-gpu-watch-"))
    worker = root / "store" / "code" / "flash" / "engine" / "worker"
    worker.mkdir(parents=True)
    (worker / "__main__.py").write_text(WORKER.format(hold=args.window + 30))
    for sub in ("scratch", "runcode", "flash"):
        (root / sub).mkdir()
    with FakeNvidiaSmi(root / "smi", FakeHost.h100s(8)) as fake:
        base = {**os.environ, **fake.env(), "FLASH_STALL_S": "0",
                "FLASH_CONSOLE_UPLOAD_INTERVAL_S": "0"}
        configs = {f"watch_{args.watch:g}s": {**base, "FLASH_HOST_WATCH_S": f"{args.watch:g}"},
                   "watch_off": {**base, "FLASH_HOST_WATCH_S": "0"}}
        (root / "flash" / "payload.json").write_text(json.dumps({
            "hf_repo": "org/runs", "hf_prefix": "bench/w/0", "phase": "sft", "seed": 0,
            "job_spec_json": "{}", "max_wall_s": args.window + 120,
        }))
        shares: dict[str, list[tuple[float, float]]] = {name: [] for name in configs}
        for _ in range(args.rounds):
            for name, env in configs.items():
                shares[name].append(_one(root, env, args.window))
    result: dict[str, float | int] = {}
    for name, values in shares.items():
        result[f"runner_cpu_pct[{name}]"] = round(
            statistics.median(v[0] for v in values) * 100, 3)
        result[f"nvidia_smi_cpu_pct[{name}]"] = round(
            statistics.median(v[1] for v in values) * 100, 3)
    on, off = (f"runner_cpu_pct[watch_{args.watch:g}s]", "runner_cpu_pct[watch_off]")
    result["watch_cpu_pct_of_a_core"] = round(float(result[on]) - float(result[off]), 3)
    result.update(window_s=args.window, rounds=args.rounds)
    for key, value in result.items():
        print(f"{key:40} {value}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()

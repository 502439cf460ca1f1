"""The whole runner, stopped two ways, as a real ``flash-bootstrap run`` process:

* SIGTERM: from the signal to the marker written and the runner exited, with a worker
  that obeys SIGTERM (target: under 2 s);
* deadline: from the worker's deadline (``FLASH_RUN_DEADLINE_AT``) to the last process
  of its group gone, and to the marker written, with a worker (and a grandchild) that
  ignore SIGTERM and a 1 s grace (target: both under grace + 2 s).

    python benchmarks/bench_runner_stop.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OBEYS = """
import os, time
print("ready", os.environ["FLASH_RUN_DEADLINE_AT"], flush=True)
time.sleep(600)
"""

IGNORES = """
import os, signal, subprocess, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
print("ready", os.environ["FLASH_RUN_DEADLINE_AT"], os.getpid(), child.pid, flush=True)
signal.pause()
"""


def _layout(worker: str, payload: dict[str, object]) -> tuple[Path, list[str]]:
    root = Path(tempfile.mkdtemp(prefix="bench-stop-"))
    code = root / "store" / "code" / "flash" / "engine" / "worker"
    code.mkdir(parents=True)
    (code / "__main__.py").write_text(worker)
    for sub in ("scratch", "runcode", "flash"):
        (root / sub).mkdir()
    base = {"hf_repo": "org/runs", "hf_prefix": "bench/r/0", "phase": "sft", "seed": 0,
            "job_spec_json": "{}", "env": {"FLASH_STOP_GRACE_S": "1"}}
    (root / "flash" / "payload.json").write_text(json.dumps({**base, **payload}))
    argv = [sys.executable, "-m", "fsm", "run", "--payload", str(root / "flash" / "payload.json"),
            "--store", (root / "store").as_uri(), "--code-root", str(root / "runcode"),
            "--scratch-dir", str(root / "scratch")]
    return root, argv


def _ready_line(proc: subprocess.Popen[bytes]) -> list[str]:
    assert proc.stdout is not None
    buf = b""
    while b"\n" not in buf:
        select.select([proc.stdout], [], [], 30)
        chunk = os.read(proc.stdout.fileno(), 4096)
        assert chunk, "runner ended before the worker was ready"
        buf += chunk
    return buf.split(b"\n", 1)[0].decode().split()


def _marker(root: Path) -> Path:
    return root / "store" / "bench" / "r" / "0" / "instance_attempt0.json"


def _watch(root: Path, pids: list[int], proc: subprocess.Popen[bytes]) -> dict[str, float]:
    """Wall-clock times at which the marker appeared, the pids were gone, the runner exited."""
    seen: dict[str, float] = {}
    fds = {os.pidfd_open(pid): pid for pid in pids if _alive(pid)}
    while len(seen) < 3:
        now = time.time()
        if "marker" not in seen and _marker(root).exists():
            seen["marker"] = now
        if "gone" not in seen:
            ready, _, _ = select.select(list(fds), [], [], 0)
            for fd in ready:
                os.close(fd)
                del fds[fd]
            if not fds:
                seen["gone"] = now
        if "exited" not in seen and proc.poll() is not None:
            seen["exited"] = now
        select.select([], [], [], 0.002)  # a 2 ms tick: this is the measuring instrument
    return seen


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def sigterm_round() -> dict[str, float]:
    root, argv = _layout(OBEYS, {})
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    _ready_line(proc)
    sent = time.time()
    proc.send_signal(signal.SIGTERM)
    seen = _watch(root, [], proc)
    record = json.loads(_marker(root).read_text())
    assert record["rule"] == "interrupted", record
    return {"to_marker_s": seen["marker"] - sent, "to_exit_s": seen["exited"] - sent}


def deadline_round() -> dict[str, float]:
    root, argv = _layout(IGNORES, {"max_wall_s": 6, "env": {"FLASH_STOP_GRACE_S": "1",
                                                           "FLASH_EXIT_RESERVE_S": "3"}})
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    _, deadline, *pids = _ready_line(proc)
    seen = _watch(root, [int(p) for p in pids], proc)
    record = json.loads(_marker(root).read_text())
    assert record["rule"] == "deadline", record
    at = float(deadline)
    return {"group_gone_after_deadline_s": seen["gone"] - at,
            "marker_after_deadline_s": seen["marker"] - at}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rounds: list[dict[str, float]] = []
    for _ in range(args.rounds):
        rounds.append({**sigterm_round(), **deadline_round()})
    medians = {k: round(statistics.median(r[k] for r in rounds), 3) for k in rounds[0]}
    print("grace 1 s; medians over", args.rounds, "rounds")
    for key, value in medians.items():
        print(f"  {key:32} {value:.3f} s")
    print(json.dumps({"rounds": args.rounds, **medians}))


if __name__ == "__main__":
    main()

"""Two bounds of the marker's truth, measured on ``flash-bootstrap run`` as a real process
against the project's local Hub server (loopback):

* ``sigterm_hung_commits``: the Hub hangs every commit; from SIGTERM to the runner's exit
  (it cannot land the marker, so it persists the result and exits 3). Bound: 10 s, Docker's
  default stop timeout.
* ``linger``: a preload whose Hub hangs every download, so huggingface_hub's non-daemon
  download threads are still blocked when the deadline marker lands; from the marker
  commit's answer to the process gone. Bound: 2 s.

    python benchmarks/bench_marker_truth.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from fsm.testing import LocalHubServer

REPO = "org/runs"
PREFIX = "bench/r/0"
TOKEN = "hf_bench_token_0123456789"
WORKER = """
import time
print("ready", flush=True)
time.sleep(600)
"""


def _runner(root: Path, hub: LocalHubServer, payload: dict[str, object]) -> list[str]:
    for sub in ("scratch", "runcode", "flash"):
        (root / sub).mkdir(exist_ok=True)
    base = {"hf_repo": REPO, "hf_prefix": PREFIX, "phase": "sft", "seed": 0,
            "job_spec_json": "{}", "env": {"HF_TOKEN": TOKEN, "FLASH_STOP_GRACE_S": "1"}}
    (root / "flash" / "payload.json").write_text(json.dumps({**base, **payload}))
    return [sys.executable, "-m", "fsm", "run", "--payload", str(root / "flash" / "payload.json"),
            "--store", hub.url, "--code-root", str(root / "runcode"),
            "--scratch-dir", str(root / "scratch")]


def _env(root: Path) -> dict[str, str]:
    return {**os.environ, "HF_HOME": str(root / "hf-home"), "HF_HUB_DISABLE_TELEMETRY": "1"}


def sigterm_hung_commits() -> float:
    with tempfile.TemporaryDirectory(prefix="bench-truth-") as tmp, \
            LocalHubServer(Path(tmp) / "hub", token=TOKEN) as hub:
        root = Path(tmp)
        hub.create_repo(REPO)
        hub.add_file(REPO, "code/flash/engine/worker/__main__.py", WORKER)
        proc = subprocess.Popen(_runner(root, hub, {}), env=_env(root),
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith(b"ready")
        hub.hang("POST", r"/commit/", seconds=60, times=1000)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
        elapsed = time.monotonic() - sent
        assert code == 3, code
        hub.clear_faults()
        return elapsed


def linger() -> float:
    with tempfile.TemporaryDirectory(prefix="bench-truth-") as tmp, \
            LocalHubServer(Path(tmp) / "hub", token=TOKEN) as hub:
        root = Path(tmp)
        hub.create_repo(REPO)
        for name in ("config.json", "a.safetensors", "b.safetensors", "c.safetensors"):
            hub.add_file("org/m", name, b"x" * 1024, "model")
        hub.hang("GET", r"/resolve/", seconds=120, times=1000)
        (root / "mnt").mkdir()
        argv = _runner(root, hub, {
            "mode": "preload", "models": ["org/m"], "max_wall_s": 3,
            "env": {"HF_TOKEN": TOKEN, "HF_HOME": str(root / "mnt" / "hf")},
        })
        proc = subprocess.Popen(argv, env=_env(root), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        gone: list[float] = []
        waiter = threading.Thread(target=lambda: (proc.wait(120), gone.append(time.monotonic())))
        waiter.start()
        waiter.join(120)
        assert proc.returncode == 124, proc.returncode
        commits = [r for r in hub.requests
                   if r.method == "POST" and "/commit/" in r.path and r.status == 200]
        assert commits and commits[-1].ended_at is not None
        hub.clear_faults()
        return gone[0] - commits[-1].ended_at


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    figures: dict[str, list[float]] = {"sigterm_to_exit_hung_commits_s": [],
                                       "marker_to_process_gone_linger_s": []}
    for _ in range(args.rounds):
        figures["sigterm_to_exit_hung_commits_s"].append(sigterm_hung_commits())
        figures["marker_to_process_gone_linger_s"].append(linger())
    print(f"medians (min-max) over {args.rounds} rounds")
    for key, values in figures.items():
        print(f"  {key:34} {statistics.median(values):.3f} s"
              f" ({min(values):.3f}-{max(values):.3f})")
    print(json.dumps({k: round(statistics.median(v), 3) for k, v in figures.items()}))


if __name__ == "__main__":
    main()

"""The marker's truth at the end of an attempt, measured on ``flash-bootstrap run`` as a
real process against the project's local Hub server (loopback), with the store's default
60 s call timeout:

* the end-of-attempt matrix: *when* the end comes (``deadline``: the worker completes and
  runs to a second before its deadline on an 8 s budget; ``sigterm``: SIGTERM while the
  worker runs, having completed for the listing rows and not for the commit rows;
  ``replay``: a restart publishing a result the store refused before) by *what hangs*
  (``none``; ``listing``: the verification's listing, once; ``commit``: the marker's
  commit, once; ``every-commit``). Each cell reports the exit status, whether the marker
  landed, the marker's rule, how many commits were tried, and the seconds from the end's
  trigger (the attempt deadline, the signal, the replay's start) to the process gone.
  The deadline rows must land the marker unless every commit hangs; the sigterm rows
  must end within Docker's 10 s stop timeout.
* ``linger``: a preload whose Hub hangs every download, so huggingface_hub's non-daemon
  download threads are still blocked when the deadline marker lands; from the marker
  commit's answer to the process gone. Bound: 2 s.

    python benchmarks/bench_marker_truth.py [--rounds 3] [--tree DIR] [--only deadline,sigterm]

``--tree DIR`` runs the runner from another checkout (``git worktree add /tmp/before
<rev>``) against this one's server: the "before" figures. The runner runs in its attempt's
own directory, so ``python -m fsm`` never picks up the checkout it was started from.
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
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from fsm.testing import LocalHubServer

REPO = "org/runs"
PREFIX = "bench/r/0"
TOKEN = "hf_bench_token_0123456789"
VERIFY_LISTING = r"/tree/main/bench"
COMMIT = r"/commit/"
WHEN = ("deadline", "sigterm", "replay")
HANGS = ("none", "listing", "commit", "every-commit")

#: The worker side: uploads metrics.json then DONE through huggingface_hub when it is to
#: complete, says "ready", then waits for the bench's "go" and does what its mode says.
WORKER = """
import json, os, sys, time
from pathlib import Path
from huggingface_hub import HfApi

MODE = os.environ["BENCH_MODE"]
SCRATCH = Path(os.environ["FLASH_SCRATCH_DIR"])
if MODE.startswith("complete"):
    api = HfApi(endpoint=os.environ["HF_ENDPOINT"], token=os.environ["HF_TOKEN"])
    for name, text in (("metrics.json", "{}"), ("DONE", str(time.time()))):
        (SCRATCH / name).write_text(text)
        api.upload_file(path_or_fileobj=str(SCRATCH / name), path_in_repo=f"bench/r/0/{name}",
                        repo_id="org/runs", repo_type="dataset")
print("ready", flush=True)
while not (SCRATCH / "go").exists():
    time.sleep(0.02)
if MODE == "complete-then-deadline":
    time.sleep(max(0.0, float(os.environ["FLASH_RUN_DEADLINE_AT"]) - time.time() - 1.0))
elif MODE != "complete-then-exit":
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


def _env(root: Path, tree: Path | None) -> dict[str, str]:
    env = {**os.environ, "HF_HOME": str(root / "hf-home"), "HF_HUB_DISABLE_TELEMETRY": "1"}
    if tree is not None:
        env["PYTHONPATH"] = str(tree)  # ahead of the installed (editable) runner
    return env


def _read_until(proc: subprocess.Popen[bytes], needle: bytes, timeout: float = 60) -> None:
    assert proc.stdout is not None
    seen, end = b"", time.monotonic() + timeout
    while needle not in seen:
        assert time.monotonic() < end and proc.poll() is None, seen[-400:]
        seen += os.read(proc.stdout.fileno(), 4096)


def _hang(hub: LocalHubServer, what: str) -> None:
    if what == "listing":
        hub.hang("GET", VERIFY_LISTING, seconds=300, times=1)
    elif what == "commit":
        hub.hang("POST", COMMIT, seconds=300, times=1)
    elif what == "every-commit":
        hub.hang("POST", COMMIT, seconds=300, times=10_000)


@dataclass
class Cell:
    exit_code: int
    landed: bool
    rule: str | None
    commits_tried: int
    seconds: float  # from the end's trigger to the process gone


def run_cell(when: str, hang: str, tree: Path | None) -> Cell:
    with tempfile.TemporaryDirectory(prefix="bench-truth-") as tmp, \
            LocalHubServer(Path(tmp) / "hub", token=TOKEN) as hub:
        root = Path(tmp)
        hub.create_repo(REPO)
        hub.add_file(REPO, "code/flash/engine/worker/__main__.py", WORKER)
        mode = {"deadline": "complete-then-deadline", "replay": "complete-then-exit"}.get(
            when, "complete-then-wait" if hang == "listing" else "wait")
        payload: dict[str, object] = {"env": {"HF_TOKEN": TOKEN, "FLASH_STOP_GRACE_S": "1",
                                              "BENCH_MODE": mode}}
        if when == "deadline":
            payload["max_wall_s"] = 8
        argv, env = _runner(root, hub, payload), _env(root, tree)
        started = time.monotonic()
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, cwd=root)
        _read_until(proc, b"ready")
        before = len([r for r in hub.requests if r.method == "POST" and "/commit/" in r.path])
        if when == "replay":  # the first runner's marker is refused: decided, persisted
            hub.fail("POST", COMMIT, status=403, times=10_000)
            (root / "scratch" / "go").write_text("")
            proc.wait(60)
            hub.clear_faults()
            _hang(hub, hang)
            before = len([r for r in hub.requests if r.method == "POST" and "/commit/" in r.path])
            trigger = time.monotonic()
            proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, cwd=root)
        elif when == "sigterm":
            _hang(hub, hang)
            trigger = time.monotonic()
            proc.send_signal(signal.SIGTERM)
        else:
            _hang(hub, hang)
            (root / "scratch" / "go").write_text("")
            trigger = started + 8
        code = proc.wait(120)
        gone = time.monotonic()
        marker_path = hub.repo_dir(REPO) / PREFIX / "instance_attempt0.json"
        landed = marker_path.is_file()
        rule = json.loads(marker_path.read_text()).get("rule") if landed else None
        commits = [r for r in hub.requests if r.method == "POST" and "/commit/" in r.path]
        hub.clear_faults()
        return Cell(code, landed, rule, len(commits) - before, gone - trigger)


def linger(tree: Path | None) -> float:
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
        proc = subprocess.Popen(argv, env=_env(root, tree), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, cwd=root)
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
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tree", type=Path, help="run the runner from this checkout")
    parser.add_argument("--only", default=",".join(WHEN),
                        help=f"which rows of the matrix ({', '.join(WHEN)})")
    args = parser.parse_args()
    rows = [w for w in args.only.split(",") if w]
    print(f"end-of-attempt matrix, medians over {args.rounds} rounds"
          + (f" (runner from {args.tree})" if args.tree else ""))
    print(f"  {'when':9} {'hang':13} {'exit':>5} {'landed':>7} {'rule':22} {'commits':>8}"
          f" {'seconds (min-max)':>20}")
    results: dict[str, object] = {}
    for when in rows:
        for hang in HANGS:
            cells = [run_cell(when, hang, args.tree) for _ in range(args.rounds)]
            codes = Counter(c.exit_code for c in cells).most_common(1)[0][0]
            landed = sum(c.landed for c in cells)
            rules = Counter(str(c.rule) for c in cells).most_common(1)[0][0]
            tried = statistics.median(c.commits_tried for c in cells)
            secs = [c.seconds for c in cells]
            print(f"  {when:9} {hang:13} {codes:>5} {landed:>4}/{len(cells):<2} {rules:22}"
                  f" {tried:>8g} {statistics.median(secs):>8.2f} ({min(secs):.2f}-{max(secs):.2f})")
            results[f"{when}/{hang}"] = {
                "exit": codes, "landed": f"{landed}/{len(cells)}", "rule": rules,
                "seconds": round(statistics.median(secs), 2)}
    figures = [linger(args.tree) for _ in range(args.rounds)]
    print(f"  marker to process gone, lingering download threads: "
          f"{statistics.median(figures):.3f} s ({min(figures):.3f}-{max(figures):.3f})")
    results["linger_s"] = round(statistics.median(figures), 3)
    print(json.dumps(results))


if __name__ == "__main__":
    main()

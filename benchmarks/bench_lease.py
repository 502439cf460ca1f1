"""The lease (issue 40): how soon a dead runner reads lost, and what the lease costs.

    python benchmarks/bench_lease.py [--runners 4] [--lease-s 30] [--read-s 5]

Against one local Hub server (the store's clock is the server's commit dates), with other
runs' commits landing every ``--activity-s`` seconds (a fleet sharing the repo):

* ``--runners`` real runners (``FLASH_LEASE_S=--lease-s``, console tails every 5 s) each
  run a worker that prints a line every 0.2 s. Once runner k's lease has been renewed, it
  dies ``k / runners`` of a period after that renewal (SIGKILL to the runner, SIGSTOP to
  its worker's group: a host that hung), so the deaths fall at every phase of the period.
  A poller (``fsm.attempts.read_attempt``, one reading every ``--read-s``) times each
  death to the first reading that says ``lost``. Goal: at most ``ttl_s`` + one read.
* One more runner lives: its readings must never say lost. After ``--live-s`` seconds it
  completes; its marker's ``lease`` evidence says how many renewals landed and how many a
  console tail carried: the lease's commits of its own are its first write plus the
  renewals no tail carried (goal: 0 of the latter while tails flow).
"""

from __future__ import annotations

import argparse
import contextlib
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

from fsm.attempt.lease import TTL_PERIODS, lease_name
from fsm.attempts import read_attempt
from fsm.clock import Deadline
from fsm.store.hub import HubStore
from fsm.testing import LocalHubServer

TOKEN = "hf_bench_lease_token_0123456789"
REPO = "org/lease-runs"
ARM = "lambda"
WORKER = """
import os, sys, time
from pathlib import Path
scratch = Path(os.environ["FLASH_SCRATCH_DIR"])
(scratch / "worker.pid").write_text(str(os.getpid()))
i = 0
while not (scratch / "go").exists():
    print(f"step {i}", flush=True)
    i += 1
    time.sleep(0.2)
sys.exit(1)
"""


def start(root: Path, hub: LocalHubServer, n: int, lease_s: float) -> subprocess.Popen[bytes]:
    run = root / f"runner{n}"
    for sub in ("scratch", "runcode", "flash", "hf-home"):
        (run / sub).mkdir(parents=True)
    prefix = f"sft/run-{n}/seed0"
    payload = {
        "hf_repo": REPO, "hf_prefix": prefix, "phase": "sft", "seed": 0, "flash_arm": ARM,
        "attempt": 0, "run_id": f"run-{n}", "max_wall_s": 3600,
        "job_spec_json": json.dumps({"hf_prefix": prefix}),
        "env": {"HF_TOKEN": TOKEN, "FLASH_STOP_GRACE_S": "2", "FLASH_UPLOAD_CONSOLE": "1",
                "FLASH_CONSOLE_UPLOAD_INTERVAL_S": "5", "FLASH_LEASE_S": f"{lease_s:g}"},
    }
    (run / "flash" / "payload.json").write_text(json.dumps(payload))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "FLASH_"))}
    env["HF_HOME"] = str(run / "hf-home")
    return subprocess.Popen(
        [sys.executable, "-m", "fsm", "run", "--payload", str(run / "flash/payload.json"),
         "--store", hub.url, "--code-root", str(run / "runcode"),
         "--scratch-dir", str(run / "scratch")],
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=(run / "stderr.txt").open("wb"), start_new_session=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runners", type=int, default=4)
    parser.add_argument("--lease-s", type=float, default=30.0)
    parser.add_argument("--read-s", type=float, default=5.0)
    parser.add_argument("--activity-s", type=float, default=5.0)
    parser.add_argument("--live-s", type=float, default=150.0)
    args = parser.parse_args()
    ttl = TTL_PERIODS * args.lease_s
    root = Path(tempfile.mkdtemp(prefix="bench-lease-"))
    procs: dict[int, subprocess.Popen[bytes]] = {}
    stop = threading.Event()
    with LocalHubServer(root / "hub", token=TOKEN) as hub:
        hub.create_repo(REPO)
        hub.add_file(REPO, "code/flash/engine/worker/__main__.py", WORKER)

        def activity() -> None:  # other runs' commits: the channel works
            k = 0
            while not stop.wait(args.activity_s):
                hub.add_file(REPO, f"other/run/console_{k % 3}.txt", f"tick {k}")
                k += 1

        threading.Thread(target=activity, daemon=True).start()
        live = args.runners
        for n in range(args.runners + 1):
            procs[n] = start(root, hub, n, args.lease_s)
        lease = {n: hub.repo_dir(REPO) / f"sft/run-{n}/seed0" / lease_name(ARM, 0)
                 for n in procs}
        died: dict[int, float] = {}
        lost_at: dict[int, float] = {}
        live_views: dict[str, int] = {}
        live_whys: set[str] = set()  # why a reading of the live runner said other than running
        renewed: dict[int, float] = {}
        began = time.monotonic()
        next_read = time.time()
        try:
            while len(lost_at) < args.runners and time.monotonic() - began < ttl * 4 + 300:
                now = time.time()
                for n in range(args.runners):
                    if n in died or not lease[n].exists():
                        continue
                    seq = json.loads(lease[n].read_text() or "{}").get("seq", 0)
                    if seq >= 1 and n not in renewed:
                        renewed[n] = hub.last_commit(REPO, f"sft/run-{n}/seed0/"
                                                     f"{lease_name(ARM, 0)}").when
                    if n in renewed and now >= renewed[n] + args.lease_s * n / args.runners:
                        pid = int((root / f"runner{n}" / "scratch" / "worker.pid").read_text())
                        os.killpg(os.getpgid(pid), signal.SIGSTOP)
                        os.killpg(procs[n].pid, signal.SIGKILL)
                        died[n] = time.time()
                if now >= next_read:
                    next_read = now + args.read_s
                    store = HubStore(REPO, token=TOKEN, deadline=Deadline.after(60),
                                     endpoint=hub.url)
                    for n in range(args.runners + 1):
                        view = read_attempt(store, f"sft/run-{n}/seed0", ARM, 0)
                        if n == live:
                            live_views[view.kind] = live_views.get(view.kind, 0) + 1
                            if view.kind != "running":
                                live_whys.add(view.why)
                        elif view.kind == "lost" and n not in died:
                            print(f"runner {n} read lost before it died", file=sys.stderr)
                        elif view.kind == "lost" and n not in lost_at:
                            lost_at[n] = time.time()
                    if time.monotonic() - began >= args.live_s:
                        (root / f"runner{live}" / "scratch" / "go").write_text("")
                time.sleep(0.2)
            (root / f"runner{live}" / "scratch" / "go").write_text("")
            procs[live].wait(timeout=120)
        finally:
            stop.set()
            for n, proc in procs.items():
                pid_file = root / f"runner{n}" / "scratch" / "worker.pid"
                if pid_file.exists():
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(os.getpgid(int(pid_file.read_text())), signal.SIGKILL)
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
        marker_path = hub.repo_dir(REPO) / f"sft/run-{live}/seed0" / f"{ARM}_attempt0.json"
        marker = json.loads(marker_path.read_text()) if marker_path.exists() else {}
    latencies = sorted(lost_at[n] - died[n] for n in lost_at)
    facts = marker.get("lease", {})
    result = {
        "lease_s": args.lease_s, "ttl_s": ttl, "read_s": args.read_s,
        "deaths": len(died), "read_lost": len(lost_at),
        "death_to_lost_s": [round(x, 1) for x in latencies],
        "death_to_lost_median_s": round(statistics.median(latencies), 1) if latencies else None,
        "death_to_lost_max_s": round(max(latencies), 1) if latencies else None,
        "goal_s": ttl + args.read_s,
        "live_runner_views": live_views,
        "live_runner_not_running_why": sorted(live_whys),
        "live_lease": facts,
        "live_lease_commits_of_its_own": (facts["renewals"] - facts["rode"]) if facts else None,
        "live_marker_rule": marker.get("rule"),
    }
    for key, value in result.items():
        print(f"{key:32} {value}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()

"""A fleet under one commit quota: the runner before pacing (naive) against this tree (new).

``--runners`` real ``flash-bootstrap run`` processes start at once against one local Hub
server that requires a token, with periodic console tails on
(``FLASH_UPLOAD_CONSOLE=1``, ``FLASH_CONSOLE_UPLOAD_INTERVAL_S=--interval-s``). Each
worker prints a line every 0.5 s for ``--worker-s`` seconds (so every tail has news),
writes ``time.time()`` to ``$FLASH_SCRATCH_DIR/worker_end.txt`` and exits 1 *without*
completion artifacts: every right marker says ``worker-failed`` (fatal, not ok,
attempt 0, the runner's run id).

Why a failing worker and not a successful one: the worker's own ``metrics.json`` and
``DONE`` uploads are commits too, and ``huggingface_hub`` sends an ``upload_file`` commit
once (no retry on 429). Tried with ``--runners 5 --worker-s 15``: every such upload was
answered 429, under both policies, so every attempt ended ``worker-failed`` for the
worker's own failed uploads, whatever the runner did. A worker that fails by itself keeps
every commit in the benchmark the runner's, and one expected rule for both policies.

The quota, with the defaults: unpaced, a runner commits a tail every 5 s of its 60 s
worker (12 tails) plus its marker, 13 commits; 20 runners ask for 20 x 13 = 260 commits
in about 60 s. The account gets a quarter of that (``--quota-factor 4``): 260 / 4 = 65
commits per rolling 60 s window (the window is ``--worker-s``). In general::

    tails  = worker_s // interval_s
    demand = runners * (tails + 1)
    quota  = ceil(demand / quota_factor) commits per worker_s seconds

Policies, one after the other, each against a fresh server with the same quota:

* ``naive``: the runner at git rev ``--naive-rev`` (default ``c6d310f``, before pacing),
  run from a git worktree of that rev made under a temporary directory
  (``PYTHONPATH=<worktree>``, cwd the worktree); removed at the end;
* ``new``: the runner of this tree.

Reported side by side, as an aligned table and one JSON line: right markers landed (goal
all); commits per attempt: the server's log has no per-prefix view of commits, so landed
commits / runners, with those tried and those refused 412 (each tail is a fenced commit
naming the head it read, so tails of runners sharing one repo collide, and a refused
commit counts against the quota all the same), and the new code's own ``store.commits``
evidence (its tails landed before the marker; the naive runner's markers have none); 429s
met per attempt (the server's ``throttled`` count / runners); the time from the worker's
exit to its marker landing (the marker file's mtime in the server's repo; median and
max); the fleet's wall time and the runners' exit codes. Each runner has a hard timeout
(``worker_s + 240`` s; its own attempt budget is ``worker_s + 180`` s): stragglers are
killed with their worker, and every temporary directory is removed. With the defaults it
takes about 2.5 minutes on 2 cores (at most 2 x 300 s if every runner straggles).

Leases (issue 40): the new runners keep one (``FLASH_LEASE_S=--lease-s``, 30 by default,
the least the contract allows), and a control plane's poller reads every prefix every
``--read-s`` seconds with ``fsm.attempts.read_attempts`` (its reads count in the requests).
Reported: the leases' renewals per attempt, the commits the lease made on its own (its
first write, and renewals no console tail carried), late renewals, superseded markers, the
reader's views of the runners alive while it read, and its false losts (goal 0).
``--window-s W --window-at T`` also refuses every commit (a 429 window, the repo throttled
for everyone) for ``W`` seconds from ``T`` seconds after the start: with ``W`` longer than a
lease's ``ttl_s`` every lease goes stale, and the reader must say unknown, never lost, and
no runner may end superseded::

    python benchmarks/bench_fleet.py
    python benchmarks/bench_fleet.py --runners 5 --worker-s 15   # a quick look
    python benchmarks/bench_fleet.py --worker-s 200 --window-at 20 --window-s 120
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsm.testing import LocalHubServer

PROJECT_ROOT = Path(__file__).resolve().parents[1]
TOKEN = "hf_bench_fleet_token_0123456789"
REPO = "org/fleet-runs"
ARM = "lambda"
PHASE = "sft"
NAIVE_REV = "c6d310f"
#: The runner's own attempt budget beyond the worker's run, and the hard timeout's.
BUDGET_MARGIN_S = 180.0
HARD_MARGIN_S = 240.0
LAST_LINE = "last line of the worker"

#: Steady output on an absolute 0.5 s schedule (no drift on a busy host), then a failure
#: without completion artifacts. Its pid (its own process group: the runner starts it so)
#: lets the benchmark kill it when its runner is a straggler.
WORKER = f"""
import os, sys, time
from pathlib import Path

scratch = Path(os.environ["FLASH_SCRATCH_DIR"])
(scratch / "worker.pid").write_text(str(os.getpid()))
seconds = float(os.environ["BENCH_WORKER_S"])
start = time.monotonic()
i = 0
while time.monotonic() - start < seconds:
    print(f"step {{i}} loss {{1.0 / (i + 1):.6f}}", flush=True)
    i += 1
    time.sleep(max(0.0, start + 0.5 * i - time.monotonic()))
print("{LAST_LINE}", flush=True)
(scratch / "worker_end.txt").write_text(repr(time.time()))
sys.exit(1)
"""


@dataclass
class Runner:
    n: int
    root: Path
    proc: subprocess.Popen[bytes]
    started: float
    ended: float | None = None
    killed: bool = False

    @property
    def prefix(self) -> str:
        return f"{PHASE}/run-{self.n}/seed0"


@dataclass
class Result:
    """One policy's figures."""

    label: str
    runners: int
    markers_present: int = 0
    markers_right: int = 0
    final_tail_last: int = 0
    commits_landed: int = 0
    commits_tried: int = 0
    commits_conflict: int = 0
    requests: int = 0
    throttled: int = 0
    evidence_commits: list[int] = field(default_factory=list)
    evidence_throttled: list[int] = field(default_factory=list)
    exit_to_marker: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    exit_codes: Counter[str] = field(default_factory=Counter)
    last_lines: Counter[str] = field(default_factory=Counter)
    #: The leases (new only): from each marker's ``lease`` evidence, and the reader's view.
    lease_written: list[int] = field(default_factory=list)
    lease_alone: list[int] = field(default_factory=list)
    lease_late: list[int] = field(default_factory=list)
    superseded: int = 0
    readings: int = 0
    reading_failed: int = 0
    views: Counter[str] = field(default_factory=Counter)
    false_lost: int = 0

    def figures(self) -> dict[str, Any]:
        n = self.runners
        lag = self.exit_to_marker
        return {
            "markers_right": self.markers_right,
            "markers_present": self.markers_present,
            "final_tail_last": self.final_tail_last,
            "commits_landed_per_attempt": self.commits_landed / n,
            "commits_tried_per_attempt": self.commits_tried / n,
            "commits_412_per_attempt": self.commits_conflict / n,
            "requests_per_attempt": self.requests / n,
            "throttled_per_attempt": self.throttled / n,
            "evidence_store_commits_mean": (statistics.fmean(self.evidence_commits)
                                            if self.evidence_commits else None),
            "evidence_store_throttled_mean": (statistics.fmean(self.evidence_throttled)
                                              if self.evidence_throttled else None),
            "exit_to_marker_median_s": statistics.median(lag) if lag else None,
            "exit_to_marker_max_s": max(lag) if lag else None,
            "exit_to_marker_n": len(lag),
            "wall_s": self.wall_s,
            "exit_codes": dict(sorted(self.exit_codes.items())),
            "lease_renewals_mean": (statistics.fmean(self.lease_written)
                                    if self.lease_written else None),
            # Commits of the lease alone (its first write included): what it cost beyond
            # the tails; the first write aside, the renewals that rode on none.
            "lease_commits_alone_mean": (statistics.fmean(self.lease_alone)
                                         if self.lease_alone else None),
            "lease_extra_while_tails_mean": (statistics.fmean(max(0, k - 1)
                                                              for k in self.lease_alone)
                                             if self.lease_alone else None),
            "lease_late_mean": (statistics.fmean(self.lease_late)
                                if self.lease_late else None),
            "superseded": self.superseded,
            "readings": self.readings,
            "readings_failed": self.reading_failed,
            "views_of_live_runners": dict(sorted(self.views.items())),
            "false_lost": self.false_lost,
        }


def quota_for(runners: int, worker_s: float, interval_s: float, factor: float) -> tuple[int, int]:
    """(naive demand, commit quota per ``worker_s`` window)."""
    demand = runners * (int(worker_s // interval_s) + 1)
    return demand, max(1, math.ceil(demand / factor))


def runner_env(tree: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HF_", "FLASH_", "PYTHONPATH"))}
    env["PYTHONPATH"] = str(tree)
    env["HF_HUB_DISABLE_TELEMETRY"] = "1"
    return env


def check_tree(tree: Path) -> None:
    """The runner started with this env and cwd really imports ``fsm`` from ``tree``."""
    out = subprocess.run(
        [sys.executable, "-c", "import fsm, states; print(fsm.__file__); print(states.__file__)"],
        env=runner_env(tree), cwd=tree, capture_output=True, text=True, timeout=60, check=True,
    ).stdout.split()
    for path in out:
        if not Path(path).resolve().is_relative_to(tree.resolve()):
            raise SystemExit(f"the runner would import {path}, not from {tree}")


def start(root: Path, hub: LocalHubServer, tree: Path, n: int, args: argparse.Namespace
          ) -> Runner:
    run = root / f"runner{n}"
    for sub in ("scratch", "runcode", "flash", "hf-home"):
        (run / sub).mkdir(parents=True)
    prefix = f"{PHASE}/run-{n}/seed0"
    payload = {
        "hf_repo": REPO, "hf_prefix": prefix, "phase": PHASE, "seed": 0, "flash_arm": ARM,
        "attempt": 0, "run_id": f"run-{n}", "max_wall_s": args.worker_s + BUDGET_MARGIN_S,
        "job_spec_json": json.dumps({"hf_prefix": prefix}),
        "env": {"HF_TOKEN": TOKEN, "FLASH_STOP_GRACE_S": "2", "FLASH_UPLOAD_CONSOLE": "1",
                "FLASH_LEASE_S": f"{args.lease_s:g}",
                "FLASH_CONSOLE_UPLOAD_INTERVAL_S": f"{args.interval_s:g}",
                "BENCH_WORKER_S": f"{args.worker_s:g}"},
    }
    (run / "flash" / "payload.json").write_text(json.dumps(payload))
    env = runner_env(tree)
    env["HF_HOME"] = str(run / "hf-home")
    with (run / "stderr.txt").open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fsm", "run", "--payload", str(run / "flash/payload.json"),
             "--store", hub.url, "--code-root", str(run / "runcode"),
             "--scratch-dir", str(run / "scratch")],
            env=env, cwd=tree, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=err, start_new_session=True,
        )
    return Runner(n, run, proc, time.monotonic())


def kill(runner: Runner) -> None:
    """End a runner (its process group) and its worker (its own group), by their ids."""
    if runner.proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(runner.proc.pid, signal.SIGKILL)
        runner.killed = True
    pid_file = runner.root / "scratch" / "worker.pid"
    with contextlib.suppress(OSError, ValueError):
        pid = int(pid_file.read_text())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        cwd = Path(os.readlink(f"/proc/{pid}/cwd"))
        if b"flash.engine.worker" in cmdline and cwd.is_relative_to(runner.root):
            os.killpg(os.getpgid(pid), signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        runner.proc.wait(timeout=10)


def last_line(path: Path) -> str:
    with contextlib.suppress(OSError):
        lines = path.read_text(errors="replace").strip().splitlines()
        if lines:
            return lines[-1][:160]
    return "(no stderr)"


def run_fleet(label: str, tree: Path, root: Path, args: argparse.Namespace) -> Result:
    demand, quota = quota_for(args.runners, args.worker_s, args.interval_s, args.quota_factor)
    result = Result(label, args.runners)
    root.mkdir(parents=True)
    runners: list[Runner] = []
    with LocalHubServer(root / "hub", token=TOKEN) as hub:
        hub.create_repo(REPO)
        hub.add_file(REPO, "code/flash/engine/worker/__main__.py", WORKER)
        hub.set_quota(commits=quota, window_s=args.worker_s)
        hard_s = args.worker_s + HARD_MARGIN_S
        print(f"[{label}] {args.runners} runners from {tree}; quota {quota} commits per "
              f"{args.worker_s:g} s (naive demand {demand})", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        try:
            for n in range(args.runners):
                runners.append(start(root, hub, tree, n, args))
            reader = Reader(hub, runners, result, args.read_s) if args.lease_s else None
            window = Window(hub, quota, args, t0)
            while any(r.ended is None for r in runners):
                window.tick()
                if reader is not None and label.startswith("new"):
                    reader.tick()
                now = time.monotonic()
                for r in runners:
                    if r.ended is not None:
                        continue
                    if r.proc.poll() is not None:
                        r.ended = now
                    elif now - r.started > hard_s:
                        print(f"[{label}] runner {r.n}: hard timeout, killed", file=sys.stderr)
                        kill(r)
                        r.ended = time.monotonic()
                time.sleep(0.2)
        finally:
            for r in runners:
                kill(r)  # stragglers (an interrupted benchmark) and any worker left behind
        result.wall_s = max((r.ended or time.monotonic()) for r in runners) - t0
        repo = hub.repo_dir(REPO)
        for r in runners:
            code = r.proc.returncode
            result.exit_codes["killed" if r.killed else str(code)] += 1
            if r.killed or code != 1:
                result.last_lines[last_line(r.root / "stderr.txt")] += 1
            check_marker(result, repo, r)
        counts = hub.counts()
        records = hub.requests
    result.throttled = counts["throttled"]
    result.requests = len(records)
    result.commits_tried = counts["commit"]
    result.commits_landed = sum(1 for rec in records
                                if rec.kind == "commit" and rec.status == 200)
    result.commits_conflict = sum(1 for rec in records
                                  if rec.kind == "commit" and rec.status == 412)
    return result


class Window:
    """``--window-s`` seconds from ``--window-at`` after the start: no commit admitted (a
    429 window: the repo throttled for everyone), then the quota as before."""

    def __init__(self, hub: LocalHubServer, quota: int, args: argparse.Namespace,
                 t0: float) -> None:
        self.hub, self.quota, self.worker_s = hub, quota, args.worker_s
        self.opens_at = t0 + args.window_at
        self.closes_at = self.opens_at + args.window_s
        self.state = "before" if args.window_s > 0 else "none"

    def tick(self) -> None:
        now = time.monotonic()
        if self.state == "before" and now >= self.opens_at:
            self.hub.set_quota(commits=0, window_s=5)
            self.state = "open"
            print(f"429 window open for {self.closes_at - self.opens_at:g} s", file=sys.stderr)
        elif self.state == "open" and now >= self.closes_at:
            self.hub.set_quota(commits=self.quota, window_s=self.worker_s)
            self.state = "over"
            print("429 window over", file=sys.stderr)


class Reader:
    """The control plane's poller (``fsm.attempts.read_attempts`` over every runner's
    prefix, one reading every ``read_s``): what it says of runners that are alive at the
    reading's start and after its end. ``lost`` for one of them is a false lost."""

    def __init__(self, hub: LocalHubServer, runners: list[Runner], result: Result,
                 read_s: float) -> None:
        self.hub, self.runners, self.result, self.read_s = hub, runners, result, read_s
        self.next_at = time.monotonic() + read_s

    def tick(self) -> None:
        if time.monotonic() < self.next_at:
            return
        self.next_at = time.monotonic() + self.read_s
        from fsm.attempts import read_attempts
        from fsm.clock import Deadline
        from fsm.store.hub import HubStore

        alive_before = {r.prefix for r in self.runners if r.proc.poll() is None}
        store = HubStore(REPO, token=TOKEN, deadline=Deadline.after(60), endpoint=self.hub.url)
        self.result.readings += 1
        try:
            views = read_attempts(store, [r.prefix for r in self.runners])
        except Exception as exc:
            self.result.reading_failed += 1
            print(f"reading failed: {type(exc).__name__}: {exc}"[:200], file=sys.stderr)
            return
        alive = alive_before & {r.prefix for r in self.runners if r.proc.poll() is None}
        for view in views:
            if view.prefix in alive:
                self.result.views[view.kind] += 1
                if view.kind == "lost":
                    self.result.false_lost += 1
                    print(f"FALSE LOST {view.prefix}: {view.why}", file=sys.stderr)


def check_marker(result: Result, repo: Path, r: Runner) -> None:
    path = repo / r.prefix / f"{ARM}_attempt0.json"
    try:
        marker = json.loads(path.read_text())
        landed = path.stat().st_mtime
    except (OSError, ValueError):
        return
    result.markers_present += 1
    if (isinstance(marker, dict)
            and (marker.get("ok"), marker.get("retriable"), marker.get("rule")) == (
                False, False, "worker-failed")
            and (marker.get("attempt"), marker.get("run_id")) == (0, f"run-{r.n}")):
        result.markers_right += 1
    # The console tail in the repo is the final one, from the marker's own commit: no
    # periodic tail (older text) landed after it.
    with contextlib.suppress(OSError):
        if LAST_LINE in (repo / r.prefix / f"console_{PHASE}.txt").read_text():
            result.final_tail_last += 1
    lease = marker.get("lease") if isinstance(marker, dict) else None
    if isinstance(lease, dict):
        renewals, rode = lease.get("renewals"), lease.get("rode")
        if isinstance(renewals, int) and isinstance(rode, int):
            result.lease_written.append(renewals)
            result.lease_alone.append(renewals - rode)
        if isinstance(lease.get("late"), int):
            result.lease_late.append(lease["late"])
    if isinstance(marker, dict) and marker.get("rule") == "superseded":
        result.superseded += 1
    store = marker.get("store") if isinstance(marker, dict) else None
    if isinstance(store, dict):
        if isinstance(store.get("commits"), int):
            result.evidence_commits.append(store["commits"])
        if isinstance(store.get("throttled"), int):
            result.evidence_throttled.append(store["throttled"])
    with contextlib.suppress(OSError, ValueError):
        ended = float((r.root / "scratch" / "worker_end.txt").read_text())
        result.exit_to_marker.append(landed - ended)


def _num(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def table(results: list[Result]) -> str:
    figs = [res.figures() for res in results]
    n = results[0].runners
    rows: list[tuple[str, list[str]]] = [
        (f"right markers landed (of {n})", [str(f["markers_right"]) for f in figs]),
        ("markers present", [str(f["markers_present"]) for f in figs]),
        ("final tail is the marker's", [str(f["final_tail_last"]) for f in figs]),
        ("commits landed / attempt", [_num(f["commits_landed_per_attempt"], 2) for f in figs]),
        ("commits tried / attempt", [_num(f["commits_tried_per_attempt"], 2) for f in figs]),
        ("commits refused 412 / attempt", [_num(f["commits_412_per_attempt"], 2)
                                           for f in figs]),
        ("429s met / attempt", [_num(f["throttled_per_attempt"], 2) for f in figs]),
        ("requests / attempt", [_num(f["requests_per_attempt"], 1) for f in figs]),
        ("store.commits mean (marker)", [_num(f["evidence_store_commits_mean"], 2)
                                         for f in figs]),
        ("store.throttled mean (marker)", [_num(f["evidence_store_throttled_mean"], 2)
                                           for f in figs]),
        ("worker exit -> marker, median s", [_num(f["exit_to_marker_median_s"])
                                             for f in figs]),
        ("worker exit -> marker, max s", [_num(f["exit_to_marker_max_s"]) for f in figs]),
        ("fleet wall time s", [_num(f["wall_s"]) for f in figs]),
        ("lease renewals landed / attempt", [_num(f["lease_renewals_mean"], 2) for f in figs]),
        ("lease commits of its own / attempt", [_num(f["lease_commits_alone_mean"], 2)
                                                for f in figs]),
        ("  of which beyond the first write", [_num(f["lease_extra_while_tails_mean"], 2)
                                               for f in figs]),
        ("lease renewals late / attempt", [_num(f["lease_late_mean"], 2) for f in figs]),
        ("superseded markers", [str(f["superseded"]) for f in figs]),
        ("reader: readings (failed)", [f"{f['readings']} ({f['readings_failed']})"
                                       for f in figs]),
        ("reader: views of live runners", [" ".join(f"{k}x{v}" for k, v in
                                                    f["views_of_live_runners"].items()) or "-"
                                           for f in figs]),
        ("reader: false lost", [str(f["false_lost"]) for f in figs]),
        ("runner exit codes", [" ".join(f"{code}x{k}" for code, k in f["exit_codes"].items())
                               for f in figs]),
    ]
    head = ("", [res.label for res in results])
    width0 = max(len(name) for name, _ in [head, *rows])
    widths = [max(len(cells[i]) for _, cells in [head, *rows]) for i in range(len(results))]
    lines = []
    for name, cells in [head, *rows]:
        lines.append("  ".join([name.ljust(width0), *(c.rjust(w) for c, w in
                                                     zip(cells, widths, strict=True))]))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runners", type=int, default=20)
    parser.add_argument("--worker-s", type=float, default=60.0)
    parser.add_argument("--interval-s", type=float, default=5.0,
                        help="FLASH_CONSOLE_UPLOAD_INTERVAL_S (the runner's minimum is 5)")
    parser.add_argument("--quota-factor", type=float, default=4.0,
                        help="the naive demand is this many times the commit quota")
    parser.add_argument("--lease-s", type=float, default=30.0,
                        help="FLASH_LEASE_S of the runners (0: none; the least period is 30)")
    parser.add_argument("--read-s", type=float, default=5.0,
                        help="the reader reads every prefix this often (new runners only)")
    parser.add_argument("--window-s", type=float, default=0.0,
                        help="a 429 window: no commit admitted for this long (0: none)")
    parser.add_argument("--window-at", type=float, default=20.0,
                        help="the window opens this long after the fleet's start")
    parser.add_argument("--naive-rev", default=NAIVE_REV,
                        help="git rev of the runner before pacing (default %(default)s)")
    args = parser.parse_args()
    if args.runners < 1 or args.worker_s <= 0 or args.interval_s <= 0 or args.quota_factor <= 0:
        parser.error("--runners, --worker-s, --interval-s and --quota-factor must be positive")
    demand, quota = quota_for(args.runners, args.worker_s, args.interval_s, args.quota_factor)
    root = Path(tempfile.mkdtemp(prefix="bench-fleet-"))
    naive_tree = root / "naive-tree"
    results: list[Result] = []
    try:
        subprocess.run(["git", "-C", str(PROJECT_ROOT), "worktree", "add", "--detach",
                        str(naive_tree), args.naive_rev],
                       check=True, capture_output=True, timeout=120)
        for tree in (naive_tree, PROJECT_ROOT):
            check_tree(tree)
        results.append(run_fleet(f"naive ({args.naive_rev})", naive_tree, root / "naive", args))
        results.append(run_fleet("new (this tree)", PROJECT_ROOT, root / "new", args))
    finally:
        if naive_tree.exists():
            subprocess.run(["git", "-C", str(PROJECT_ROOT), "worktree", "remove", "--force",
                            str(naive_tree)], capture_output=True, timeout=120, check=False)
        shutil.rmtree(root, ignore_errors=True)
        subprocess.run(["git", "-C", str(PROJECT_ROOT), "worktree", "prune"],
                       capture_output=True, timeout=120, check=False)
    print(f"{args.runners} runners x {args.worker_s:g} s worker, tails every "
          f"{args.interval_s:g} s; naive demand {demand} commits, quota {quota} per "
          f"{args.worker_s:g} s (1/{args.quota_factor:g})")
    print(table(results))
    for res in results:
        for line, k in res.last_lines.most_common():
            print(f"{res.label}: {k} runner(s) ended: {line}")
    print(json.dumps({
        "bench": "fleet", "runners": args.runners, "worker_s": args.worker_s,
        "interval_s": args.interval_s, "quota_factor": args.quota_factor,
        "demand_commits": demand, "quota_commits": quota, "quota_window_s": args.worker_s,
        "naive_rev": args.naive_rev, "lease_s": args.lease_s, "read_s": args.read_s,
        "window_s": args.window_s, "window_at": args.window_at,
        "naive": results[0].figures(), "new": results[1].figures(),
    }))


if __name__ == "__main__":
    main()

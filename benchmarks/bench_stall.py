"""The stall watch of supervise(): what it costs, whether it errs, how fast it sees a hang.

(a) Throughput. A worker prints ~200 MB of ~175-character lines as fast as it can; each round
    runs it under ``supervise()`` with out_fd on /dev/null and a console file, once with the
    watch off (``stall_s=0``) and once on (``stall_s=1800`` and a progress file), and, with
    ``--baseline REV``, under REV's supervise (before the watch: its pump takes no stamp).
    Interleaved rounds; medians of wall and CPU seconds. Goal: no measurable cost.
(b) False stalls. N healthy workers (``--runs``, default 200; ``--parallel`` at once), each
    with 2 or 3 silent gaps of 0.8 x stall_s (stall_s=5: gaps of 4 s), each gap ended by a
    console line or by a touch of the progress file (at random), then exit 0. Goal: 0 stalls.
(c) Detection latency at stall_s=10 (``--latency-runs``, default 20): from the worker's last
    sign of progress (a console line, or a touch of the progress file, alternately) to
    ``before_stop("stalled")``, and to ``supervise()`` returning; median and worst. The
    worker notes the time just after its last sign: a touch, dated by the file's change
    time, can show a latency a few milliseconds under stall_s. Goal: within stall_s + 1 s.
(d) The same through ``flash-bootstrap run`` as a real process on a local store, stacks
    (py-spy) included (``--runner-runs``, default 20): from the worker's last line to the
    marker in the store, and to the process gone. Goal: within FLASH_STALL_S + 5 s.

Run by hand:  PYTHONPATH=. python benchmarks/bench_stall.py [--part a|b|c|d|all] [--rounds 5]
              [--mb 200] [--baseline main] [--runs 200] [--latency-runs 20] [--parallel 25]
One supervised run, for timing whole processes side by side from outside:
              PYTHONPATH=. python benchmarks/bench_stall.py --once on|off [--mb 200]
              PYTHONPATH=. python benchmarks/bench_stall.py --once before --baseline main
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.util
import json
import logging
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import structlog

from fsm.clock import Deadline
from fsm.interrupt import InterruptFlag
from fsm.worker import supervise as current

LINE = 175  # bytes a line, newline included
LOUD = """
import sys
n = int(sys.argv[1])
pad = "x" * 166
write = sys.stdout.write
for i in range(n):
    write(f"{i:07d} {pad}\\n")
"""

# Healthy: each gap silent for GAP_S, ended by a line ("say") or a touch ("touch").
HEALTHY = """
import os, sys, time
from pathlib import Path
progress, gap = Path(sys.argv[1]), float(sys.argv[2])
print("start", flush=True)
for how in sys.argv[3:]:
    time.sleep(gap)
    if how == "say":
        print("step", flush=True)
    else:
        progress.touch()
print("done", flush=True)
"""

# Hung: one last sign (a line, or a line then a touch), its time on the monotonic clock in a
# file, then silence.
HUNG = """
import os, signal, sys, time
from pathlib import Path
progress, notes, how = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
print("working", flush=True)
if how == "touch":
    time.sleep(0.5)
    progress.touch()
notes.write_text(repr(time.monotonic()))
def hangs_here():
    while True:
        signal.pause()
hangs_here()
"""


def _cpu_s(who: int = resource.RUSAGE_SELF) -> float:
    """User+system CPU so far of this process (the runner: its pump included), or of its
    reaped children (the workers)."""
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def _baseline(rev: str) -> ModuleType:
    """fsm/worker/supervise.py as it is at git revision ``rev``, imported as a module of its own."""
    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(["git", "-C", str(root), "show", f"{rev}:fsm/worker/supervise.py"],
                            check=True, capture_output=True).stdout
    path = Path(tempfile.mkdtemp(prefix="bench-stall-")) / f"supervise_{rev}.py"
    path.write_bytes(source)
    spec = importlib.util.spec_from_file_location(f"supervise_at_{rev}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _loud_run(supervise: Callable[..., Any], tmp: Path, lines: int, watch: bool) -> None:
    script = tmp / "loud.py"
    script.write_text(LOUD)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        extra: dict[str, Any] = {}
        if watch:
            extra = {"stall_s": 1800.0, "progress_file": tmp / "progress"}
        result = supervise(
            [sys.executable, str(script), str(lines)],
            cwd=tmp,
            env=dict(os.environ),
            console_path=tmp / "console.txt",
            deadline=Deadline.never(),
            stop_by=Deadline.never(),
            interrupt=InterruptFlag(),
            out_fd=devnull,
            **extra,
        )
    finally:
        os.close(devnull)
    if result.returncode != 0 or result.reason != "exited":
        raise RuntimeError(f"worker failed: {result}")


def part_a(rounds: int, mb: int, baseline: str | None) -> dict[str, Any]:
    lines = mb * 1_000_000 // LINE
    variants: dict[str, Callable[[Path], None]] = {
        "watch off (stall_s=0)": lambda tmp: _loud_run(current.supervise, tmp, lines, False),
        "watch on (stall_s=1800)": lambda tmp: _loud_run(current.supervise, tmp, lines, True),
    }
    if baseline:
        old = _baseline(baseline)
        variants[f"before the watch ({baseline})"] = (
            lambda tmp: _loud_run(old.supervise, tmp, lines, False))
    times: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}  # the runner's
    worker_cpu: dict[str, list[float]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(rounds):
            order = list(variants.items())
            if i % 2:  # alternate who goes first: neither always runs on a warmer cache
                order.reverse()
            for name, run in order:
                c0, w0, t0 = _cpu_s(), _cpu_s(resource.RUSAGE_CHILDREN), time.perf_counter()
                run(Path(tmp))
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(_cpu_s() - c0)
                worker_cpu[name].append(_cpu_s(resource.RUSAGE_CHILDREN) - w0)
        size = (Path(tmp) / "console.txt").stat().st_size
    off = times["watch off (stall_s=0)"]
    # Each round's ratio to the same round's "off": a drift of the machine's speed between
    # rounds cancels out of it.
    ratios = {name: statistics.median(t / o for t, o in zip(ts, off, strict=True))
              for name, ts in times.items()}
    cpu_off = cpu["watch off (stall_s=0)"]
    cpu_ratios = {name: statistics.median(t / o for t, o in zip(cs, cpu_off, strict=True))
                  for name, cs in cpu.items()}
    print(f"(a) throughput: {size / 1e6:.0f} MB a run, {rounds} rounds interleaved, medians")
    print(f"    {'variant':<28} {'wall s':>7} {'min s':>7} {'max s':>7} {'MB/s':>5}"
          f" {'vs off':>7} {'runner cpu s':>12} {'vs off':>7} {'worker cpu s':>12}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"    {name:<28} {med:>7.3f} {min(ts):>7.3f} {max(ts):>7.3f}"
              f" {size / 1e6 / med:>5.0f} {ratios[name]:>6.3f}x"
              f" {statistics.median(cpu[name]):>12.3f} {cpu_ratios[name]:>6.3f}x"
              f" {statistics.median(worker_cpu[name]):>12.3f}")
    print("    vs off: the median of each round's ratio to the same round's run with the watch"
          " off; cpu: user+sys")
    return {"bytes": size, "rounds": rounds,
            "median_s": {k: round(statistics.median(v), 4) for k, v in times.items()},
            "median_ratio_vs_off": {k: round(v, 4) for k, v in ratios.items()},
            "median_runner_cpu_s": {k: round(statistics.median(v), 4) for k, v in cpu.items()},
            "median_runner_cpu_ratio_vs_off": {k: round(v, 4) for k, v in cpu_ratios.items()}}


def _healthy_run(tmp: Path, stall_s: float, gaps: list[str]) -> tuple[str, float]:
    script = tmp / "healthy.py"
    script.write_text(HEALTHY)
    result = current.supervise(
        [sys.executable, str(script), str(tmp / "progress"), str(0.8 * stall_s), *gaps],
        cwd=tmp,
        env=dict(os.environ),
        console_path=tmp / "console.txt",
        deadline=Deadline.after(60 + 10 * stall_s),
        stop_by=Deadline.after(70 + 10 * stall_s),
        interrupt=InterruptFlag(),
        out_fd=None,
        stall_s=stall_s,
        progress_file=tmp / "progress",
    )
    return result.reason, result.duration_s


def part_b(runs: int, parallel: int, stall_s: float, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    plans = [[rng.choice(["say", "touch"]) for _ in range(rng.choice([2, 3]))]
             for _ in range(runs)]
    reasons: dict[str, int] = {}
    durations: list[float] = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:

        def one(i: int) -> tuple[str, float]:
            where = Path(tmp, f"run{i}")
            where.mkdir()
            return _healthy_run(where, stall_s, plans[i])

        with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
            for reason, duration in pool.map(one, range(runs)):
                reasons[reason] = reasons.get(reason, 0) + 1
                durations.append(duration)
    gaps = sum(len(p) for p in plans)
    touches = sum(p.count("touch") for p in plans)
    stalls = reasons.get("stalled", 0)
    print(f"(b) false stalls: {stalls} of {runs} healthy runs (stall_s={stall_s:g}, silent gaps of"
          f" {0.8 * stall_s:g} s: {gaps} gaps, {touches} ended by a touch of the progress file,"
          f" {gaps - touches} by a line); reasons {reasons};"
          f" {parallel} at once, {time.monotonic() - t0:.0f} s in all")
    return {"runs": runs, "stall_s": stall_s, "gaps": gaps, "touch_gaps": touches,
            "reasons": reasons, "false_stalls": stalls}


def _hung_run(tmp: Path, stall_s: float, how: str) -> tuple[float, float]:
    script = tmp / "hung.py"
    script.write_text(HUNG)
    notes = tmp / "notes"
    called: list[float] = []
    result = current.supervise(
        [sys.executable, str(script), str(tmp / "progress"), str(notes), how],
        cwd=tmp,
        env=dict(os.environ),
        console_path=tmp / "console.txt",
        deadline=Deadline.after(60 + 3 * stall_s),
        stop_by=Deadline.after(70 + 3 * stall_s),
        interrupt=InterruptFlag(),
        out_fd=None,
        stall_s=stall_s,
        progress_file=tmp / "progress",
        before_stop=lambda _cause: called.append(time.monotonic()),
    )
    returned = time.monotonic()
    if result.reason != "stalled" or not called:
        raise RuntimeError(f"not stalled: {result}")
    last = float(notes.read_text())
    return called[0] - last, returned - last


def part_c(runs: int, parallel: int, stall_s: float) -> dict[str, Any]:
    hows = ["say" if i % 2 == 0 else "touch" for i in range(runs)]
    with tempfile.TemporaryDirectory() as tmp:

        def one(i: int) -> tuple[float, float]:
            where = Path(tmp, f"run{i}")
            where.mkdir()
            return _hung_run(where, stall_s, hows[i])

        with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
            results = list(pool.map(one, range(runs)))
    out: dict[str, Any] = {"runs": runs, "stall_s": stall_s}
    print(f"(c) detection latency, stall_s={stall_s:g}, {runs} runs ({parallel} at once):"
          " from the last sign of progress")
    for label, pick in (("to before_stop", 0), ("to supervise() returning", 1)):
        for how in ("say", "touch", None):
            xs = [r[pick] for r, h in zip(results, hows, strict=True) if how in (None, h)]
            name = {"say": "last sign a line", "touch": "last sign a touch", None: "all"}[how]
            print(f"    {label:<26} {name:<18} median {statistics.median(xs):7.3f} s"
                  f"  worst {max(xs):7.3f} s  (n={len(xs)})")
            out[f"{label} / {name}"] = {"median_s": round(statistics.median(xs), 3),
                                        "worst_s": round(max(xs), 3)}
    return out


RUNNER_WORKER = """
import os, time
from pathlib import Path
print("step 1 done", flush=True)
Path(os.environ["FLASH_SCRATCH_DIR"], "last-sign").write_text(repr(time.time()))
time.sleep(600)
"""


def _runner_run(tmp: Path, stall_s: float) -> tuple[float, float]:
    store = tmp / "store"
    worker = store / "code" / "flash" / "engine" / "worker" / "__main__.py"
    worker.parent.mkdir(parents=True)
    worker.write_text(RUNNER_WORKER)
    for sub in ("scratch", "runcode", "flash"):
        (tmp / sub).mkdir()
    payload = {"hf_repo": "org/runs", "hf_prefix": "bench/stall", "phase": "sft", "seed": 0,
               "job_spec_json": "{}", "env": {"FLASH_STALL_S": f"{stall_s:g}",
                                              "FLASH_STOP_GRACE_S": "1"}}
    (tmp / "flash" / "payload.json").write_text(json.dumps(payload))
    marker = store / "bench" / "stall" / "instance_attempt0.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fsm", "run", "--payload", str(tmp / "flash" / "payload.json"),
         "--store", store.as_uri(), "--code-root", str(tmp / "runcode"),
         "--scratch-dir", str(tmp / "scratch")],
        cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    landed = None
    while proc.poll() is None or landed is None:
        if landed is None and marker.exists():
            landed = time.time()
        if proc.poll() is not None and landed is None:
            landed = time.time() if marker.exists() else float("nan")
        time.sleep(0.01)
    gone = time.time()
    rule = json.loads(marker.read_text()).get("rule")
    if rule != "worker-stalled":
        raise RuntimeError(f"not stalled: {rule}")
    last = float((tmp / "scratch" / "last-sign").read_text())
    return landed - last, gone - last


def part_d(runs: int, parallel: int, stall_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:

        def one(i: int) -> tuple[float, float]:
            where = Path(tmp, f"run{i}")
            where.mkdir()
            return _runner_run(where, stall_s)

        with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
            results = list(pool.map(one, range(runs)))
    out: dict[str, Any] = {"runs": runs, "stall_s": stall_s}
    print(f"(d) through the runner, FLASH_STALL_S={stall_s:g}, {runs} runs ({parallel} at once):"
          " from the worker's last line")
    for label, pick in (("to the marker in the store", 0), ("to the process gone", 1)):
        xs = [r[pick] for r in results]
        print(f"    {label:<28} median {statistics.median(xs):7.3f} s  worst {max(xs):7.3f} s")
        out[label] = {"median_s": round(statistics.median(xs), 3), "worst_s": round(max(xs), 3)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["a", "b", "c", "d", "all"], default="all")
    parser.add_argument("--rounds", type=int, default=5, help="(a) rounds")
    parser.add_argument("--mb", type=int, default=200, help="(a) MB the worker prints")
    parser.add_argument("--baseline", default=None,
                        help="(a) also time the supervise of this git revision (e.g. main)")
    parser.add_argument("--runs", type=int, default=200, help="(b) healthy runs")
    parser.add_argument("--stall-s", type=float, default=5.0, help="(b) stall_s")
    parser.add_argument("--seed", type=int, default=23, help="(b) seed of the gap plans")
    parser.add_argument("--latency-runs", type=int, default=20, help="(c) hung runs")
    parser.add_argument("--latency-stall-s", type=float, default=10.0, help="(c) stall_s")
    parser.add_argument("--parallel", type=int, default=25, help="(b, c) runs at once")
    parser.add_argument("--runner-runs", type=int, default=20, help="(d) runs of the runner")
    parser.add_argument("--runner-parallel", type=int, default=4, help="(d) runs at once")
    parser.add_argument("--once", choices=["on", "off", "before"], default=None,
                        help="one supervised loud run, watch on or off (or under the"
                        " --baseline revision's supervise), then exit")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))

    if args.once:
        if args.once == "before" and not args.baseline:
            parser.error("--once before needs --baseline REV")
        supervise = _baseline(args.baseline).supervise if args.once == "before" else (
            current.supervise)
        with tempfile.TemporaryDirectory() as tmp:
            _loud_run(supervise, Path(tmp), args.mb * 1_000_000 // LINE, args.once == "on")
        return
    figures: dict[str, Any] = {"bench": "stall"}
    if args.part in ("a", "all"):
        figures["a"] = part_a(args.rounds, args.mb, args.baseline)
    if args.part in ("b", "all"):
        figures["b"] = part_b(args.runs, args.parallel, args.stall_s, args.seed)
    if args.part in ("c", "all"):
        figures["c"] = part_c(args.latency_runs, min(args.parallel, args.latency_runs),
                              args.latency_stall_s)
    if args.part in ("d", "all"):
        figures["d"] = part_d(args.runner_runs, args.runner_parallel, args.latency_stall_s)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()

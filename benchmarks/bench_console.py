"""How fast the worker's console gets through supervise(), against the shell's floor.

A worker prints 1,000,000 lines of ~175 characters (~175 MB) as fast as it can. Each round
runs, in turn: the worker straight into /dev/null (scale), piped into ``dd bs=1M`` (the floor
of any pipe reader), piped through coreutils ``tee FILE`` (the bar), and under
``supervise()`` with out_fd on /dev/null and a console file. N rounds, interleaved; medians.

Run by hand:  PYTHONPATH=. python benchmarks/bench_console.py [--rounds 5] [--lines 1000000]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import structlog

from fsm.clock import Deadline
from fsm.interrupt import InterruptFlag
from fsm.worker.supervise import supervise

WORKER = """
import sys
n = int(sys.argv[1])
pad = "x" * 166
write = sys.stdout.write
for i in range(n):
    write(f"{i:07d} {pad}\\n")
"""


def _shell(cmd: str) -> Callable[[], None]:
    def run() -> None:
        subprocess.run(["bash", "-c", cmd], check=True)

    return run


def _cpu_s() -> float:
    """User+system CPU of this process and its reaped children so far."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--lines", type=int, default=1_000_000)
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        script = tmp_path / "worker.py"
        script.write_text(WORKER)
        argv = [sys.executable, str(script), str(args.lines)]
        worker = shlex.join(argv)
        console = tmp_path / "console.txt"
        devnull = os.open(os.devnull, os.O_WRONLY)

        def supervised() -> None:
            result = supervise(
                argv,
                cwd=tmp_path,
                env=dict(os.environ),
                console_path=console,
                deadline=Deadline.never(),
                stop_by=Deadline.never(),
                interrupt=InterruptFlag(),
                out_fd=devnull,
            )
            if result.returncode != 0:
                raise RuntimeError(f"worker failed: {result}")

        variants: dict[str, Callable[[], None]] = {
            "worker > /dev/null": _shell(f"{worker} > /dev/null"),
            "(a) | dd of=/dev/null bs=1M": _shell(f"{worker} | dd of=/dev/null bs=1M status=none"),
            "(b) | tee FILE > /dev/null": _shell(f"{worker} | tee {console} > /dev/null"),
            "(c) supervise()": supervised,
        }
        times: dict[str, list[float]] = {name: [] for name in variants}
        cpu: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, run in variants.items():
                c0 = _cpu_s()
                t0 = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(_cpu_s() - c0)
        size = console.stat().st_size
        os.close(devnull)

    medians = {name: statistics.median(ts) for name, ts in times.items()}
    cpu_medians = {name: statistics.median(cs) for name, cs in cpu.items()}
    floor = medians["(a) | dd of=/dev/null bs=1M"]
    print(f"{args.lines:,} lines, {size / 1e6:.0f} MB, {args.rounds} rounds, medians")
    print(f"{'variant':<30} {'median s':>9} {'min s':>7} {'max s':>7} {'vs (a)':>7} {'cpu s':>7}")
    for name, ts in times.items():
        print(
            f"{name:<30} {medians[name]:>9.3f} {min(ts):>7.3f} {max(ts):>7.3f}"
            f" {medians[name] / floor:>6.2f}x {cpu_medians[name]:>7.3f}"
        )
    print("cpu s: user+sys of every process involved (worker, shell, dd/tee or supervisor)")
    print(
        json.dumps(
            {
                "bench": "console",
                "lines": args.lines,
                "bytes": size,
                "rounds": args.rounds,
                "median_s": {k: round(v, 4) for k, v in medians.items()},
                "median_cpu_s": {k: round(v, 4) for k, v in cpu_medians.items()},
            }
        )
    )


if __name__ == "__main__":
    main()

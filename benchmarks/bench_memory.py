"""Peak memory of the supervising process while the worker prints 2 GB.

A fresh Python process runs ``supervise()`` (console file on disk, out_fd on /dev/null)
around a worker that writes 2 GB of text lines, then reports its own peak RSS
(``ru_maxrss``). A second fresh process only imports the same modules: the baseline.
Target: peak RSS < 100 MB.

Run by hand:  PYTHONPATH=. python benchmarks/bench_memory.py [--gb 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

WORKER = """
import os, sys
total = int(sys.argv[1])
line = b"%s\\n" % (b"y" * 174)
block = line * ((1 << 20) // len(line))  # ~1 MiB of whole lines
sent = 0
while sent < total:
    sent += os.write(1, block[: total - sent])
"""

SUPERVISOR = """
import json, logging, os, resource, sys
from pathlib import Path
import structlog
from fsm.clock import Deadline
from fsm.interrupt import InterruptFlag
from fsm.worker.supervise import supervise
structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
tmp, total, run = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "run"
if run:
    devnull = os.open(os.devnull, os.O_WRONLY)
    result = supervise(
        [sys.executable, str(tmp / "worker.py"), total], cwd=tmp, env=dict(os.environ),
        console_path=tmp / "console.txt", deadline=Deadline.never(), stop_by=Deadline.never(),
        interrupt=InterruptFlag(), out_fd=devnull,
    )
    assert result.returncode == 0 and result.console_bytes == int(total), result
print(json.dumps({"maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def _peak_kb(tmp: Path, total: int, mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", SUPERVISOR, str(tmp), str(total), mode],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    ).stdout
    return int(json.loads(out.strip().splitlines()[-1])["maxrss_kb"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    total = int(args.gb * 1e9)
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        (tmp_path / "worker.py").write_text(WORKER)
        baseline = [_peak_kb(tmp_path, total, "import") for _ in range(args.rounds)]
        running = [_peak_kb(tmp_path, total, "run") for _ in range(args.rounds)]
    base_mb = statistics.median(baseline) / 1024
    run_mb = statistics.median(running) / 1024
    print(f"worker output {total / 1e9:.1f} GB, {args.rounds} rounds, medians of ru_maxrss")
    print(f"{'supervising process':<32} {'peak RSS MB':>12}")
    print(f"{'imports only (baseline)':<32} {base_mb:>12.1f}")
    print(f"{'supervise() around the worker':<32} {run_mb:>12.1f}")
    print(f"{'target':<32} {'< 100':>12}")
    print(
        json.dumps(
            {
                "bench": "memory",
                "bytes": total,
                "rounds": args.rounds,
                "median_peak_rss_mb": round(run_mb, 1),
                "median_baseline_rss_mb": round(base_mb, 1),
            }
        )
    )


if __name__ == "__main__":
    main()

"""From the worker's deadline to the last process of its group gone.

Two workers, each with a grandchild that shares the console pipe: one ignores SIGTERM
(both processes), one obeys it. The worker's deadline is 1 s after the start, the grace
1 s. A monitor thread learns the two pids from the console, holds a pidfd on each and
records when the last one exits; the lag is measured from the deadline (monotonic).
Target: gone within grace + 2 s (ignores) and well under the grace (obeys).

Run by hand:  PYTHONPATH=. python benchmarks/bench_deadline.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import select
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import structlog

from fsm.clock import Deadline
from fsm.interrupt import InterruptFlag
from fsm.worker.supervise import supervise

WORKER = """
import os, signal, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
print("pids", os.getpid(), child.pid, flush=True)
signal.pause()
"""

GRACE_S = 1.0
DEADLINE_AFTER_S = 1.0


class _Monitor:
    """Reads the console pipe; pidfds on the printed pids; the time the last one exited."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        self.gone_at: float | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        data = b""
        while not (found := re.search(rb"pids (\d+) (\d+)\n", data)):
            chunk = os.read(self.read_fd, 4096)
            if not chunk:
                return
            data += chunk
        poll = select.poll()
        pending = set()
        for pid in (int(found[1]), int(found[2])):
            fd = os.pidfd_open(pid)
            poll.register(fd, select.POLLIN)
            pending.add(fd)
        while pending:
            for fd, _ in poll.poll():
                poll.unregister(fd)
                pending.discard(fd)
                os.close(fd)
        self.gone_at = time.monotonic()
        while os.read(self.read_fd, 4096):
            pass

    def close(self) -> float | None:
        os.close(self.write_fd)
        self._thread.join(10)
        os.close(self.read_fd)
        return self.gone_at


def _round(tmp: Path, ignores: bool) -> tuple[float, float, int | None]:
    monitor = _Monitor()
    deadline = Deadline.after(DEADLINE_AFTER_S)
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN if ignores else signal.SIG_DFL)
    try:  # an ignored SIGTERM stays ignored across exec: the worker ignores it from birth
        result = supervise(
            [sys.executable, str(tmp / "worker.py")],
            cwd=tmp,
            env=dict(os.environ),
            console_path=tmp / "console.txt",
            deadline=deadline,
            stop_by=Deadline.never(),
            interrupt=InterruptFlag(),
            grace_s=GRACE_S,
            out_fd=monitor.write_fd,
        )
    finally:
        signal.signal(signal.SIGTERM, previous)
    returned = time.monotonic()
    gone = monitor.close()
    if result.reason != "deadline" or gone is None:
        raise RuntimeError(f"unexpected: {result}, gone at {gone}")
    return gone - deadline.mono_at, returned - deadline.mono_at, result.signal


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    rows: dict[str, list[tuple[float, float, int | None]]] = {"ignores": [], "obeys": []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        (tmp_path / "worker.py").write_text(WORKER)
        for _ in range(args.rounds):
            for name in rows:
                rows[name].append(_round(tmp_path, ignores=name == "ignores"))
    print(f"grace {GRACE_S} s, {args.rounds} rounds, medians; lag measured from the deadline")
    print(f"{'worker':<18} {'group gone s':>13} {'call returned s':>16} {'beyond grace s':>15}")
    summary = {}
    for name, rs in rows.items():
        gone = statistics.median(r[0] for r in rs)
        ret = statistics.median(r[1] for r in rs)
        sig = signal.Signals(rs[0][2]).name if rs[0][2] else "-"
        beyond = f"{gone - GRACE_S:>15.3f}" if name == "ignores" else f"{'-':>15}"
        print(f"{name + ' SIGTERM':<18} {gone:>13.3f} {ret:>16.3f} {beyond}  {sig}")
        summary[name] = {"gone_s": round(gone, 4), "returned_s": round(ret, 4)}
    print("target: group gone < grace + 2 s")
    print(json.dumps({"bench": "deadline", "grace_s": GRACE_S, "rounds": args.rounds, **summary}))


if __name__ == "__main__":
    main()

"""How long the stacks of a worker group take: fsm.worker.stacks.capture on N blocked Python
processes.

A leader (Python) starts N-1 Python children in its process group, each blocked in a read
after importing ``--imports`` (comma-separated modules, e.g. ``numpy``: a larger process for
``--native`` to symbolicate; ``--python`` runs the group under another interpreter, one that
has them). Each round captures the whole group with the real py-spy,
``--native`` first and plain, one process at a time and ``parallel`` at the default;
medians over the rounds, in seconds per process and for the whole group.

Run by hand:  PYTHONPATH=. python benchmarks/bench_stacks.py [--processes 8] [--rounds 5]
              [--imports numpy,scipy.linalg --python python3]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from fsm.worker.procs import group_members
from fsm.worker.stacks import capture, find_py_spy

CHILD = "import os, sys{imports}; print('up', flush=True); os.read(0, 1)"
LEADER = """
import os, subprocess, sys
n, child = int(sys.argv[1]), sys.argv[2]
kids = [subprocess.Popen([sys.executable, "-c", child], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE) for _ in range(n - 1)]
for kid in kids:
    kid.stdout.readline()
print("ready", flush=True)
os.read(0, 1)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--imports", default="")
    parser.add_argument("--python", default=sys.executable, help="the group's interpreter")
    args = parser.parse_args()
    py_spy = find_py_spy()
    if py_spy is None:
        sys.exit("py-spy is not installed")
    imports = "".join(f", {m}" for m in args.imports.split(",") if m)
    leader = subprocess.Popen(
        [args.python, "-c", LEADER, str(args.processes), CHILD.format(imports=imports)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True,
    )
    try:
        assert leader.stdout is not None
        if leader.stdout.readline().strip() != b"ready":
            sys.exit("the group did not start")
        pids = group_members(leader.pid)
        assert len(pids) == args.processes, pids
        cores = os.cpu_count()
        print(f"py-spy {py_spy}; {len(pids)} Python processes of {args.python} (imports: "
              f"{args.imports or 'none'}); {args.rounds} rounds; {cores} cores")
        with tempfile.TemporaryDirectory() as code:
            for native in (True, False):
                for parallel in (1, None):
                    totals, methods = [], set()
                    for _ in range(args.rounds):
                        stacks = capture(pids, leader=leader.pid, code_dir=Path(code),
                                         redact=lambda text: text, native=native,
                                         parallel=parallel)
                        totals.append(stacks.seconds)
                        methods |= {p.method for p in stacks.processes}
                    total = statistics.median(totals)
                    width = parallel or f"default ({min(4, cores or 1)})"
                    print(f"native={native!s:5} parallel={width!s:11} "
                          f"median {total / len(pids):.3f} s a process, {total:.3f} s the "
                          f"group (worst {max(totals):.3f} s); methods {sorted(methods)}")
    finally:
        os.killpg(leader.pid, signal.SIGKILL)
        leader.wait()


if __name__ == "__main__":
    main()

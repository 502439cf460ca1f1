"""The start-up budget, module by module (issue 38, item 4): ``python -X importtime``.

    python benchmarks/bench_importtime.py [--rounds 5]

Runs the runner as the image's ENTRYPOINT does (the console script beside the interpreter,
else ``python -m fsm``) on a local store with a one-line worker and no ``nvidia-smi``,
under ``PYTHONPROFILEIMPORTTIME``, and the agent's load of huggingface_hub
(``fsm.hub.library.load_library``) in a fresh interpreter. For each, the top-level imports
in the order they happen, grouped into the phases of ``fsm/launch.py``, cumulative
milliseconds (median of the rounds; ``-X importtime`` itself adds about a third, so read
the figures as shares, and ``bench_vs_reference.py`` for wall time).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from bench_gpu_overlap import local_tree, runner_argv

#: The phases of the runner's start, each ended by the first top-level import of the
#: module named (in the order ``fsm/launch.py`` imports them).
RUNNER_PHASES = (
    ("interpreter and site", "site"),
    ("the signal flag and the outlets", "fsm.output.outlet"),
    ("asking the GPUs", "fsm.host.queries"),
    ("the agent's fork", "fsm.hub.spawn"),
    ("structlog", "structlog"),
    ("the GPUs' reader", "fsm.host.probe"),
    ("the command line and the machine", None),
)
WORKER = "import time\n"

def _top_level(stderr: str) -> list[tuple[str, float]]:
    """``(module, cumulative ms)`` of each top-level import, in order."""
    found = []
    for line in stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        _, cumulative, name = line.split("|", 2)
        if not name.startswith("  "):  # one space after the bar; nested imports indent more
            found.append((name.strip(), int(cumulative) / 1000))
    return found


def _phases(imports: list[tuple[str, float]]) -> dict[str, float]:
    """Each phase's share: a phase ends with the import of the module that names it."""
    totals: dict[str, float] = defaultdict(float)
    phase = 0
    for name, ms in imports:
        totals[RUNNER_PHASES[phase][0]] += ms
        if phase < len(RUNNER_PHASES) - 1 and RUNNER_PHASES[phase][1] == name:
            phase += 1
    return totals


def _runner_once(root: Path) -> list[tuple[str, float]]:
    argv = runner_argv(root)
    bare = os.pathsep.join([os.path.dirname(sys.executable), "/usr/bin", "/bin"])
    env = {**os.environ, "PATH": bare, "FLASH_STALL_S": "0", "PYTHONPROFILEIMPORTTIME": "1"}
    proc = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True,
                          check=False, timeout=120)
    return _top_level(proc.stderr)


def _agent_once() -> list[tuple[str, float]]:
    code = "from fsm.hub import library; library.load_library()"
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True,
                          text=True, check=True, timeout=120)
    return _top_level(proc.stderr)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    root = local_tree("bench-importtime-", WORKER)
    runs = [_phases(_runner_once(root)) for _ in range(args.rounds)]
    print("runner, top-level imports by phase (cumulative ms, median):")
    for phase, _ in RUNNER_PHASES:
        print(f"  {phase:40} {statistics.median(run.get(phase, 0.0) for run in runs):8.1f}")
    agent = [dict(_agent_once()) for _ in range(args.rounds)]
    names = sorted({name for run in agent for name in run},
                   key=lambda n: -statistics.median(run.get(n, 0.0) for run in agent))
    print("agent (fsm.hub.library.load_library), largest top-level imports (cumulative ms):")
    for name in names[:8]:
        print(f"  {name:40} {statistics.median(run.get(name, 0.0) for run in agent):8.1f}")
    total = statistics.median(sum(run.values()) for run in agent)
    print(f"  {'all':40} {total:8.1f}")


if __name__ == "__main__":
    main()

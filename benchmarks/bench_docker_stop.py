"""``docker stop`` mid-training to the container's exit, through a real engine (issue 41:
goal under Docker's 10 s, with the marker published every time).

    sudo python benchmarks/bench_docker_stop.py [--rounds 10]

Starts its own ``dockerd`` and builds the image as ``tests/test_engine.py`` does (the
debootstrap base is cached under ``~/.cache/flash-bootstrap``), then, each round: the
contract's ``docker run`` line with a worker that trains until stopped, ``docker stop``
once the worker runs, and the seconds until ``docker stop`` returns (the container has
exited then). Prints the median, the slowest, the statuses and whether each round's
marker was retriable and published.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_engine import (  # the tests' own engine helpers
    TRAINING,
    Host,
    build_image,
    dockerd,
    run_as_the_hosts_do,
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    took: list[float] = []
    rounds: list[tuple[int, bool]] = []
    with dockerd() as engine:
        image = build_image(engine)
        for i in range(args.rounds):
            host = Host(Path(tempfile.mkdtemp(prefix="bench-stop-")))
            host.write(TRAINING)
            name = f"bench-stop-{i}"
            run_as_the_hosts_do(engine, image, host, name)
            while "worker.started" not in engine.docker("logs", name).stderr:
                time.sleep(0.05)
            started = time.monotonic()
            engine.docker("stop", name, timeout=60)
            took.append(time.monotonic() - started)
            status = int(engine.docker("wait", name).stdout.strip())
            marker = host.marker()
            rounds.append((status, bool(marker and marker["retriable"] and not marker["ok"])))
            engine.docker("rm", "-f", name, check=False)
    print(json.dumps({
        "rounds": args.rounds,
        "stop_to_exit_median_s": round(statistics.median(took), 3),
        "stop_to_exit_max_s": round(max(took), 3),
        "statuses": sorted({status for status, _ in rounds}),
        "retriable_marker_every_time": all(ok for _, ok in rounds),
    }))


if __name__ == "__main__":
    main()

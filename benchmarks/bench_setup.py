"""Setup, serial against overlapped: runner start to the worker's first line, with extras,
a code tree of 200 files and a spilled spec, on the local Hub server and the local index,
both with per-connection bandwidth capped and latency added to every request.

The serial runner is this project at an earlier commit (``--serial-rev``, by default
the parent of the commit that added ``fsm/prefetch.py``), run from a temporary git
worktree; the overlapped one is this tree. They alternate, each against a fresh server
with the same content. From the serial runs' logs (``state.changed`` carries each
state's seconds) comes the slowest single step of the setup (InstallExtras, FetchCode,
ResolveSpec): the goal is the overlapped setup within 10% of it.

    python benchmarks/bench_setup.py [--rounds 5] [--serial-rev REV]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fsm.testing import LocalHubServer, Network

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from pypi_server import PypiServer, build_wheel

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "hf_bench_setup_token"
REPO = "org/setup-runs"
PREFIX = "bench/setup/0"
SETUP_STATES = ("InstallExtras", "FetchCode", "ResolveSpec")

WORKER = """
import os, time
with open(os.path.join(os.environ["FLASH_SCRATCH_DIR"], "worker_start.txt"), "w") as f:
    f.write(repr(time.time()))
print("first line", flush=True)
"""


def _hub(root: Path, bandwidth: float, latency: float) -> LocalHubServer:
    hub = LocalHubServer(root / "hub", token=TOKEN,
                         network=Network(bandwidth_bps=bandwidth, latency_s=latency))
    hub.start()
    hub.create_repo(REPO)
    hub.add_file(REPO, "code/flash/engine/worker/__main__.py", WORKER)
    for i in range(199):
        hub.add_file(REPO, f"code/flash/lib/mod{i:03}.py", f"X = {i}\n" + "# pad\n" * 300)
    spec = {"hf_prefix": PREFIX, "table": [f"row {i}" for i in range(20_000)]}
    hub.add_file(REPO, f"{PREFIX}/job_spec.json", json.dumps(spec))
    return hub


def _run(tree: Path, hub: LocalHubServer, index_url: str, work: Path) -> dict[str, float]:
    shutil.rmtree(work, ignore_errors=True)
    for sub in ("scratch", "runcode", "flash", "target", "hf-home"):
        (work / sub).mkdir(parents=True)
    payload = {
        "hf_repo": REPO, "hf_prefix": PREFIX, "phase": "sft", "seed": 0,
        "job_spec_in_hf": True,
        "extra_pip": ["--index-url", index_url, "benchextra0", "benchextra1", "benchextra2",
                      "benchbig"],
        "env": {"HF_TOKEN": TOKEN, "PIP_CONFIG_FILE": os.devnull, "FLASH_INSTALLER": "pip",
                "PIP_TARGET": str(work / "target"), "PIP_NO_CACHE_DIR": "1"},
    }
    (work / "flash" / "payload.json").write_text(json.dumps(payload))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "FLASH_", "PIP_"))}
    env.update(PYTHONPATH=str(tree), HF_HOME=str(work / "hf-home"),
               HF_HUB_DISABLE_TELEMETRY="1")
    started = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "fsm", "run", "--payload", str(work / "flash/payload.json"),
         "--store", hub.url, "--code-root", str(work / "runcode"),
         "--scratch-dir", str(work / "scratch")],
        env=env, cwd=tree, capture_output=True, timeout=300, check=False,
    )
    started_file = work / "scratch" / "worker_start.txt"
    if not started_file.is_file():  # (the worker uploads nothing: its attempt then fails)
        raise SystemExit(f"the worker never started ({tree}): {proc.stderr.decode()[-800:]}")
    first = float(started_file.read_text())
    figures = {"to_worker_s": first - started}
    for line in proc.stderr.decode().splitlines():
        if line.startswith("{"):
            event = json.loads(line)
            if event.get("msg") == "state.changed" and event.get("from") in SETUP_STATES:
                figures[event["from"]] = float(event["seconds"])
    return figures


def _before_overlap() -> str:
    """The commit before setup was overlapped: the parent of the one adding the branches."""
    added = subprocess.run(
        ["git", "-C", str(ROOT), "log", "--diff-filter=A", "--format=%H", "--",
         "fsm/prefetch.py"], check=True, capture_output=True, text=True,
    ).stdout.split()
    return f"{added[-1]}~1"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--serial-rev", help="the serial runner's commit [the parent of the "
                        "commit that added fsm/prefetch.py]")
    parser.add_argument("--bandwidth", type=float, default=4 << 20, help="bytes/s per connection")
    parser.add_argument("--latency", type=float, default=0.02, help="seconds per request")
    args = parser.parse_args()
    serial_rev = args.serial_rev or _before_overlap()
    tmp = Path(tempfile.mkdtemp(prefix="bench-setup-"))
    serial_tree = tmp / "serial-tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(serial_tree),
                    serial_rev], check=True, capture_output=True)
    try:
        wheels = tmp / "wheels"
        wheels.mkdir()
        built = [build_wheel(wheels, f"benchextra{i}", "1.0", payload=os.urandom(200_000))
                 for i in range(3)]
        built.append(build_wheel(wheels, "benchbig", "1.0", payload=os.urandom(5 << 20)))
        net = Network(bandwidth_bps=args.bandwidth, latency_s=args.latency)
        runs: dict[str, list[dict[str, float]]] = {"serial": [], "overlapped": []}
        with PypiServer(built, network=net) as index:
            for n in range(args.rounds + 1):  # the first round warms caches: not counted
                for name, tree in (("serial", serial_tree), ("overlapped", ROOT)):
                    hub = _hub(tmp / f"{name}-{n}", args.bandwidth, args.latency)
                    try:
                        figures = _run(tree, hub, index.url, tmp / f"{name}-{n}" / "work")
                    finally:
                        hub.stop()
                    if n:
                        runs[name].append(figures)
        med = {name: {key: statistics.median(r[key] for r in rs) for key in rs[0]}
               for name, rs in runs.items()}
        slowest = max(med["serial"][state] for state in SETUP_STATES)
        print(f"serial: {serial_rev}; {args.rounds} rounds; "
              f"{args.bandwidth / (1 << 20):g} MiB/s per connection, "
              f"{args.latency * 1000:g} ms per request; medians in seconds")
        print(f"{'':28} {'serial':>10} {'overlapped':>11}")
        for key in ("to_worker_s", *SETUP_STATES):
            print(f"{key:28} {med['serial'].get(key, 0):10.3f} "
                  f"{med['overlapped'].get(key, 0):11.3f}")
        setup = {name: sum(m.get(s, 0.0) for s in SETUP_STATES) for name, m in med.items()}
        print(f"{'setup (the three states)':28} {setup['serial']:10.3f} "
              f"{setup['overlapped']:11.3f}")
        print(f"slowest single step (serial): {slowest:.3f} s; overlapped setup / slowest = "
              f"{setup['overlapped'] / slowest:.2f}")
        print(json.dumps({"bench": "setup", "rounds": args.rounds, "medians": med,
                          "setup": setup, "slowest_step_s": slowest}))
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                        str(serial_tree)], check=False, capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

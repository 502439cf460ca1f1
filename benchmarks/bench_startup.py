"""Start-up cost: the import time of ``fsm``, and the runner's own overhead from
``flash-bootstrap run`` starting to the worker's first output line on the local store
with no extras, beyond what the interpreter and the worker themselves cost.

    python benchmarks/bench_startup.py [--rounds 15] [--gpus 0 8]

overhead = T(run -> first worker line) - T(bare interpreter start) - T(worker -> first line)

``--gpus`` lists the hosts to measure, interleaved round by round: ``0`` is a host without
``nvidia-smi`` on PATH, ``N`` a host of N healthy, idle H100s answered by the fake
``nvidia-smi`` of ``fsm.testing.nvidia_smi``, the runner's three queries precomputed (the
script ``cat``s their answers: cheaper than the real binary's NVML initialisation, which
is the host's cost, not the runner's). Without
``--gpus``, only the host without ``nvidia-smi``. With a fake host, ``gpu_snapshot_ms`` is
what the three nvidia-smi queries took together, and ``preflight_waited_ms`` what of it
LoadPayload waited for before setup (the rest overlapped the runner's imports, the payload,
the lock and the store): the preflight's cost on the attempt's path.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fsm.host.gpus import QUERIES
from fsm.testing.nvidia_smi import FakeHost, FakeNvidiaSmi

WORKER = """
print("first line", flush=True)
"""


#: The GPU snapshot's log line: what it took, and what of it LoadPayload waited for.
WAITED: list[float] = []
TOOK: list[float] = []


def _first_line_s(argv: list[str], cwd: Path, env: dict[str, str]) -> float:
    started = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    elapsed = time.perf_counter() - started
    assert line, "no output"
    _, err = proc.communicate()
    for text in err.decode("utf-8", "replace").splitlines():
        if '"host.gpus"' in text:
            event = json.loads(text)
            WAITED.append(event["waited_s"])
            TOOK.append(event["seconds"])
    return elapsed


def _interp_s() -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    return time.perf_counter() - started


def _import_us() -> int:
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", "import fsm"],
                         capture_output=True, text=True, check=True).stderr
    for line in out.splitlines():
        m = re.match(r"import time:\s+\d+ \|\s+(\d+) \| fsm$", line)
        if m:
            return int(m.group(1))
    raise RuntimeError(out)


def _bare_path() -> str:
    """This process's PATH without any directory holding an ``nvidia-smi``."""
    dirs = os.environ.get("PATH", os.defpath).split(os.pathsep)
    return os.pathsep.join(d for d in dirs if not os.path.exists(os.path.join(d, "nvidia-smi")))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--gpus", type=int, nargs="+", default=[0],
                        help="hosts to measure: 0 = no nvidia-smi, N = a fake one with N GPUs")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-startup-"))
    store = root / "store"
    worker = store / "code" / "flash" / "engine" / "worker"
    worker.mkdir(parents=True)
    (worker / "__main__.py").write_text(WORKER)
    for sub in ("scratch", "runcode", "flash"):
        (root / sub).mkdir()
    payload = root / "flash" / "payload.json"
    payload.write_text(json.dumps({
        "hf_repo": "org/runs", "hf_prefix": "bench/r/0", "phase": "sft", "seed": 0,
        "job_spec_json": "{}",
    }))
    run_argv = [sys.executable, "-m", "fsm", "run", "--payload", str(payload),
                "--store", store.as_uri(), "--code-root", str(root / "runcode"),
                "--scratch-dir", str(root / "scratch")]
    env = {**os.environ, "PATH": _bare_path()}
    envs: dict[int, dict[str, str]] = {}
    fakes: list[FakeNvidiaSmi] = []
    for count in args.gpus:
        if count == 0:
            envs[count] = env
        else:
            # the runner's three queries answered by the script itself (cat), so the figure
            # is the runner's cost, not a Python interpreter's per call
            fake = FakeNvidiaSmi(root / f"smi{count}", FakeHost.h100s(count),
                                 precompute=list(QUERIES.values()))
            fakes.append(fake)
            envs[count] = {**env, **fake.env(env)}
    worker_env = {**env, "PYTHONPATH": str(store / "code")}
    runs: dict[int, list[float]] = {count: [] for count in envs}
    workers, interps, imports = [], [], []
    for _ in range(args.rounds):  # interleaved, so drift hits every measure alike
        for count, run_env in envs.items():
            (root / "flash" / ".flash-instance_attempt0.result.json").unlink(missing_ok=True)
            runs[count].append(_first_line_s(run_argv, root, run_env))
        workers.append(_first_line_s([sys.executable, "-m", "flash.engine.worker"],
                                     store / "code", worker_env))
        interps.append(_interp_s())
        imports.append(_import_us())
    for fake in fakes:
        fake.stop()
    worker_ms = statistics.median(workers)
    interp_ms = statistics.median(interps)
    result: dict[str, object] = {
        "worker_to_first_line_ms": round(worker_ms * 1000, 1),
        "interpreter_ms": round(interp_ms * 1000, 1),
    }
    for count, values in runs.items():
        host = "no_nvidia_smi" if count == 0 else f"fake_nvidia_smi_{count}_gpus"
        run_ms = statistics.median(values)
        result[f"run_to_first_line_ms[{host}]"] = round(run_ms * 1000, 1)
        result[f"runner_overhead_ms[{host}]"] = round((run_ms - worker_ms - interp_ms) * 1000, 1)
    if WAITED:
        # the preflight's cost to the attempt: what LoadPayload waited for the answer
        result["gpu_snapshot_ms"] = round(statistics.median(TOOK) * 1000, 1)
        result["preflight_waited_ms"] = round(statistics.median(WAITED) * 1000, 1)
    result.update(import_fsm_us=statistics.median(imports), rounds=args.rounds)
    for key, value in result.items():
        print(f"{key:48} {value}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()

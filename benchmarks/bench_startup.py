"""Start-up cost: the import time of ``fsm``, and the runner's own overhead from
``flash-bootstrap run`` starting to the worker's first output line on the local store
with no extras, beyond what the interpreter and the worker themselves cost.

    python benchmarks/bench_startup.py [--rounds 15]

overhead = T(run -> first worker line) - T(bare interpreter start) - T(worker -> first line)
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

WORKER = """
print("first line", flush=True)
"""


def _first_line_s(argv: list[str], cwd: Path, env: dict[str, str]) -> float:
    started = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    elapsed = time.perf_counter() - started
    assert line, "no output"
    proc.wait()
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
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
    env = dict(os.environ)
    worker_env = {**env, "PYTHONPATH": str(store / "code")}
    runs, workers, interps, imports = [], [], [], []
    for _ in range(args.rounds):  # interleaved, so drift hits all three alike
        (root / "flash").joinpath(".flash-instance_attempt0.result.json").unlink(missing_ok=True)
        runs.append(_first_line_s(run_argv, root, env))
        workers.append(_first_line_s([sys.executable, "-m", "flash.engine.worker"],
                                     store / "code", worker_env))
        interps.append(_interp_s())
        imports.append(_import_us())
    med = {name: statistics.median(values) for name, values in
           (("run_to_first_line_ms", runs), ("worker_to_first_line_ms", workers),
            ("interpreter_ms", interps))}
    overhead = (
        med["run_to_first_line_ms"] - med["worker_to_first_line_ms"] - med["interpreter_ms"]
    )
    result = {**{k: round(v * 1000, 1) for k, v in med.items()},
              "runner_overhead_ms": round(overhead * 1000, 1),
              "import_fsm_us": statistics.median(imports), "rounds": args.rounds}
    for key, value in result.items():
        print(f"{key:28} {value}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()

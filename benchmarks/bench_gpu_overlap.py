"""Setup overlaps a slow nvidia-smi (issue 36: goal within 0.1 s of the longer of the two).

    python benchmarks/bench_gpu_overlap.py [--rounds 3] [--delays 0,3,30]

The runner (the console script beside the interpreter, as the image's ENTRYPOINT starts
it; else ``python -m fsm``) starts a worker that records ``time.time()`` as its first
instruction, on a
local store, with the fake ``nvidia-smi`` (``fsm.testing.nvidia_smi``) answering every
query correctly after ``delay`` seconds (8 healthy H100s; ``FakeHost.delay``; answered by
the fake's shell script with ``sleep`` and ``cat``, about as cheap as the real binary: three
Python fakes at once would take the runner's own CPU on two cores), and once
with no nvidia-smi at all (setup alone). For each case: start (the runner's spawn) to the
worker's first instruction, median of the rounds, and the answer's own time (one direct
call of the fake, its interpreter start included). ``excess`` is start-to-worker minus the
longer of setup alone and the answer: what serializing would add.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fsm.host import gpus
from fsm.testing.nvidia_smi import FakeHost, FakeNvidiaSmi

WORKER = "import time\nfirst = time.time()\nimport os\n" \
    "with open(os.path.join(os.environ['FLASH_SCRATCH_DIR'], 'first.txt'), 'w') as f:\n" \
    "    f.write(repr(first))\n"


#: The runner as the image's ENTRYPOINT starts it (the console script), else ``python -m fsm``.
_SCRIPT = Path(sys.executable).with_name("flash-bootstrap")
ENTRY = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "fsm"]


def local_tree(prefix: str, worker: str) -> Path:
    """A fresh folder with a local store holding ``worker``'s code, a payload for it, and
    the runner's code root and scratch (also ``bench_importtime.py``'s)."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    code = root / "store" / "code" / "flash" / "engine" / "worker"
    code.mkdir(parents=True)
    (code / "__main__.py").write_text(worker)
    for sub in ("scratch", "runcode", "flash"):
        (root / sub).mkdir()
    (root / "flash" / "payload.json").write_text(json.dumps({
        "hf_repo": "org/runs", "hf_prefix": "bench/o/0", "phase": "sft", "seed": 0,
        "job_spec_json": "{}", "env": {"FLASH_HOST_WATCH_S": "0"},
    }))
    return root


def runner_argv(root: Path) -> list[str]:
    """The runner on ``local_tree``'s store, as a new attempt (its state files removed)."""
    for name in (".flash-instance_attempt0.result.json", ".flash-instance_attempt0.start.json"):
        (root / "flash" / name).unlink(missing_ok=True)
    return [*ENTRY, "run", "--payload", str(root / "flash" / "payload.json"),
            "--store", (root / "store").as_uri(), "--code-root", str(root / "runcode"),
            "--scratch-dir", str(root / "scratch")]


def _once(root: Path, env: dict[str, str]) -> float:
    (root / "scratch" / "first.txt").unlink(missing_ok=True)
    argv = runner_argv(root)
    started = time.time()
    subprocess.run(argv, cwd=root, env=env, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, check=False, timeout=300)
    return float((root / "scratch" / "first.txt").read_text()) - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--delays", default="0,3,30")
    args = parser.parse_args()
    root = local_tree("bench-gpu-overlap-", WORKER)
    bare = os.pathsep.join([os.path.dirname(sys.executable), "/usr/bin", "/bin"])
    base = {**os.environ, "FLASH_STALL_S": "0"}
    setup = statistics.median(_once(root, {**base, "PATH": bare}) for _ in range(args.rounds))
    result: dict[str, float] = {"setup_alone_s": round(setup, 3)}
    for delay in (float(d) for d in args.delays.split(",")):
        host = FakeHost.h100s(8, delay={"*": delay})
        queries = [list(args) for args in gpus.QUERIES.values()]
        with FakeNvidiaSmi(root / f"smi-{delay:g}", host, precompute=queries) as fake:
            t0 = time.monotonic()
            subprocess.run([str(fake.path), *queries[0]], capture_output=True, check=False)
            answer = time.monotonic() - t0
            took = statistics.median(_once(root, {**base, **fake.env()})
                                     for _ in range(args.rounds))
        result[f"answer_s[{delay:g}]"] = round(answer, 3)
        result[f"start_to_worker_s[{delay:g}]"] = round(took, 3)
        result[f"excess_s[{delay:g}]"] = round(took - max(setup, answer), 3)
    for key, value in result.items():
        print(f"{key:32} {value}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()

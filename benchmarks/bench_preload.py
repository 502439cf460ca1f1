"""Benchmark: a ~200 MB preload through HubStore against the local Hub server on loopback.

    python benchmarks/bench_preload.py [--no-accel] [--size-mb 200] [--runs 3]

Warms a model repo (config, tokenizer, one large safetensors file) into a fresh cache
three times with the current interpreter and prints one JSON line: the hub version, the
accelerator in use, each run's seconds, the median, and how many requests the server saw
per run. The server runs in a process of its own (hf_transfer holds the GIL while it
starts a download, so it cannot share a process with the server).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = "bench/tiny-200m"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-accel", action="store_true", help="leave the accelerator off")
    parser.add_argument("--size-mb", type=int, default=200)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()

    from fsm.store.hub import configure_transfer

    accelerator = configure_transfer(os.environ, accelerate=not args.no_accel)
    from fsm.clock import Deadline
    from fsm.store.base import PRELOAD_IGNORE_PATTERNS
    from fsm.store.hub import HubStore

    token = f"hf_bench_{secrets.token_hex(8)}"
    with tempfile.TemporaryDirectory(prefix="bench-preload-") as tmp_name:
        tmp = Path(tmp_name)
        model = tmp / "root" / "models" / REPO
        model.mkdir(parents=True)
        (model / "config.json").write_text('{"model_type": "bench"}')
        (model / "tokenizer.json").write_text('{"version": "1.0"}' * 1000)
        block = os.urandom(1 << 20)
        with (model / "model.safetensors").open("wb") as f:
            for _ in range(args.size_mb):
                f.write(block)
        log = tmp / "requests.jsonl"
        env = dict(os.environ, BENCH_HUB_TOKEN=token)
        server = subprocess.Popen(
            [sys.executable, "-c", "from fsm.testing.hubserver import main; main()",
             str(tmp / "root"), "--token-env", "BENCH_HUB_TOKEN", "--log", str(log)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        )
        try:
            assert server.stdout is not None
            url = server.stdout.readline().strip()
            store = HubStore("bench/unused", token=token, endpoint=url,
                             deadline=Deadline.after(3600))
            seconds: list[float] = []
            requests: list[int] = []
            for run in range(args.runs):
                seen = _lines(log)
                started = time.perf_counter()
                outcome = store.warm_model(REPO, tmp / f"cache{run}", PRELOAD_IGNORE_PATTERNS)
                seconds.append(time.perf_counter() - started)
                assert outcome == "downloaded", outcome
                requests.append(_lines(log) - seen)
        finally:
            assert server.stdin is not None
            server.stdin.close()
            server.wait(timeout=10)
    median = statistics.median(seconds)
    print(json.dumps({
        "huggingface_hub": importlib.metadata.version("huggingface_hub"),
        "accelerator": accelerator,
        "size_mb": args.size_mb,
        "runs_s": [round(s, 3) for s in seconds],
        "median_s": round(median, 3),
        "mb_per_s": round(args.size_mb / median, 1),
        "requests_per_run": requests,
    }))


def _lines(path: Path) -> int:
    # A request is logged when its answer is complete; give the server a moment to finish.
    time.sleep(0.2)
    return sum(1 for _ in path.open()) if path.exists() else 0


if __name__ == "__main__":
    main()

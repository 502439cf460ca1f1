"""Benchmark: a preload through HubStore against the local Hub server, with per-connection caps.

    python benchmarks/bench_preload.py [--no-accel] [--size-mb 1024] [--files 4]
        [--bandwidth 52428800] [--latency 0.02] [--runs 3]

Warms a model repo (config, tokenizer, a safetensors index and ``--files`` safetensors-like
shards of random bytes, ``--size-mb`` MB in all) into a fresh cache ``--runs`` times with
the current interpreter, through ``HubStore.warm_model``. The accelerator is the one
``configure_transfer`` picks for the installed hub line (hf_transfer on 0.x, hf_xet on
1.x/2.x), or none with ``--no-accel``. MB is 2**20 bytes throughout.

The server runs in a process of its own (hf_transfer holds the GIL while it starts a
download, so it cannot share a process with the server), with ``--bandwidth`` bytes/s per
connection (0: uncapped) and ``--latency`` seconds per answer. The cap is per connection,
like a CDN's, so the bandwidth a client can get is the cap times the connections it keeps
busy at once: each run reports the peak number of GETs of model shards in flight at once
(from the server's request log, ``at``/``ended_at``; one HTTP/1.1 connection carries one
request at a time, so this is the number of connections carrying the payload at once),
the aggregate cap it implies (cap x peak), and MB/s against it; also the peak counting
every GET and every request, and the shard GETs' mean concurrency over their span.

Before the runs every file is HEADed once, so that the server's one-off ETag hashing
does not land on the first run; the first run still pays the client's first-use costs
(lazy imports, thread pools, loading hf_transfer), as the runner's one preload per
process does, so it is reported with the others and the median is the steady state.

Each run also reports the requests the server saw (by kind, and how many GETs were
ranged), the CPU seconds of the client and of the server, and the download code path the
hub took (calls of ``huggingface_hub.file_download.http_get`` / ``xet_get``, and of
``hf_transfer.download`` on 0.x), counted by wrapping those functions.

Prints one JSON line (the keys of the 200 MB version are kept: ``huggingface_hub``,
``accelerator``, ``size_mb``, ``runs_s``, ``median_s``, ``mb_per_s``,
``requests_per_run``), preceded on stderr by one line per run.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import os
import secrets
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

REPO = "bench/preload"
MB = 1 << 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-accel", action="store_true", help="leave the accelerator off")
    parser.add_argument("--size-mb", type=int, default=1024,
                        help="MB of model files in all (default: 1024)")
    parser.add_argument("--files", type=int, default=4,
                        help="model files the size is split across (default: 4)")
    parser.add_argument("--bandwidth", type=float, default=50 * MB, metavar="BYTES_PER_S",
                        help="cap per connection in bytes/s, 0 for none (default: 50 MiB/s)")
    parser.add_argument("--latency", type=float, default=0.02, metavar="S",
                        help="delay of every answer in seconds (default: 0.02)")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    if args.size_mb < 1 or args.files < 1 or args.runs < 1:
        parser.error("--size-mb, --files and --runs must be at least 1")
    if args.bandwidth < 0 or args.latency < 0:
        parser.error("--bandwidth and --latency must not be negative")
    bandwidth = args.bandwidth or None

    with tempfile.TemporaryDirectory(prefix="bench-preload-") as tmp_name:
        tmp = Path(tmp_name)
        # Nothing of the hub's (xet cache, token, ...) lands outside the temp dir.
        os.environ["HF_HOME"] = str(tmp / "hf_home")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        from fsm.store.hub import configure_transfer

        accelerator = configure_transfer(os.environ, accelerate=not args.no_accel)
        calls = _instrument()  # imports huggingface_hub, after configure_transfer
        result = _bench(args, tmp, bandwidth, accelerator, calls)
    print(json.dumps(result))


def _bench(args: argparse.Namespace, tmp: Path, bandwidth: float | None, accelerator: str,
           calls: Counter[str]) -> dict[str, Any]:
    from fsm.clock import Deadline
    from fsm.store.base import PRELOAD_IGNORE_PATTERNS
    from fsm.store.hub import HubStore

    model = tmp / "root" / "models" / REPO
    payload = _write_model(model, args.size_mb * MB, args.files)
    os.sync()  # the model's writeback is not the first run's to pay
    token = f"hf_bench_{secrets.token_hex(8)}"
    log = tmp / "requests.jsonl"
    network = ["--latency", str(args.latency)]
    if bandwidth is not None:
        network += ["--bandwidth", str(bandwidth)]
    server = subprocess.Popen(
        [sys.executable, "-c", "from fsm.testing.hubserver import main; main()",
         str(tmp / "root"), "--token-env", "BENCH_HUB_TOKEN", "--log", str(log), *network],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env=dict(os.environ, BENCH_HUB_TOKEN=token),
    )
    runs: list[dict[str, Any]] = []
    try:
        assert server.stdout is not None
        url = server.stdout.readline().strip()
        _prime(url, token, model)
        store = HubStore("bench/unused", token=token, endpoint=url,
                         deadline=Deadline.after(3600))
        for run in range(args.runs):
            cache = tmp / f"cache{run}"
            seen = _settled_lines(log)
            calls.clear()
            cpu, server_cpu = time.process_time(), _cpu_of(server.pid)
            started = time.perf_counter()
            outcome = store.warm_model(REPO, cache, PRELOAD_IGNORE_PATTERNS)
            seconds = time.perf_counter() - started
            cpu = time.process_time() - cpu
            server_after = _cpu_of(server.pid)
            server_cpu = (None if server_cpu is None or server_after is None
                          else server_after - server_cpu)
            assert outcome == "downloaded", outcome
            got = sum(p.stat().st_size for p in cache.rglob("*.safetensors") if p.is_file())
            assert got == payload, (got, payload)
            shutil.rmtree(cache)  # a run's GB is not kept on disk
            records = _records(log, seen)
            runs.append(_run_report(run, seconds, payload, bandwidth, records, calls,
                                    cpu, server_cpu))
            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    finally:
        assert server.stdin is not None
        server.stdin.close()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()

    times: list[float] = [r["seconds"] for r in runs]
    median = statistics.median(times)
    peak = max(r["peak_concurrency"] for r in runs)
    cap_mb = None if bandwidth is None else bandwidth / MB
    return {
        "huggingface_hub": importlib.metadata.version("huggingface_hub"),
        "accelerator": accelerator,
        "size_mb": args.size_mb,
        "files": args.files,
        "bandwidth_per_conn_mb_s": None if cap_mb is None else round(cap_mb, 2),
        "latency_s": args.latency,
        "runs_s": [round(s, 3) for s in times],
        "median_s": round(median, 3),
        "mb_per_s": round(payload / MB / median, 1),
        "peak_concurrency": peak,
        "aggregate_cap_mb_s": None if cap_mb is None else round(cap_mb * peak, 1),
        "requests_per_run": [r["requests"] for r in runs],
        "runs": runs,
    }


def _run_report(run: int, seconds: float, payload: int, bandwidth: float | None,
                records: list[dict[str, Any]], calls: Counter[str], cpu: float,
                server_cpu: float | None) -> dict[str, Any]:
    gets = [r for r in records if r["kind"] == "resolver" and r["method"] == "GET"]
    shards = [r for r in gets if r["path"].endswith(".safetensors")]
    peak = _peak(shards)
    mb_s = payload / MB / seconds
    cap_mb = None if bandwidth is None else bandwidth / MB
    aggregate = None if cap_mb is None else cap_mb * peak
    busy = sum(r["ended_at"] - r["at"] for r in shards)
    span = (max(r["ended_at"] for r in shards) - min(r["at"] for r in shards)) if shards else 0.0
    by_kind = Counter(f"{r['method']} {r['kind']}" for r in records)
    return {
        "run": run,
        "seconds": round(seconds, 3),
        "mb_per_s": round(mb_s, 1),
        "bandwidth_per_conn_mb_s": None if cap_mb is None else round(cap_mb, 2),
        # Shard GETs in flight at once: the connections carrying the payload at once.
        "peak_concurrency": peak,
        "peak_concurrency_gets": _peak(gets),  # small files' GETs too
        "peak_concurrency_all": _peak(records),  # any request, HEADs and API calls included
        "mean_concurrency": round(busy / span, 2) if span else 0.0,  # shard GETs, their span
        "aggregate_cap_mb_s": None if aggregate is None else round(aggregate, 1),
        "of_aggregate_cap": None if not aggregate else round(mb_s / aggregate, 3),
        "requests": len(records),
        "requests_by_kind": dict(sorted(by_kind.items())),
        "shard_gets": len(shards),
        "ranged_gets": sum(1 for r in gets if r.get("range")),
        "statuses": dict(sorted(Counter(str(r["status"]) for r in records).items())),
        "code_path": dict(sorted(calls.items())),
        "client_cpu_s": round(cpu, 2),
        "server_cpu_s": None if server_cpu is None else round(server_cpu, 2),
    }


def _write_model(model: Path, total: int, files: int) -> int:
    """Config, tokenizer, index and ``files`` shards of ``total`` bytes in all (each a
    safetensors header, then random bytes); returns the shards' size."""
    model.mkdir(parents=True)
    (model / "config.json").write_text('{"model_type": "bench"}')
    (model / "tokenizer.json").write_text('{"version": "1.0"}' * 1000)
    weight_map: dict[str, str] = {}
    written = 0
    for i in range(files):
        name = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        size = total // files + (total % files if i == files - 1 else 0)
        header = _safetensors_header(f"layers.{i}.weight", size)
        weight_map[f"layers.{i}.weight"] = name
        with (model / name).open("wb") as f:
            f.write(header)
            left = size - len(header)
            while left > 0:
                block = os.urandom(min(MB, left))
                f.write(block)
                left -= len(block)
        written += size
    (model / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": written}, "weight_map": weight_map}))
    return written


def _safetensors_header(tensor: str, file_size: int) -> bytes:
    """A safetensors header (length, JSON padded to 8 bytes) for one U8 tensor filling the
    rest of a ``file_size``-byte file."""
    def encoded(data_len: int) -> bytes:
        meta = {tensor: {"dtype": "U8", "shape": [data_len], "data_offsets": [0, data_len]}}
        text = json.dumps(meta).encode()
        return text + b" " * (-len(text) % 8)

    guess = encoded(file_size)  # the data length only shrinks: the header only fits better
    body = encoded(file_size - 8 - len(guess))
    body += b" " * (len(guess) - len(body))
    return struct.pack("<Q", len(body)) + body


def _instrument() -> Counter[str]:
    """Count the download functions the hub calls: which path a file took."""
    calls: Counter[str] = Counter()
    lock = threading.Lock()

    def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)  # keeps the signature the hub inspects (hf_transfer's callback)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with lock:
                calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    from huggingface_hub import file_download

    for name in ("http_get", "xet_get"):
        if hasattr(file_download, name):
            setattr(file_download, name, counted(name, getattr(file_download, name)))
    try:
        import hf_transfer
    except ImportError:
        pass
    else:
        hf_transfer.download = counted("hf_transfer.download", hf_transfer.download)
    return calls


def _prime(url: str, token: str, model: Path) -> None:
    """HEAD every file once before the runs: the server hashes a file for its ETag on the
    first HEAD (~0.15 s per 256 MB here), a cost of the local server that the Hub does not
    have and that would land on the first run only."""
    for path in sorted(model.iterdir()):
        request = urllib.request.Request(f"{url}/{REPO}/resolve/main/{path.name}",
                                         method="HEAD",
                                         headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(request, timeout=60) as answer:
            answer.read()


def _peak(records: Iterable[dict[str, Any]]) -> int:
    """The most requests in flight at once (an end before a start at the same instant)."""
    events = sorted(e for r in records for e in ((r["at"], 1), (r["ended_at"], -1)))
    peak = current = 0
    for _when, step in events:
        current += step
        peak = max(peak, current)
    return peak


def _settled_lines(path: Path) -> int:
    """Lines in the log once it stops growing: a request is logged when its answer is
    complete, which may be a moment after the client has it."""
    count, quiet = _count(path), 0
    while quiet < 3:
        time.sleep(0.1)
        now = _count(path)
        quiet, count = (quiet + 1, count) if now == count else (0, now)
    return count


def _count(path: Path) -> int:
    if not path.exists():
        return 0
    with path.open() as f:
        return sum(1 for _ in f)


def _records(path: Path, seen: int) -> list[dict[str, Any]]:
    total = _settled_lines(path)
    with path.open() as f:
        return [json.loads(line) for i, line in enumerate(f) if seen <= i < total]


def _cpu_of(pid: int) -> float | None:
    """User plus system CPU seconds of process ``pid`` (Linux), else None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


if __name__ == "__main__":
    main()

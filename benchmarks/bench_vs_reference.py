"""flash-bootstrap against the plain-script bootstrap it replaces, side by side (issue 16).

The same payload is run by ``python -m fsm run`` (ours) and by the reference script
(``/work/shared/reference/instance_bootstrap_v0.2.25.py``, run unchanged through
``benchmarks/reference_wrapper.py``, which points its fixed paths at the run's directory),
one after the other, A B A B, against the project's local Hub server, both with the
interpreter running this benchmark. Run it once per hub line::

    /work/venv/bin/python benchmarks/bench_vs_reference.py     # huggingface_hub 2.x
    /work/venv0/bin/python benchmarks/bench_vs_reference.py    # 0.x + hf_transfer

Paths (``--paths``, all by default):

* ``inline``: the job spec in the payload;
* ``spilled``: ``job_spec_in_hf: true``, the spec (``--spilled-kb``) at
  ``<hf_prefix>/job_spec.json``;
* ``extras``: ``extra_pip: ["--index-url", <local index>, "bench-extra-a==1.0",
  "bench-extra-b==1.0"]``, two wheels built by ``tests/pypi_server.py`` and served by its
  ``PypiServer`` (answering HEAD with 405, as the uv tests' index does): an option both
  runners accept (the reference hands it to pip as it is).
  So that neither installs into the benchmark's own venv, each run gets a fresh overlay
  venv (``venv --without-pip``, the benchmark interpreter's site-packages added by a
  ``.pth``, ``uv`` linked beside its python when the benchmark's venv has one), and both
  runners and their workers run its python: pip (or uv, which ours prefers when it is
  there and pip is not configured: ``--ours-installer`` sets ``FLASH_INSTALLER``) installs
  into it. The worker reports the versions it imports: both must be 1.0. The output names
  the installer ours chose, from its log;
* ``preload``: ``mode: preload`` of two small model repos (``--model-kb`` of weights each,
  plus config, tokenizer and a ``*.pth`` both skip) into a mounted cache
  (``HF_HOME=<mount>/hf-cache``, ``cache_mount_marker`` present). No worker.

Every run has a directory of its own and a fresh Hub server (the same repo content for
every run: code tree of ``--code-files`` files, models, spilled spec), a fresh ``HF_HOME``
and ``XDG_CACHE_HOME`` (pip's and uv's caches start cold, as on a fresh host), and an empty
``XDG_CONFIG_HOME`` and ``XDG_CONFIG_DIRS`` (a developer's pip.conf, its mirrors and
constraints, configures neither runner's pip; ``/etc/pip.conf`` is still read: one that
sets more than transport options makes ours choose pip over uv on ``auto``). The child
environment drops the caller's ``HF_*``, ``FLASH_*``, ``PIP_*``, ``UV_*`` and
``PYTHONPATH`` (``--tree`` sets it for ours) and sets ``HF_ENDPOINT`` to the server (the
reference reaches the Hub only through it; ours is given ``--store <url>`` too).
``--bytecode cached`` (the default) gives the children one
bytecode cache under the work directory (``PYTHONPYCACHEPREFIX``, with
``PYTHONDONTWRITEBYTECODE`` dropped), filled by the warm-up round, as the packages of an
image are compiled at install: without it, in an environment that sets
``PYTHONDONTWRITEBYTECODE`` and never wrote the project's ``__pycache__``, ours compiles
the whole runner at every start. The reference script is compiled at every start either
way, as a script run directly is.

The fake worker (``code/flash/engine/worker/__main__.py`` in the repo) records
``time.time()`` and ``time.monotonic()`` as its first instruction into the file named by
``BENCH_WORKER_START_FILE`` (payload env), writes ``$FLASH_SCRATCH_DIR/metrics.json``,
uploads ``metrics.json`` and ``DONE`` through ``huggingface_hub`` to ``HF_ENDPOINT`` with
``HF_TOKEN``, and writes its own CPU time to ``BENCH_WORKER_END_FILE``.

Per path and runner, medians of ``--rounds`` rounds (after ``--warmup`` discarded rounds):

* ``start->worker``: from just before the runner is spawned to the worker's first
  instruction (the server's clock and the worker's are both ``CLOCK_MONOTONIC``);
* ``start->exit``: to the runner's exit;
* ``cpu all``: ``getrusage(RUSAGE_CHILDREN)`` user+system delta around the runner: the
  runner, the installer and the worker; ``cpu runner``: that less the worker's own;
* Hub requests by kind (``api``/``resolver``/``commit``, from the server's records) that
  arrived before the worker's first instruction, and in all (the worker's two uploads
  included, for both runners alike);

with the ratio ours/reference. A run counts only when it exited 0 with an ``ok`` marker
and its path's evidence (worker started, DONE uploaded, the extras imported at 1.0, the
models in ``preload_result.json``); the table says how many did. Prints an aligned table
and one JSON line. ``--timeline`` also prints, for each counted run, the Hub requests (the
server's request log) and ours' log events in milliseconds from the spawn: where the time
of an attempt goes, request by request and state by state. ``--tree DIR`` runs ours from
another checkout (``git worktree add /tmp/before <rev>``) against this one's server, to
compare before and after on equal terms.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import importlib.util
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from fsm.testing import LocalHubServer
from fsm.testing.hubserver import RequestRecord

HERE = Path(__file__).resolve().parent
PROJECT_ROOT = HERE.parent
WRAPPER = HERE / "reference_wrapper.py"
REFERENCE = Path("/work/shared/reference/instance_bootstrap_v0.2.25.py")
TOKEN = "hf_bench_vs_reference_0123456789"
REPO = "org/flash-runs"
ARM = "lambda"
PHASE = "sft"
MODELS = ("org/bench-model-a", "org/bench-model-b")
SENTINEL = ".flash-cache-mounted"
EXTRAS = (("bench-extra-a", "1.0"), ("bench-extra-b", "1.0"))
PATHS = ("inline", "spilled", "extras", "preload")
RUNNERS = ("ours", "reference")
KINDS = ("api", "resolver", "commit")

WORKER = """\
import time
T0, M0 = time.time(), time.monotonic()
import json, os
from pathlib import Path

Path(os.environ["BENCH_WORKER_START_FILE"]).write_text(
    json.dumps({"time": T0, "monotonic": M0, "pid": os.getpid()}))
spec = os.environ.get("FLASH_JOB_SPEC_JSON")
if spec is None:
    spec = Path(os.environ["FLASH_JOB_SPEC_PATH"]).read_text()
prefix = json.loads(spec)["hf_prefix"]
extras = {}
for name in filter(None, os.environ.get("BENCH_EXPECT_EXTRAS", "").split(",")):
    import importlib.metadata
    extras[name] = importlib.metadata.version(name)
metrics = Path(os.environ.get("FLASH_SCRATCH_DIR") or "/tmp") / "metrics.json"
metrics.write_text(json.dumps({"loss": 0.0, "extras": extras}))
from huggingface_hub import HfApi
api = HfApi(endpoint=os.environ["HF_ENDPOINT"], token=os.environ["HF_TOKEN"])
for name, data in (("metrics.json", metrics.read_bytes()), ("DONE", repr(time.time()).encode())):
    api.upload_file(path_or_fileobj=data, path_in_repo=prefix + "/" + name,
                    repo_id=os.environ["BENCH_REPO"], repo_type="dataset")
cpu = os.times()
Path(os.environ["BENCH_WORKER_END_FILE"]).write_text(json.dumps({
    "cpu_s": cpu.user + cpu.system + cpu.children_user + cpu.children_system,
    "extras": extras}))
"""


def _pypi_server() -> ModuleType:
    """``tests/pypi_server.py`` (the test suite's local index), loaded by path."""
    spec = importlib.util.spec_from_file_location(
        "bench_pypi_server", PROJECT_ROOT / "tests" / "pypi_server.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass
class Run:
    """One runner's run of one path."""

    runner: str
    path: str
    round: int
    exit_code: int | None = None
    ok: bool = False
    why: str = ""
    start_to_worker_s: float | None = None
    start_to_exit_s: float = 0.0
    cpu_s: float = 0.0
    worker_cpu_s: float | None = None
    requests_pre: dict[str, int] = field(default_factory=dict)
    requests_all: dict[str, int] = field(default_factory=dict)
    extras: dict[str, str] | None = None
    installer: str | None = None  # ours: the installer it chose, from its log
    timeline: list[str] = field(default_factory=list)  # --timeline: where the time went

    @property
    def runner_cpu_s(self) -> float:
        return self.cpu_s - (self.worker_cpu_s or 0.0)


@dataclass
class Setup:
    """What every run of the benchmark shares."""

    args: argparse.Namespace
    work: Path
    index_url: str | None = None
    failed: int = 0


# --- one run ------------------------------------------------------------------------------


def _spec(prefix: str, pad_bytes: int) -> str:
    spec: dict[str, Any] = {"hf_prefix": prefix, "phase": PHASE, "lr": 1e-4}
    if pad_bytes:
        spec["params"] = "x" * pad_bytes
    return json.dumps(spec)


def _fill_hub(hub: LocalHubServer, path: str, prefix: str, args: argparse.Namespace) -> None:
    hub.create_repo(REPO)
    hub.add_file(REPO, "code/flash/engine/worker/__main__.py", WORKER)
    for package in ("flash", "flash/engine", "flash/engine/worker"):
        hub.add_file(REPO, f"code/{package}/__init__.py", "")
    for i in range(max(0, args.code_files - 4)):
        hub.add_file(REPO, f"code/flash/lib/mod{i}.py", f"X = {i}\n" + "# pad\n" * 200)
    if path == "spilled":
        hub.add_file(REPO, f"{prefix}/job_spec.json", _spec(prefix, args.spilled_kb * 1024))
    if path == "preload":
        for n, model in enumerate(MODELS):
            hub.create_repo(model, "model")
            hub.add_file(model, "config.json", json.dumps({"model_type": "bench", "n": n}),
                         "model")
            hub.add_file(model, "tokenizer.json", json.dumps({"vocab": list(range(500))}),
                         "model")
            hub.add_file(model, "model.safetensors", os.urandom(args.model_kb * 1024), "model")
            hub.add_file(model, "original/consolidated.pth", b"skipped by both", "model")


def _payload(path: str, prefix: str, run_dir: Path, hub: LocalHubServer, setup: Setup,
             run_id: str) -> dict[str, Any]:
    env = {"HF_TOKEN": TOKEN, "HF_ENDPOINT": hub.url, "BENCH_REPO": REPO,
           "BENCH_WORKER_START_FILE": str(run_dir / "worker_start.json"),
           "BENCH_WORKER_END_FILE": str(run_dir / "worker_end.json")}
    payload: dict[str, Any] = {
        "hf_repo": REPO, "hf_prefix": prefix, "flash_arm": ARM, "attempt": 0,
        "run_id": run_id, "max_wall_s": setup.args.timeout_s, "env": env,
    }
    if path == "preload":
        mount = run_dir / "mnt"
        mount.mkdir()
        (mount / SENTINEL).write_text("")
        env["HF_HOME"] = str(mount / "hf-cache")
        return payload | {"mode": "preload", "models": list(MODELS),
                          "cache_mount_marker": SENTINEL}
    payload |= {"phase": PHASE, "seed": 0}
    if path == "spilled":
        payload["job_spec_in_hf"] = True
    else:
        payload["job_spec_json"] = _spec(prefix, 0)
    if path == "extras":
        assert setup.index_url is not None
        payload["extra_pip"] = ["--index-url", setup.index_url,
                                *(f"{name}=={version}" for name, version in EXTRAS)]
        env["BENCH_EXPECT_EXTRAS"] = ",".join(name for name, _ in EXTRAS)
        if setup.args.ours_installer != "auto":
            env["FLASH_INSTALLER"] = setup.args.ours_installer
    return payload


def _overlay_venv(where: Path) -> Path:
    """A fresh venv whose python sees the benchmark's site-packages (fsm, huggingface_hub,
    pip) through a ``.pth``, and installs into its own: its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    python = where / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True).stdout.strip()
    base = sysconfig.get_paths()["purelib"]
    Path(purelib, "_bench_base.pth").write_text(f"import site; site.addsitedir({base!r})\n")
    uv = Path(sys.executable).parent / "uv"
    if uv.is_file():
        (where / "bin" / "uv").symlink_to(uv)
    return python


def _child_env(run_dir: Path, hub_url: str, setup: Setup) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HF_", "FLASH_", "PIP_", "UV_", "BENCH_")) and k != "PYTHONPATH"}
    env |= {"HF_ENDPOINT": hub_url, "HF_HOME": str(run_dir / "hf-home"),
            "HF_HUB_DISABLE_TELEMETRY": "1", "XDG_CACHE_HOME": str(run_dir / "cache"),
            "XDG_CONFIG_HOME": str(run_dir / "config"),
            "XDG_CONFIG_DIRS": str(run_dir / "config")}
    if setup.args.bytecode == "cached":
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(setup.work / "pycache")
    return env


def _kill(proc: subprocess.Popen[bytes], run_dir: Path) -> None:
    """End a runner (its process group) and its worker, by their ids (the timeout)."""
    if proc.returncode is not None:
        return
    print(f"timeout: killing {proc.pid} ({run_dir})", file=sys.stderr, flush=True)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(OSError, ValueError, KeyError):
        pid = int(json.loads((run_dir / "worker_start.json").read_text())["pid"])
        if b"flash.engine.worker" in Path(f"/proc/{pid}/cmdline").read_bytes():
            os.kill(pid, signal.SIGKILL)


def _installer(log: Path) -> str | None:
    """The installer ours chose and why, from its ``pip.installer`` log line."""
    for line in log.read_text(errors="replace").splitlines():
        if '"pip.installer"' in line:
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                return f"{event.get('installer')} ({event.get('reason')})"
    return None


def _timeline(records: list[RequestRecord], started: float, worker_at: float | None,
              exit_s: float, stderr: Path) -> list[str]:
    """Every Hub request (kind, method, path, duration) and, for ours, every log event, in
    milliseconds from the spawn: where an attempt's time goes, in order."""
    offset = time.time() - time.monotonic()  # the log's wall clock onto the monotonic one
    rows: list[tuple[float, str]] = [
        (r.at - started, f"{r.kind or 'other':8} {r.method:4} {r.path[:90]} "
                         f"({1000 * ((r.ended_at or r.at) - r.at):.1f} ms)")
        for r in records]
    if worker_at is not None:
        rows.append((worker_at - started, "-------- the worker's first instruction"))
    rows.append((exit_s, "-------- the runner exited"))
    for line in stderr.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
            event = json.loads(line)
            stamp = datetime.datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00"))
            what = event.get("msg", "?") + (f" -> {event['to']}" if "to" in event else "")
            if str(event.get("msg", "")).startswith("hub.import_"):
                # logged once logging is up; ``at`` is when it happened (epoch seconds)
                if event.get("import_seconds") is not None:
                    what += f" (import {1000 * event['import_seconds']:.0f} ms)"
                rows.append((event["at"] - offset - started, f"agent    {what}"))
                continue
            rows.append((stamp.timestamp() - offset - started, f"log      {what}"))
    return [f"{1000 * at:8.1f} ms  {text}" for at, text in sorted(rows)]


def _cpu_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _check(run: Run, run_dir: Path, hub: LocalHubServer, prefix: str) -> str:
    """Why the run does not count, or "" when it does."""
    if run.exit_code != 0:
        return f"exit {run.exit_code}"
    repo = hub.repo_dir(REPO)
    try:
        marker = json.loads((repo / prefix / f"{ARM}_attempt0.json").read_text())
    except (OSError, ValueError):
        return "no marker"
    if marker.get("ok") is not True:
        return f"marker not ok: {str(marker.get('error'))[:120]}"
    if run.path == "preload":
        try:
            result = json.loads((repo / prefix / "preload_result.json").read_text())
        except (OSError, ValueError):
            return "no preload_result.json"
        if sorted(result.get("preloaded", [])) != sorted(MODELS):
            return f"preload_result: {result}"
        return ""
    if run.start_to_worker_s is None:
        return "worker never started"
    if not (repo / prefix / "DONE").is_file():
        return "no DONE"
    if run.path == "extras" and run.extras != dict(EXTRAS):
        return f"extras seen by the worker: {run.extras}"
    return ""


def run_one(setup: Setup, runner: str, path: str, rnd: int) -> Run:
    args = setup.args
    run_dir = setup.work / path / f"{rnd:02d}-{runner}"
    for sub in ("flash", "runcode", "tmp", "hf-home", "cache", "config"):
        (run_dir / sub).mkdir(parents=True)
    prefix = f"bench/{path}/{runner}/r{rnd}"
    run = Run(runner, path, rnd)
    with LocalHubServer(run_dir / "hub", token=TOKEN) as hub:
        _fill_hub(hub, path, prefix, args)
        payload = _payload(path, prefix, run_dir, hub, setup, f"bench-{path}-{runner}-{rnd}")
        payload_file = run_dir / "flash" / "payload.json"
        payload_file.write_text(json.dumps(payload))
        python = _overlay_venv(run_dir / "venv") if path == "extras" else Path(sys.executable)
        env = _child_env(run_dir, hub.url, setup)
        if runner == "ours" and args.tree is not None:
            env["PYTHONPATH"] = str(args.tree)  # ahead of the installed (editable) runner
        if runner == "ours":
            argv = [str(python), "-m", "fsm", "run", "--payload", str(payload_file),
                    "--store", hub.url, "--code-root", str(run_dir / "runcode"),
                    "--scratch-dir", str(run_dir / "tmp")]
        else:
            argv = [str(python), str(WRAPPER), str(args.reference)]
            env["BENCH_REF_ROOT"] = str(run_dir)
        hub.clear_requests()
        with (run_dir / "stdout.txt").open("wb") as out, \
                (run_dir / "stderr.txt").open("wb") as err:
            cpu_before = _cpu_children()
            started = time.monotonic()
            proc = subprocess.Popen(argv, cwd=run_dir, env=env, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=err, start_new_session=True)
            # a blocking wait: Popen.wait(timeout=...) polls, in sleeps of up to 50 ms
            timer = threading.Timer(args.timeout_s + 60, _kill, (proc, run_dir))
            timer.start()
            code = proc.wait()
            ended = time.monotonic()
            timer.cancel()
            run.exit_code = None if code < 0 else code
            cpu_after = _cpu_children()
        run.start_to_exit_s = ended - started
        run.cpu_s = cpu_after - cpu_before
        with contextlib.suppress(OSError, ValueError):
            worker = json.loads((run_dir / "worker_start.json").read_text())
            run.start_to_worker_s = float(worker["monotonic"]) - started
        with contextlib.suppress(OSError, ValueError):
            end = json.loads((run_dir / "worker_end.json").read_text())
            run.worker_cpu_s = float(end["cpu_s"])
            run.extras = end.get("extras") or None
        records = hub.requests
        worker_at = (None if run.start_to_worker_s is None
                     else started + run.start_to_worker_s)
        every: Counter[str] = Counter(r.kind or "other" for r in records)
        pre: Counter[str] = Counter(r.kind or "other" for r in records
                                    if worker_at is None or r.at < worker_at)
        run.requests_all = {k: every[k] for k in (*KINDS, "other")}
        run.requests_pre = {k: pre[k] for k in (*KINDS, "other")}
        if runner == "ours" and path == "extras":
            run.installer = _installer(run_dir / "stderr.txt")
        if args.timeline:
            run.timeline = _timeline(records, started, worker_at, run.start_to_exit_s,
                                     run_dir / "stderr.txt")
        run.why = _check(run, run_dir, hub, prefix)
        run.ok = not run.why
    if not run.ok:
        setup.failed += 1
        lines = (run_dir / "stderr.txt").read_text(errors="replace").strip().splitlines()
        run.why += f" (stderr: {lines[-1][:200] if lines else '-'}; kept in {run_dir})"
    elif not args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    return run


# --- figures ------------------------------------------------------------------------------


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(runs: list[Run]) -> dict[str, Any]:
    good = [r for r in runs if r.ok]
    worker = [r.start_to_worker_s for r in good if r.start_to_worker_s is not None]
    return {
        "ok": len(good), "n": len(runs),
        "start_to_worker_s": _median(worker),
        "start_to_exit_s": _median([r.start_to_exit_s for r in good]),
        "cpu_s": _median([r.cpu_s for r in good]),
        "runner_cpu_s": _median([r.runner_cpu_s for r in good]),
        "requests_pre_worker": {k: _median([float(r.requests_pre[k]) for r in good])
                                for k in KINDS} if worker else None,
        "requests_all": {k: _median([float(r.requests_all[k]) for r in good]) for k in KINDS},
        "start_to_worker_runs_s": [round(v, 4) for v in worker],
        "start_to_exit_runs_s": [round(r.start_to_exit_s, 4) for r in good],
        "failures": [r.why for r in runs if not r.ok],
        "installers": dict(Counter(r.installer for r in runs if r.installer)),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _total(counts: dict[str, float | None] | None) -> float | None:
    if counts is None or any(v is None for v in counts.values()):
        return None
    return sum(v for v in counts.values() if v is not None)


def ratios(ours: dict[str, Any], ref: dict[str, Any]) -> dict[str, float | None]:
    out = {key: _ratio(ours[key], ref[key])
           for key in ("start_to_worker_s", "start_to_exit_s", "cpu_s", "runner_cpu_s")}
    out["requests_pre_worker"] = _ratio(_total(ours["requests_pre_worker"]),
                                        _total(ref["requests_pre_worker"]))
    out["requests_all"] = _ratio(_total(ours["requests_all"]), _total(ref["requests_all"]))
    return out


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _req(counts: dict[str, float | None] | None) -> str:
    if counts is None:
        return "-"
    return "/".join("-" if v is None else f"{v:g}" for v in counts.values())


HEADER = (f"{'path':8} {'runner':10} {'start->worker s':>15} {'start->exit s':>13} "
          f"{'cpu all s':>9} {'cpu runner s':>12} {'req pre-worker':>14} {'req all':>9} "
          f"{'ok':>5}")


def table(figures: dict[str, dict[str, Any]]) -> list[str]:
    lines = [HEADER, "-" * len(HEADER)]
    for path, fig in figures.items():
        for runner in RUNNERS:
            f = fig[runner]
            lines.append(
                f"{path:8} {runner:10} {_s(f['start_to_worker_s']):>15} "
                f"{_s(f['start_to_exit_s']):>13} {_s(f['cpu_s']):>9} "
                f"{_s(f['runner_cpu_s']):>12} {_req(f['requests_pre_worker']):>14} "
                f"{_req(f['requests_all']):>9} {f['ok']:>2}/{f['n']:<2}")
        r = fig["ratio"]
        lines.append(
            f"{path:8} {'ours/ref':10} {_x(r['start_to_worker_s']):>15} "
            f"{_x(r['start_to_exit_s']):>13} {_x(r['cpu_s']):>9} {_x(r['runner_cpu_s']):>12} "
            f"{_x(r['requests_pre_worker']):>14} {_x(r['requests_all']):>9}")
    return lines


# --- main ---------------------------------------------------------------------------------


def _versions() -> dict[str, Any]:
    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {
        "python": sys.executable,
        "huggingface_hub": version("huggingface_hub"),
        "hf_transfer": version("hf_transfer"),
        "hf_xet": version("hf_xet"),
        "pip": version("pip"),
        "uv": version("uv") if (Path(sys.executable).parent / "uv").is_file() else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="counted rounds per path [5]")
    parser.add_argument("--warmup", type=int, default=1,
                        help="rounds per path run first and discarded [1]")
    parser.add_argument("--paths", default=",".join(PATHS),
                        help=f"comma list of {', '.join(PATHS)} [all]")
    parser.add_argument("--label", help="names the run in the output [the hub version]")
    parser.add_argument("--reference", type=Path, default=REFERENCE,
                        help=f"the reference script [{REFERENCE}]")
    parser.add_argument("--code-files", type=int, default=8,
                        help="files under code/ in the repo, the worker included [8]")
    parser.add_argument("--spilled-kb", type=int, default=48,
                        help="size of the spilled spec [48]")
    parser.add_argument("--model-kb", type=int, default=512,
                        help="weights per preloaded model [512]")
    parser.add_argument("--timeout-s", type=float, default=300.0,
                        help="each run's max_wall_s (killed 60 s later) [300]")
    parser.add_argument("--ours-installer", choices=["auto", "pip", "uv"], default="auto",
                        help="extras: FLASH_INSTALLER in the payload env (the reference "
                             "ignores it; auto leaves it unset) [auto]")
    parser.add_argument("--bytecode", choices=["cached", "inherit"], default="cached",
                        help="cached: the children share a bytecode cache under the work dir "
                             "(PYTHONPYCACHEPREFIX; PYTHONDONTWRITEBYTECODE dropped), filled "
                             "by the warm-up, as an image's installed packages are compiled; "
                             "inherit: the caller's settings [cached]")
    parser.add_argument("--keep", action="store_true", help="keep every run's directory")
    parser.add_argument("--tree", type=Path,
                        help="run ours from this checkout (e.g. a git worktree of an older "
                             "commit), against the same server: before and after")
    parser.add_argument("--timeline", action="store_true",
                        help="print each counted run's Hub requests and log events, in ms "
                             "from the spawn (the server's request log, timestamped)")
    args = parser.parse_args()
    paths = [p for p in args.paths.split(",") if p]
    unknown = sorted(set(paths) - set(PATHS))
    if unknown:
        parser.error(f"unknown paths: {', '.join(unknown)}")
    if not args.reference.is_file():
        parser.error(f"no reference script at {args.reference}")
    versions = _versions()
    accel = ("hf_transfer " + versions["hf_transfer"] if versions["hf_transfer"]
             else "hf_xet " + str(versions["hf_xet"]) if versions["hf_xet"] else "no accelerator")
    label = args.label or f"huggingface_hub {versions['huggingface_hub']} ({accel})"
    work = Path(tempfile.mkdtemp(prefix="bench-vs-ref-"))
    setup = Setup(args, work)
    figures: dict[str, dict[str, Any]] = {}
    print(f"[{label}] {sys.executable}; {args.rounds} rounds + {args.warmup} warm-up per path, "
          f"A B A B; work dir {work}", file=sys.stderr, flush=True)
    try:
        with contextlib.ExitStack() as stack:
            if "extras" in paths:
                pypi = _pypi_server()
                wheel_dir = work / "wheels"
                wheel_dir.mkdir()
                wheels = [pypi.build_wheel(wheel_dir, name, version) for name, version in EXTRAS]
                index = stack.enter_context(pypi.PypiServer(wheels))
                setup.index_url = str(index.url)
            for path in paths:
                runs: dict[str, list[Run]] = {runner: [] for runner in RUNNERS}
                for rnd in range(args.warmup + args.rounds):
                    for runner in RUNNERS:
                        run = run_one(setup, runner, path, rnd)
                        counted = rnd >= args.warmup
                        print(f"[{label}] {path} {runner} round {rnd}"
                              f"{'' if counted else ' (warm-up)'}: worker "
                              f"{_s(run.start_to_worker_s)} s, exit {_s(run.start_to_exit_s)} s"
                              f"{'' if run.ok else ', FAILED ' + run.why}",
                              file=sys.stderr, flush=True)
                        if counted:
                            runs[runner].append(run)
                        if counted and run.timeline:
                            print("\n".join(run.timeline), file=sys.stderr, flush=True)
                ours, ref = summarize(runs["ours"]), summarize(runs["reference"])
                figures[path] = {"ours": ours, "reference": ref, "ratio": ratios(ours, ref)}
    finally:
        if not args.keep and not setup.failed:
            shutil.rmtree(work, ignore_errors=True)
    print(f"flash-bootstrap vs {args.reference.name}: {label}")
    print(f"python {sys.executable}; medians of {args.rounds} rounds, A B A B; bytecode "
          f"{args.bytecode}; requests api/resolver/commit")
    for line in table(figures):
        print(line)
    if "extras" in figures:
        for installer, n in figures["extras"]["ours"]["installers"].items():
            print(f"extras: ours installed with {installer}: {n} run(s); the reference: pip")
    print(json.dumps({"bench": "vs_reference", "label": label, **versions,
                      "reference": str(args.reference), "rounds": args.rounds,
                      "warmup": args.warmup, "code_files": args.code_files,
                      "spilled_kb": args.spilled_kb, "model_kb": args.model_kb,
                      "ours_installer": args.ours_installer, "bytecode": args.bytecode,
                      "paths": figures}))


if __name__ == "__main__":
    main()

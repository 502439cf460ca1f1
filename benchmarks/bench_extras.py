"""Benchmark: InstallExtras with pip against uv, cold cache and warm, from a local index.

    python benchmarks/bench_extras.py [--rounds 5] [--big-mb 50] [--latency-ms 0]
                                      [--bandwidth-mbps 0] [--json]

A realistic ``extra_pip``: one requirement (``benchapp``) that pulls in 15 pure-Python
projects depending on one another (three releases each, version ranges to resolve,
10 to 300 modules apiece, about 13 MB unpacked) and one 50 MB wheel, served by the test
suite's PEP 503 index (``tests/pypi_server.py``) on 127.0.0.1, optionally behind its
latency and bandwidth emulation. Each timed run installs the set into a fresh virtual
environment's interpreter through the runner's own code (``fsm.extras.installer.install`` with
``FLASH_INSTALLER=pip`` or ``uv``: supervised, classified, as InstallExtras runs it), the
installer isolated from this machine's configuration. Cold: an empty cache. Warm: a cache
filled by one untimed install of the same set. pip and uv alternate within each round
(pip, uv, then uv, pip in the next), so drift of the machine touches both alike.

Prints a table (or one JSON object with ``--json``): per installer and cache the median,
min and max seconds of the timed install, and uv's time as a fraction of pip's (the median
of the per-round ratios). The virtual environments are made outside the timing; pip's
come with the runner's own pip release (a wheel fetched once with ``pip download``,
falling back to the interpreter's bundled pip when that fails).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from pypi_server import PypiServer, build_wheel  # noqa: E402

from fsm.clock import Deadline  # noqa: E402
from fsm.extras.installer import find_uv, install  # noqa: E402
from fsm.interrupt import InterruptFlag  # noqa: E402
from fsm.testing.hubserver import Network  # noqa: E402

#: The projects (name, modules, KiB of source per module, requirements). Three releases
#: of each (1.0, 1.1, 2.0); requirements name ranges, so the resolvers have work to do.
PROJECTS: tuple[tuple[str, int, int, tuple[str, ...]], ...] = (
    ("benchtyping", 10, 8, ()),
    ("benchidna", 12, 12, ()),
    ("benchcerts", 4, 40, ()),
    ("benchcharset", 30, 6, ()),
    ("benchurls", 45, 6, ("benchidna>=1.0",)),
    ("benchhttp", 25, 8, ("benchurls>=1.1,<3", "benchcerts", "benchcharset>=1.0",
                          "benchidna")),
    ("benchyaml", 20, 10, ()),
    ("benchtqdm", 35, 4, ()),
    ("benchfilelock", 8, 4, ("benchtyping",)),
    ("benchpackaging", 18, 8, ("benchtyping>=1.1",)),
    ("benchfsspec", 120, 6, ("benchfilelock>=1.0",)),
    ("benchhub", 90, 8, ("benchhttp>=1.1", "benchyaml>=1.0", "benchtqdm", "benchfilelock",
                         "benchfsspec>=1.1", "benchpackaging", "benchtyping")),
    ("benchjinja", 40, 10, ("benchmarkup>=1.0",)),
    ("benchmarkup", 10, 6, ()),
    ("benchmodels", 300, 12, ("benchhub>=1.1,<3", "benchpackaging>=1.0", "benchjinja",
                              "benchyaml")),
)
VERSIONS = ("1.0", "1.1", "2.0")
BIG = "benchweights"
APP = "benchapp"


def wheel(directory: Path, name: str, version: str, modules: int, kib: int,
          requires: Sequence[str]) -> Path:
    """A pure-Python wheel of ``modules`` modules of about ``kib`` KiB of Python each in a
    package ``<name>``, its METADATA naming ``requires`` (what ``build_wheel`` lacks)."""
    rng = random.Random(f"{name}-{version}")
    info = f"{name}-{version}.dist-info"
    files: dict[str, bytes] = {f"{name}/__init__.py": f'VERSION = "{version}"\n'.encode()}
    for i in range(modules):
        lines = []
        while sum(map(len, lines)) < kib * 1024:
            fn = f"f_{rng.getrandbits(32):08x}"
            lines.append(f"def {fn}(x, y={rng.randint(0, 999)}):\n"
                         f"    '''Return {fn} of x.'''\n"
                         f"    return [x * y + k for k in range({rng.randint(1, 50)})]\n\n")
        files[f"{name}/m{i:03d}.py"] = "".join(lines).encode()
    files[f"{info}/METADATA"] = (
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        + "".join(f"Requires-Dist: {r}\n" for r in requires)
    ).encode()
    files[f"{info}/WHEEL"] = (b"Wheel-Version: 1.0\nGenerator: bench_extras\n"
                              b"Root-Is-Purelib: true\nTag: py3-none-any\n")

    def digest(data: bytes) -> str:
        return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()

    record = [f"{path},sha256={digest(data)},{len(data)}" for path, data in files.items()]
    files[f"{info}/RECORD"] = ("\n".join([*record, f"{info}/RECORD,,"]) + "\n").encode()
    path = directory / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name_in_zip, data in files.items():
            zf.writestr(name_in_zip, data)
    return path


def build_set(directory: Path, big_mb: int) -> list[Path]:
    wheels = [wheel(directory, name, version, modules, kib, requires)
              for name, modules, kib, requires in PROJECTS for version in VERSIONS]
    wheels.append(build_wheel(directory, BIG, "1.0", payload=os.urandom(big_mb << 20)))
    every = [name for name, *_ in PROJECTS]
    for version in VERSIONS:
        wheels.append(wheel(directory, APP, version, 3, 2, [*every, BIG]))
    return wheels


class Index(PypiServer):
    """The test suite's index, quiet about clients that hang up mid-body (uv stops reading
    a wheel once it has what it needs)."""

    def __enter__(self) -> Index:
        self._httpd.handle_error = lambda request, client_address: None  # type: ignore[method-assign]
        super().__enter__()
        return self


def pip_wheel(tmp: Path) -> Path | None:
    """This interpreter's pip release as a wheel (fetched once), or None."""
    import pip

    got = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
         "--disable-pip-version-check", "-q", "-d", str(tmp), f"pip=={pip.__version__}"],
        capture_output=True, check=False,
    )
    found = sorted(tmp.glob("pip-*.whl"))
    return found[0] if got.returncode == 0 and found else None


def fresh_venv(path: Path, *, with_pip: Path | None, uv: str, seed: bool) -> Path:
    """A new virtual environment; with ``seed``, pip in it (from ``with_pip`` by uv, or
    the bundled one). Its interpreter."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    python = path / "bin" / "python"
    if seed and with_pip is not None:
        subprocess.run([uv, "pip", "install", "-q", "--no-config", "--python", str(python),
                        "--no-index", str(with_pip)], check=True,
                       env={**os.environ, "UV_CACHE_DIR": str(path.parent / "seed-cache")})
    elif seed:
        subprocess.run([str(python), "-m", "ensurepip", "-q"], check=True)
    return python


def isolated_env(home: Path, cache: Path, installer: str) -> dict[str, str]:
    """The installer's environment: no configuration of this machine, its own cache."""
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "XDG_CONFIG_DIRS": str(home / "xdg"),  # not /etc/xdg/pip
        "FLASH_INSTALLER": installer,
        "PIP_CACHE_DIR": str(cache),
        "UV_CACHE_DIR": str(cache),
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }


@contextmanager
def quiet_logs() -> Iterator[None]:
    """The runner's log events (pip.try, uv.started, ...) left out of the report."""
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    try:
        yield
    finally:
        structlog.reset_defaults()


def timed_install(python: Path, env: dict[str, str], url: str, log: Path) -> float:
    started = time.perf_counter()
    install(["--index-url", url, APP], env=env, deadline=Deadline.after(900),
            interrupt=InterruptFlag(), python=str(python), tries=1, output_log=log)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--big-mb", type=int, default=50)
    parser.add_argument("--latency-ms", type=float, default=0.0,
                        help="the index's delay before each answer")
    parser.add_argument("--bandwidth-mbps", type=float, default=0.0,
                        help="cap per connection in MB/s (0: none)")
    parser.add_argument("--uv-compile-bytecode", action="store_true",
                        help="UV_COMPILE_BYTECODE=1: uv writes .pyc files as pip does")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    uv = find_uv(os.environ)
    if uv is None:
        sys.exit("uv is not installed: pip install uv")
    uv_version = subprocess.run([uv, "--version"], capture_output=True, text=True,
                                check=True).stdout.split()[1]
    import pip

    network = Network(bandwidth_bps=(args.bandwidth_mbps * 1e6) or None,
                      latency_s=args.latency_ms / 1000)
    with tempfile.TemporaryDirectory(prefix="bench-extras-") as tmp_name, quiet_logs():
        tmp = Path(tmp_name)
        (tmp / "wheels").mkdir()
        wheels = build_set(tmp / "wheels", args.big_mb)
        seed = pip_wheel(tmp / "pipwheel")
        runs = 0

        def venv(installer: str) -> Path:
            nonlocal runs
            runs += 1
            return fresh_venv(tmp / f"venv{runs}", with_pip=seed, uv=uv,
                              seed=installer == "pip")

        times: dict[tuple[str, str], list[float]] = {}
        with Index(wheels, network=network) as index:
            warm = {}
            for installer in ("pip", "uv"):  # fill each warm cache once, untimed
                warm[installer] = tmp / f"warm-{installer}"
                env = isolated_env(tmp, warm[installer], installer)
                if args.uv_compile_bytecode:
                    env["UV_COMPILE_BYTECODE"] = "1"
                timed_install(venv(installer), env, index.url, tmp / "warmup.log")
            for round_no in range(args.rounds):
                order = ("pip", "uv") if round_no % 2 == 0 else ("uv", "pip")
                for cache in ("cold", "warm"):
                    for installer in order:
                        python = venv(installer)
                        where = warm[installer] if cache == "warm" else tmp / f"cold{runs}"
                        env = isolated_env(tmp, where, installer)
                        if args.uv_compile_bytecode:
                            env["UV_COMPILE_BYTECODE"] = "1"
                        seconds = timed_install(python, env, index.url, tmp / "runs.log")
                        check = subprocess.run(
                            [str(python), "-c", f"import {APP}, {BIG}; print({APP}.VERSION)"],
                            capture_output=True, text=True, check=True)
                        assert check.stdout.strip() == "2.0", check
                        times.setdefault((installer, cache), []).append(seconds)
                        if cache == "cold":
                            shutil.rmtree(where, ignore_errors=True)
            requests = index.hits

    report: dict[str, object] = {
        "python": sys.version.split()[0], "pip": pip.__version__ if seed else "bundled",
        "uv": uv_version, "rounds": args.rounds, "big_mb": args.big_mb,
        "projects": len(PROJECTS) + 2, "wheels": len(wheels),
        "latency_ms": args.latency_ms, "bandwidth_mbps": args.bandwidth_mbps or None,
        "index_requests": requests, "uv_compile_bytecode": args.uv_compile_bytecode,
    }
    for cache in ("cold", "warm"):
        pip_s, uv_s = times[("pip", cache)], times[("uv", cache)]
        ratios = [u / p for p, u in zip(pip_s, uv_s, strict=True)]
        report[cache] = {
            "pip_s": _spread(pip_s), "uv_s": _spread(uv_s),
            "uv_over_pip": round(statistics.median(ratios), 3),
        }
    if args.json:
        print(json.dumps(report))
        return
    print(f"python {report['python']}, pip {report['pip']}, uv {report['uv']}; "
          f"{report['projects']} projects ({report['wheels']} wheels, one of "
          f"{args.big_mb} MB); {args.rounds} rounds; latency {args.latency_ms} ms, "
          f"bandwidth {args.bandwidth_mbps or 'unlimited'} MB/s"
          + ("; uv compiles bytecode" if args.uv_compile_bytecode else ""))
    print(f"{'cache':6} {'installer':9} {'median s':>9} {'min s':>7} {'max s':>7}  uv/pip")
    for cache in ("cold", "warm"):
        row = report[cache]
        assert isinstance(row, dict)
        for installer in ("pip", "uv"):
            med, low, high = (row[f"{installer}_s"][k] for k in ("median", "min", "max"))
            ratio = f"  {row['uv_over_pip']:.2f}" if installer == "uv" else ""
            print(f"{cache:6} {installer:9} {med:9.2f} {low:7.2f} {high:7.2f}{ratio}")


def _spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
            "max": round(max(values), 3)}


if __name__ == "__main__":
    main()

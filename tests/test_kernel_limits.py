"""The kernel's limits, measured in the first release (TRAPS): exec's E2BIG on a large
environment, and OS waits that refuse a timeout of about a month.

Most of these run the real runner as a process (``python -m fsm run``): the failures were
the runner's, and a traceback or a leaked value would only show there.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any, cast

import pytest
from conftest import CANARY, PREFIX, TRAIN_PATH, Layout, assert_no_secret
from pypi_server import build_wheel

from fsm.clock import MAX_OS_WAIT_S, Deadline
from fsm.context import Context
from fsm.extras.pip import install
from fsm.interrupt import InterruptFlag
from fsm.worker.console import PeriodicTail
from fsm.worker.supervise import supervise

FORTY_DAYS_S = 40 * 86_400  # past the ~24.8 days (2**31 ms) that OS waits accept
CJK = "\u6f22"  # one character, three bytes of UTF-8
#: pip must not see this machine's own configuration (find-links, extra indexes).
PIP_ISOLATED = {"PIP_CONFIG_FILE": os.devnull, "PIP_RETRIES": "0", "PIP_TIMEOUT": "5"}

#: The test worker reports how the spec reached it.
SPEC_REPORTER = """
    (SCRATCH / "spec_seen.json").write_text(json.dumps({
        "inline": os.environ.get("FLASH_JOB_SPEC_JSON"),
        "path": os.environ.get("FLASH_JOB_SPEC_PATH"),
        "spec": SPEC,
    }))
    complete()
"""


def _run_cli(
    layout: Layout, *, stack_bytes: int | None = None
) -> subprocess.CompletedProcess[bytes]:
    """The runner as a process; with ``stack_bytes`` its stack rlimit is lowered to that,
    which lowers its ``ARG_MAX`` to a quarter of it (the kernel's and ``sysconf``'s rule)."""
    if stack_bytes is None:
        return layout.cli(*layout.run_args())

    def lower_stack() -> None:
        _, hard = resource.getrlimit(resource.RLIMIT_STACK)
        resource.setrlimit(resource.RLIMIT_STACK, (stack_bytes, hard))

    return subprocess.run(
        [sys.executable, "-m", "fsm", *layout.run_args()],
        capture_output=True,
        timeout=60,
        check=False,
        preexec_fn=lower_stack,
    )


def _spec_of_bytes(size: int, fill: str = "x") -> str:
    """A JSON job spec of exactly ``size`` bytes of UTF-8 (``fill`` is 1 to 3 bytes)."""
    head = json.dumps({"hf_prefix": PREFIX, "pad": ""}, ensure_ascii=False)
    room = size - len(head.encode())
    step = len(fill.encode())
    pad = fill * (room // step) + "x" * (room % step)
    spec = json.dumps({"hf_prefix": PREFIX, "pad": pad}, ensure_ascii=False)
    assert len(spec.encode()) == size
    return spec


def _seen(layout: Layout) -> dict[str, Any]:
    seen: dict[str, Any] = json.loads((layout.scratch / "spec_seen.json").read_text())
    return seen


def _env_bytes(env: dict[str, str]) -> int:
    return sum(len(os.fsencode(k)) + len(os.fsencode(v)) + 2 for k, v in env.items())


# --- the spec: inline or a file, by bytes -------------------------------------------------


def test_a_45000_character_cjk_spec_reaches_the_worker_as_a_file_intact(layout: Layout) -> None:
    """45,000 CJK characters are 135 KB of UTF-8: inline, exec failed with E2BIG."""
    big = CJK * 45_000
    spec = json.dumps({"hf_prefix": PREFIX, "big": big}, ensure_ascii=False)
    assert len(spec) < 96_000 < len(spec.encode())
    layout.write_worker(SPEC_REPORTER)
    layout.write_payload(job_spec_json=spec)

    proc = _run_cli(layout)

    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    marker = layout.marker()
    assert marker is not None and marker["ok"] is True
    assert marker["path"] == TRAIN_PATH[:-1]
    seen = _seen(layout)
    assert seen["inline"] is None
    assert seen["spec"]["big"] == big
    spec_file = Path(seen["path"])
    assert spec_file == layout.scratch / "job_spec.json"
    assert spec_file.read_bytes() == spec.encode()


@pytest.mark.parametrize("size", [95_000, 96_000])
def test_a_spec_of_at_most_96000_ascii_bytes_stays_inline(layout: Layout, size: int) -> None:
    spec = _spec_of_bytes(size)
    layout.write_worker(SPEC_REPORTER)
    layout.write_payload(job_spec_json=spec)

    proc = _run_cli(layout)

    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    seen = _seen(layout)
    assert seen["path"] is None
    assert seen["inline"] == spec
    assert not (layout.scratch / "job_spec.json").exists()


@pytest.mark.parametrize(
    "fill", ["x", "\u00e9", CJK], ids=["ascii", "two-byte", "three-byte"]
)
def test_a_spec_just_over_96000_bytes_is_spilled_to_a_file(layout: Layout, fill: str) -> None:
    """Bytes decide, not characters: a 96,001-byte spec of 2- or 3-byte characters is far
    under 96,000 characters and still goes as a file."""
    spec = _spec_of_bytes(96_001, fill)
    layout.write_worker(SPEC_REPORTER)
    layout.write_payload(job_spec_json=spec)

    proc = _run_cli(layout)

    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    seen = _seen(layout)
    assert seen["inline"] is None
    assert Path(seen["path"]).read_bytes() == spec.encode()
    assert json.dumps(seen["spec"], ensure_ascii=False) == spec


def test_a_small_spec_is_spilled_when_the_environment_would_not_fit_with_it(
    layout: Layout,
) -> None:
    """Inline only when the whole environment then fits ``ARG_MAX``: with the runner's
    ARG_MAX at 256 KiB, ~190 KB of payload env plus a 95,000-byte spec does not, the same
    env with the spec as a file does."""
    spec = _spec_of_bytes(95_000)
    room = 190_000 - _env_bytes(dict(os.environ))
    assert room > 30_000, "the test process's own environment is too large for this test"
    env = {f"FILLER_{i}": "f" * (room // 3) for i in range(3)}
    layout.write_worker(SPEC_REPORTER)
    layout.write_payload(job_spec_json=spec, env=env)

    proc = _run_cli(layout, stack_bytes=1 << 20)

    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    seen = _seen(layout)
    assert seen["inline"] is None
    assert Path(seen["path"]).read_bytes() == spec.encode()


# --- an environment that cannot fit at all ------------------------------------------------


def _assert_env_too_large(
    layout: Layout, proc: subprocess.CompletedProcess[bytes], name: str, size: int, value: str
) -> None:
    stderr = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 1, stderr[-2000:]
    marker = layout.marker()
    assert marker is not None
    assert (marker["ok"], marker["retriable"], marker["rule"], marker["state"]) == (
        False, False, "worker-env-too-large", "ResolveSpec"
    )
    assert name in marker["error"] and f"{size} bytes" in marker["error"]
    assert "\n" not in marker["error"]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("flash-bootstrap: attempt 0 failed")
    assert "worker-env-too-large" in last and name in last
    assert "Traceback" not in stderr
    # The value (it may be a secret) is nowhere: not in the logs, the marker, any file.
    probe = value[:64]
    assert probe not in stderr and probe not in proc.stdout.decode("utf-8", "replace")
    assert probe not in json.dumps(marker, ensure_ascii=False)
    assert_no_secret(layout.root, probe)
    assert not (layout.scratch / "job_spec.json").exists()


@pytest.mark.parametrize(
    ("name", "fill"),
    [("BIG_BLOB", "b"), ("BIG_TOKEN", "t"), ("BIG_CJK_NOTES", CJK)],
    ids=["plain", "secret-looking", "multibyte"],
)
def test_one_variable_over_128_kib_is_fatal_naming_it_and_never_its_value(
    layout: Layout, name: str, fill: str
) -> None:
    """One NAME=VALUE over MAX_ARG_STRLEN cannot be exec'd, spec spilled or not. The
    multibyte value is 47,000 characters: only its 141,000 bytes are too many."""
    unique = f"v{uuid.uuid4().hex}-"
    value = unique + fill * ((141_000 - len(unique)) // len(fill.encode()))
    size = len(value.encode())
    layout.write_worker("complete()")
    layout.write_payload(env={"HF_TOKEN": CANARY, name: value})

    proc = _run_cli(layout)

    _assert_env_too_large(layout, proc, name, size, value)
    assert CANARY not in proc.stderr.decode("utf-8", "replace")


def test_an_environment_over_arg_max_is_fatal_naming_its_largest_variable(
    layout: Layout,
) -> None:
    """Every variable under 128 KiB, together over ARG_MAX (256 KiB for this runner)."""
    unique = f"v{uuid.uuid4().hex}-"
    env = {
        "HF_TOKEN": CANARY,
        "PART_ONE": "a" * 100_000,
        "PART_TWO": "b" * 100_000,
        "HUGE_SECRET_KEY": unique + "c" * (110_000 - len(unique)),
    }
    layout.write_worker("complete()")
    layout.write_payload(env=env)

    proc = _run_cli(layout, stack_bytes=1 << 20)

    _assert_env_too_large(layout, proc, "HUGE_SECRET_KEY", 110_000, env["HUGE_SECRET_KEY"])
    marker = layout.marker()
    assert marker is not None and "ARG_MAX" in marker["error"]


# --- a budget of 40 days ------------------------------------------------------------------


def test_a_40_day_budget_runs_extras_and_the_worker(layout: Layout, tmp_path: Path) -> None:
    """pip's wait raised ``OverflowError: timeout is too large`` with such a budget."""
    wheel = build_wheel(tmp_path, "flashextra", "1.0")
    target = tmp_path / "site"
    layout.write_worker(f"""
        sys.path.insert(0, {str(target)!r})
        import flashextra
        complete()
    """)
    layout.write_payload(
        max_wall_s=3_456_000,
        extra_pip=["--no-index", str(wheel)],
        # (the payload may not move pip's install with --target: the env says where)
        env={"HF_TOKEN": CANARY, **PIP_ISOLATED, "PIP_TARGET": str(target)},
    )

    proc = _run_cli(layout)

    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    marker = layout.marker()
    assert marker is not None and marker["ok"] is True
    assert marker["path"] == TRAIN_PATH[:-1]
    assert b"OverflowError" not in proc.stderr


@pytest.fixture
def thread_errors(monkeypatch: pytest.MonkeyPatch) -> list[BaseException]:
    """Exceptions that end any thread while the test runs."""
    errors: list[BaseException] = []

    def hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_value is not None:
            errors.append(args.exc_value)

    monkeypatch.setattr(threading, "excepthook", hook)
    return errors


@pytest.mark.parametrize("interval_s", [FORTY_DAYS_S, float("inf")], ids=["40-days", "inf"])
def test_supervise_with_a_40_day_deadline_runs_the_worker_to_its_end(
    tmp_path: Path, thread_errors: list[BaseException], interval_s: float
) -> None:
    """Deadline, grace, drain and tail interval all far past what one OS wait accepts:
    nothing raises, and no thread of the supervisor dies of it."""
    deadline = Deadline.after(FORTY_DAYS_S)
    with open(tmp_path / "out.bin", "wb") as out:
        result = supervise(
            [sys.executable, "-c", "print('worked')"],
            cwd=tmp_path,
            env=dict(os.environ),
            console_path=tmp_path / "console.txt",
            deadline=deadline,
            stop_by=deadline,
            interrupt=InterruptFlag(),
            grace_s=FORTY_DAYS_S,
            drain_timeout_s=FORTY_DAYS_S,
            out_fd=out.fileno(),
            tail_sink=lambda _tail: None,
            tail_interval_s=interval_s,
        )
    for thread in threading.enumerate():  # the tail thread ends once supervise returned
        if thread.name == "worker-tail":
            thread.join(10)
            assert not thread.is_alive()
    assert (result.reason, result.returncode) == ("exited", 0)
    assert (tmp_path / "console.txt").read_bytes() == b"worked\n"
    assert thread_errors == []


def test_pip_install_with_a_40_day_deadline_installs(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path, "flashdemo", "1.0")
    target = tmp_path / "target"
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(tmp_path),
        "PIP_NO_CACHE_DIR": "1",
        **PIP_ISOLATED,
    }
    install(
        ["--no-index", "--target", str(target), str(wheel)],
        env=env,
        deadline=Deadline.after(FORTY_DAYS_S),
        interrupt=InterruptFlag(),
        output_log=tmp_path / "pip.out",
    )
    assert (target / "flashdemo.py").is_file()


def test_closing_the_periodic_tail_with_an_unbounded_wait_returns_when_idle() -> None:
    """A wait longer than ``Lock.acquire`` accepts (infinity) is cut into pieces it does
    accept; with no upload in flight, close() returns at once."""
    tail = PeriodicTail(cast(Context, None))  # close() never touches the context
    tail.close(timeout_s=float("inf"))
    tail.close(timeout_s=MAX_OS_WAIT_S * 3)
    tail(b"after close")  # closed: nothing is uploaded, the context is never used

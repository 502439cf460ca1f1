"""The command line: bad input ends with one clear line and exit 2, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from conftest import ARM, PREFIX, Layout

from fsm.policy import render_table


def _last_line(proc: subprocess.CompletedProcess[bytes]) -> str:
    lines = proc.stderr.decode().strip().splitlines()
    return lines[-1] if lines else ""


def _assert_one_clear_line(proc: subprocess.CompletedProcess[bytes], *words: str) -> None:
    stderr = proc.stderr.decode()
    assert "Traceback" not in stderr
    line = _last_line(proc)
    assert line.startswith("flash-bootstrap: "), line
    for word in words:
        assert word in line, (word, line)


def test_a_missing_payload_file_exits_2_naming_it(layout: Layout) -> None:
    proc = layout.cli(*layout.run_args())
    assert proc.returncode == 2
    _assert_one_clear_line(proc, "does not exist", str(layout.payload_path))
    assert layout.markers() == []


def test_an_unreadable_payload_exits_2(layout: Layout) -> None:
    layout.payload_path.mkdir()  # a directory where the file should be
    proc = layout.cli(*layout.run_args())
    assert proc.returncode == 2
    _assert_one_clear_line(proc, "unreadable")


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (b"{not json", ["not JSON", "line 1"]),
        (b"\xff\xfe\x00garbage", ["not UTF-8"]),
        (b"[1, 2]", ["JSON object", "array"]),
    ],
)
def test_a_payload_that_is_not_a_json_object_exits_2(
    layout: Layout, content: bytes, words: list[str]
) -> None:
    layout.write_payload(content)
    proc = layout.cli(*layout.run_args())
    assert proc.returncode == 2
    _assert_one_clear_line(proc, *words)


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"phase": None}, ["'phase'", "required"]),
        ({"seed": "3"}, ["'seed'", "integer", "string"]),
        ({"seed": True}, ["'seed'", "integer"]),
        ({"phase": "../../etc"}, ["'phase'"]),
        ({"phase": "a/b"}, ["'phase'"]),
        ({"env": {"A": 1}}, ["'env'", "'A'", "string"]),
        ({"extra_pip": "torch"}, ["'extra_pip'", "list"]),
        ({"max_wall_s": 0}, ["'max_wall_s'"]),
        ({"mode": "warm"}, ["'mode'"]),
        ({"mode": "preload"}, ["'models'", "required"]),
    ],
)
def test_an_invalid_payload_exits_2_and_leaves_a_fatal_marker(
    layout: Layout, overrides: dict[str, Any], words: list[str]
) -> None:
    layout.write_payload(**overrides)
    proc = layout.cli(*layout.run_args())
    assert proc.returncode == 2
    _assert_one_clear_line(proc, "payload", *words)
    marker = layout.marker(attempt=0)
    assert marker is not None, "the destination was known, so a marker is written"
    assert layout.markers() == [layout.artifact(f"{ARM}_attempt0.json")]
    assert (marker["ok"], marker["retriable"], marker["rule"]) == (False, False, "payload-invalid")


def test_a_fixed_payload_runs_after_an_invalid_one_for_the_same_attempt(layout: Layout) -> None:
    layout.write_worker("complete()")
    layout.write_payload(seed="three")
    assert layout.cli(*layout.run_args()).returncode == 2
    layout.write_payload()
    proc = layout.cli(*layout.run_args())
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    marker = layout.marker()
    assert marker is not None and marker["ok"] is True


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"hf_prefix": "../escape"}, ["'hf_prefix'"]),
        ({"attempt": -1}, ["'attempt'", ">= 0"]),
        ({"attempt": 2.0}, ["'attempt'", "integer"]),
        ({"attempt": "2"}, ["'attempt'", "integer", "string"]),
        ({"attempt": 1_000_001}, ["'attempt'", "1,000,000"]),
        ({"flash_arm": "bad arm"}, ["'flash_arm'"]),
    ],
)
def test_an_invalid_payload_without_a_destination_writes_no_marker(
    layout: Layout, overrides: dict[str, Any], words: list[str]
) -> None:
    """An invalid destination key is never replaced by its default to write a marker."""
    layout.write_payload(**overrides)
    proc = layout.cli(*layout.run_args())
    assert proc.returncode == 2
    _assert_one_clear_line(proc, "payload unusable", *words)
    assert not list(layout.store.rglob("*.json"))


def test_an_integer_too_long_to_convert_exits_2_with_one_line_naming_its_key(
    layout: Layout,
) -> None:
    """json.loads refuses integers over 4,300 digits: that is exit 2, never unclassified."""
    text = json.dumps(layout.payload(attempt=-7)).replace("-7", "1" + "0" * 5000)
    layout.write_payload(text)
    proc = layout.cli(*layout.run_args())
    assert proc.returncode == 2, proc.stderr.decode()[-2000:]
    _assert_one_clear_line(proc, "payload unusable", "'attempt'", "5001 digits")
    assert layout.markers() == []


def test_unknown_payload_keys_are_ignored(layout: Layout) -> None:
    layout.write_worker("complete()")
    layout.write_payload(future_key={"x": 1})
    proc = layout.cli(*layout.run_args())
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert _last_line(proc) == "flash-bootstrap: attempt 0 succeeded"


def test_the_store_and_paths_come_from_the_environment_when_not_given(layout: Layout) -> None:
    layout.write_worker("complete()")
    layout.write_payload()
    proc = layout.cli(
        "run",
        env={
            "FLASH_PAYLOAD_PATH": str(layout.payload_path),
            "FLASH_STORE": layout.store_url,
            "FLASH_CODE_ROOT": str(layout.code_root),
            "FLASH_SCRATCH_DIR": str(layout.scratch),
        },
    )
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert layout.marker() is not None


def test_a_malformed_store_url_exits_2(layout: Layout) -> None:
    layout.write_payload()
    args = layout.run_args()
    args[args.index("--store") + 1] = "file://relative/dir"
    proc = layout.cli(*args)
    assert proc.returncode == 2
    _assert_one_clear_line(proc, "--store")


def test_the_entrypoint_plus_the_contract_command_is_one_run(layout: Layout) -> None:
    """ENTRYPOINT ["flash-bootstrap", "run"] + `docker run IMAGE flash-bootstrap run`."""
    layout.write_worker("complete()")
    layout.write_payload()
    args = layout.run_args()
    proc = layout.cli("run", "flash-bootstrap", *args, env={})
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert layout.marker() is not None


def test_an_unknown_option_exits_2_with_one_line(layout: Layout) -> None:
    proc = layout.cli("run", "--no-such-flag")
    assert proc.returncode == 2
    _assert_one_clear_line(proc, "--no-such-flag")


def test_logs_are_json_lines_on_stderr_with_one_state_changed_per_transition(
    layout: Layout,
) -> None:
    layout.write_worker("print('worker says hi'); complete()")
    layout.write_payload()
    proc = layout.cli(*layout.run_args())
    assert proc.returncode == 0
    events = [
        json.loads(line) for line in proc.stderr.decode().splitlines() if line.startswith("{")
    ]
    changes = [e for e in events if e["msg"] == "state.changed"]
    assert [(c["from"], c["event"], c["to"]) for c in changes] == [
        ("LoadPayload", "train_requested", "InstallExtras"),
        ("InstallExtras", "extras_installed", "FetchCode"),
        ("FetchCode", "code_fetched", "ResolveSpec"),
        ("ResolveSpec", "spec_resolved", "Train"),
        ("Train", "worker_exited", "VerifyRemote"),
        ("VerifyRemote", "completion_confirmed", "Mark"),
        ("Mark", "marked_succeeded", "Succeeded"),
    ]
    for change in changes:
        assert change["run_id"] == "run-1"
        assert change["attempt"] == 0
        assert change["seconds"] >= 0
    # The worker's own output goes to stdout, untouched.
    assert proc.stdout == b"worker says hi\n"


def test_validate_accepts_a_good_payload_and_names_the_marker(layout: Layout) -> None:
    layout.write_payload()
    proc = layout.cli("validate", str(layout.payload_path))
    assert proc.returncode == 0
    assert json.loads(proc.stdout)["marker"] == f"{PREFIX}/{ARM}_attempt0.json"


def test_validate_rejects_a_bad_payload_with_one_line(layout: Layout) -> None:
    layout.write_payload(seed="x")
    proc = layout.cli("validate", str(layout.payload_path))
    assert proc.returncode == 2
    _assert_one_clear_line(proc, "'seed'")
    assert layout.markers() == []  # validate never writes anything


def test_policy_prints_the_table(layout: Layout) -> None:
    proc = layout.cli("policy")
    assert proc.returncode == 0
    assert proc.stdout.decode().strip() == render_table()


def test_the_console_script_and_python_dash_m_are_the_same_program() -> None:
    """The installed ``flash-bootstrap`` entry point (as the project declares it) and
    ``python -m fsm`` start the same way and print the same."""
    script = subprocess.run(
        [sys.executable, "-c",
         "import sys; from importlib.metadata import entry_points; "
         "sys.argv = ['flash-bootstrap', 'policy']; "
         "entry_points(group='console_scripts')['flash-bootstrap'].load()()"],
        capture_output=True,
        check=True,
    )
    module = subprocess.run(
        [sys.executable, "-m", "fsm", "policy"], capture_output=True, check=True
    )
    assert script.stdout == module.stdout


def test_the_cli_offers_exactly_the_demo_scenarios() -> None:
    from fsm.cli import DEMO_SCENARIOS
    from fsm.ops.demo import SCENARIOS

    assert sorted(SCENARIOS) == list(DEMO_SCENARIOS)


@pytest.mark.parametrize("scenario", ["success", "crash", "crash-after-done", "preload"])
def test_the_demo_runs_each_scenario_offline_as_described(scenario: str, tmp_path: object) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "fsm", "demo", "--scenario", scenario],
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout.decode()[-2000:] + proc.stderr.decode()[-2000:]
    out = proc.stdout.decode()
    assert "states     LoadPayload ->" in out
    assert '"ok":' in out


def test_a_runner_on_the_local_store_never_imports_asyncio(layout: Layout) -> None:
    """Start-up (issue 15): structlog imports asyncio (and ssl) for its async methods
    only; ``run`` defers it, and a whole attempt on the local store never loads it."""
    layout.write_worker("print('training'); complete()")
    layout.write_payload()
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "fsm", *layout.run_args()],
        capture_output=True, timeout=60, check=False,
    )
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    imported = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.decode().splitlines()
                if line.startswith("import time:")]
    assert "structlog" in imported  # the measurement sees the runner's imports
    assert not [name for name in imported if name.split(".")[0] in ("asyncio", "ssl")]


def test_a_deferred_module_loads_on_first_use_and_then_is_the_real_one() -> None:
    """What ``run`` does to asyncio, shown on a module nothing here has imported."""
    code = """
import sys
from fsm import deferred
deferred.defer(["colorsys"])
import colorsys
assert isinstance(sys.modules["colorsys"], deferred.Deferred)
assert colorsys.rgb_to_hsv(1.0, 0.0, 0.0) == (0.0, 1.0, 1.0)
assert not isinstance(sys.modules["colorsys"], deferred.Deferred)
from colorsys import hsv_to_rgb
assert hsv_to_rgb(0.0, 1.0, 1.0) == (1.0, 0.0, 0.0)
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=30,
                          check=False)
    assert proc.stdout.decode().strip() == "ok", proc.stderr.decode()


def test_a_deferred_modules_named_function_is_found_without_importing_it() -> None:
    """What the agent does to ``yaml``: a library may bind ``partial(module.function)``
    at its import; the module loads only when that is called."""
    code = """
import functools, sys
from fsm import deferred
deferred.defer(["colorsys"], calls={"colorsys": ["rgb_to_hsv"]})
import colorsys
bound = functools.partial(colorsys.rgb_to_hsv, 1.0)
assert isinstance(sys.modules["colorsys"], deferred.Deferred)
assert bound(0.0, 0.0) == (0.0, 1.0, 1.0)
assert not isinstance(sys.modules["colorsys"], deferred.Deferred)
assert colorsys.hsv_to_rgb(0.0, 1.0, 1.0) == (1.0, 0.0, 0.0)
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=30,
                          check=False)
    assert proc.stdout.decode().strip() == "ok", proc.stderr.decode()


def test_importing_the_cli_under_a_run_command_line_changes_nothing() -> None:
    """The runner's early starts (signal handlers, deferred imports, the Hub's process,
    the GPU probe) are made on the run path (``fsm.launch``), not by importing a module:
    a program that imports ``fsm.cli`` while its own argv says ``run`` (a test, a
    wrapper) gets no handlers, no stand-ins in ``sys.modules`` and no child process."""
    code = """
import os, signal, sys
sys.argv = ["flash-bootstrap", "run"]
import fsm.cli
from fsm import deferred
from fsm.hub import agent
print(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL,
      any(isinstance(m, deferred.Deferred) for m in list(sys.modules.values())),
      agent.current() is None,
      os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children")
      and open(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read().strip() == "")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=30,
                          check=False)
    assert proc.stdout.decode().split() == ["True", "False", "True", "True"], (
        proc.stdout.decode() + proc.stderr.decode()[-2000:])


def test_a_deferred_module_loaded_by_several_threads_at_once_loads_once() -> None:
    """Several threads' first lookups of deferred modules at once (the runner's threads
    meet asyncio's stand-in so): each gets the real module and none fails removing the
    stand-in another removed (a race that, without the lock, struck about one run in
    five of this test)."""
    code = """
import sys, threading
sys.setswitchinterval(1e-6)
from fsm import deferred
names = ["colorsys", "calendar", "fractions", "difflib", "netrc", "shlex", "textwrap",
         "statistics", "decimal", "ipaddress", "graphlib", "tabnanny", "pprint", "sched",
         "plistlib", "gettext", "codeop", "bisect", "heapq", "string"]
errors = []
for _ in range(20):
    for name in names:
        sys.modules.pop(name, None)
    deferred.defer(names)
    barrier = threading.Barrier(8)
    def look():
        barrier.wait()
        for name in names:
            module = sys.modules.get(name)
            try:
                if isinstance(module, deferred.Deferred):
                    assert module._load().__name__ == name
            except Exception as exc:
                errors.append(repr(exc))
    threads = [threading.Thread(target=look) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not any(isinstance(sys.modules[n], deferred.Deferred) for n in names)
print(errors)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60,
                          check=False)
    assert proc.stdout.decode().strip() == "[]", proc.stdout.decode() + proc.stderr.decode()

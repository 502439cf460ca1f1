"""The operator's view of the fleet: ``flash-bootstrap status`` and ``explain``, through the
real command (``python -m fsm``) on both stores.

On the local store the markers are real ones, left by real attempts (``layout``), next to
hand-written ones (another arm, an unreadable one, an unknown rule). On the local Hub
server they are put into the repo with ``add_file`` and read through the real
``huggingface_hub`` client; every command there runs with the test's canary token, which
must never show up in what it prints. Store failures end with one line and exit 1; a bad
command line, or an attempt that several arms ran without ``--arm``, with one line and 2.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import ARM, PREFIX, REPO, Layout

from fsm import policy
from fsm.ops import diagram
from fsm.testing import LocalHubServer

#: What the child inherits must not pick a store or a token for it.
_AMBIENT = ("FLASH_STORE", "HF_TOKEN", "HF_ENDPOINT", "FLASH_STORE_MAX_ATTEMPTS")

#: Attempt 0 crashes after 30 numbered console lines; a later one completes.
WORKER = """
attempt = int(os.environ["ATTEMPT"])
for i in range(30):
    print(f"attempt {attempt} line {i}", flush=True)
if attempt == 0:
    sys.exit(3)
complete()
"""


def fsm_cli(*args: str, env: dict[str, str] | None = None,
            secrets: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """``python -m fsm ARGS`` as a real process; none of ``secrets`` in what it prints."""
    base = {k: v for k, v in os.environ.items() if k not in _AMBIENT}
    proc = subprocess.run(
        [sys.executable, "-m", "fsm", *args], env={**base, **(env or {})},
        capture_output=True, text=True, timeout=60, check=False,
    )
    for secret in secrets:
        assert secret not in proc.stdout + proc.stderr, "the token was printed"
    return proc


def one_line(proc: subprocess.CompletedProcess[str], code: int) -> str:
    """The process ended with ``code``, nothing on stdout and one line on stderr."""
    assert proc.returncode == code, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("flash-bootstrap: "), proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


def marker(attempt: int, **over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "ok": False, "ts": time.time() - 7_500, "attempt": attempt, "retriable": True,
        "error": "worker exited 1; GPU fault", "state": "VerifyRemote",
        "rule": "worker-host-fault", "run_id": "run-1",
        "path": ["LoadPayload", "InstallExtras", "FetchCode", "ResolveSpec", "Train",
                 "VerifyRemote", "Mark"],
    }
    base.update(over)
    return base


def table(stdout: str) -> list[list[str]]:
    """The status table's lines as cells (no cell holds a blank)."""
    return [line.split() for line in stdout.splitlines()]


def tail_lines(stdout: str) -> list[str]:
    return [line[4:] for line in stdout.splitlines() if line.startswith("  | ")]


def drawn(m: dict[str, Any]) -> str:
    return diagram.render("mermaid", marker=m).decode().rstrip("\n")


# --- the local store, with real attempts --------------------------------------------------


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Layout:
    """A prefix holding two real attempts of arm ``lambda`` (0 crashed, then 1 succeeded
    without uploading its console: the tail there is attempt 0's), a retriable attempt 1 of
    ``hyperstack``, and an unreadable marker of attempt 2."""
    lay = Layout(tmp_path_factory.mktemp("fleet"))
    for sub in ("store", "scratch", "runcode", "flash"):
        (lay.root / sub).mkdir()
    lay.write_worker(WORKER)
    quiet = {"FLASH_UPLOAD_CONSOLE": "0"}
    assert lay.run(environ=quiet, attempt=0).exit_code == 1
    assert lay.run(environ=quiet, attempt=1).exit_code == 0
    lay.artifact("hyperstack_attempt1.json").write_text(json.dumps(marker(1)))
    lay.artifact("lambda_attempt2.json").write_text('{"ok": tru')
    lay.artifact("not-a-marker_attemptX.json").write_text("{}")
    (lay.store / PREFIX / "deeper").mkdir()
    (lay.store / PREFIX / "deeper" / "lambda_attempt9.json").write_text(json.dumps(marker(9)))
    return lay


def local(lay: Layout, *args: str) -> list[str]:
    return [*args, "--repo", REPO, "--prefix", PREFIX, "--store", lay.store_url]


def test_status_tabulates_every_marker_by_attempt_then_arm(fleet: Layout) -> None:
    proc = fsm_cli(*local(fleet, "status"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    rows = table(proc.stdout)
    assert rows[0] == ["ARM", "ATTEMPT", "OUTCOME", "CLASS", "RULE", "AGE", "STATE", "RUN_ID"]
    crashed, done = fleet.marker(0), fleet.marker(1)
    assert crashed is not None and done is not None
    assert [r[:5] + r[6:] for r in rows[1:]] == [
        [ARM, "0", "failed", "fatal", "worker-failed", "VerifyRemote", "run-1"],
        ["hyperstack", "1", "failed", "retriable", "worker-host-fault", "VerifyRemote", "run-1"],
        [ARM, "1", "ok", "succeeded", "completion-confirmed", "VerifyRemote", "run-1"],
        [ARM, "2", "unreadable", "-", "-", "-", "-"],
    ]
    ages = [r[5] for r in rows[1:]]
    assert re.fullmatch(r"\d+s", ages[0]) and ages[1] == "2h05m" and ages[3] == "-", ages
    # aligned: every column starts where its header does
    lines = proc.stdout.splitlines()
    for name in ("ATTEMPT", "OUTCOME", "AGE", "RUN_ID"):
        column = lines[0].index(name)
        assert all(line[column - 2: column] == "  " for line in lines[1:4]), name


def test_status_json_has_the_raw_values(fleet: Layout) -> None:
    before = time.time()
    proc = fsm_cli(*local(fleet, "status", "--json"))
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert [(r["attempt"], r["arm"], r["outcome"], r["class"]) for r in rows] == [
        (0, ARM, "failed", "fatal"), (1, "hyperstack", "failed", "retriable"),
        (1, ARM, "ok", "succeeded"), (2, ARM, "unreadable", None),
    ]
    crashed = fleet.marker(0)
    assert crashed is not None
    first = rows[0]
    assert (first["rule"], first["state"], first["run_id"], first["ts"], first["error"]) == (
        crashed["rule"], crashed["state"], crashed["run_id"], crashed["ts"], crashed["error"])
    assert first["file"] == f"{ARM}_attempt0.json"
    assert isinstance(first["age_s"], float)
    assert 0 <= first["age_s"] <= time.time() - crashed["ts"] + 1
    assert abs(rows[1]["age_s"] - (before - rows[1]["ts"])) < 30
    assert rows[3]["age_s"] is None and rows[3]["problem"].startswith("not JSON")


def test_explain_shows_the_marker_its_rule_the_tail_and_the_path(fleet: Layout) -> None:
    proc = fsm_cli(*local(fleet, "explain", "--attempt", "0"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    out = proc.stdout
    crashed = fleet.marker(0)
    assert crashed is not None
    # the marker, pretty
    assert out.startswith(f"marker  {PREFIX}/{ARM}_attempt0.json\n")
    block = out.split("\n", 1)[1].split("\n\n", 1)[0]
    assert json.loads(block) == crashed and "\n  " in block
    # the policy row that decided it
    rule = policy.rule("worker-failed")
    assert f"decided by  {rule.id}\n  class  fatal\n  where  VerifyRemote\n" in out
    assert f"  what   {rule.what}\n" in out
    # its console's last 20 lines, uploaded with its marker
    assert f"console tail  {PREFIX}/console_sft.txt (last 20 of 30 lines)" in out
    assert tail_lines(out) == [f"attempt 0 line {i}" for i in range(10, 30)]
    # the path, drawn on the machine
    assert out.rstrip("\n").endswith(drawn(crashed))
    assert "note right of VerifyRemote" in out


def test_explain_of_a_success_and_of_the_arm_asked_for(fleet: Layout) -> None:
    proc = fsm_cli(*local(fleet, "explain", "--attempt", "1", "--arm", ARM))
    assert proc.returncode == 0, proc.stderr
    done = fleet.marker(1)
    assert done is not None and done["ok"] is True
    assert "decided by  completion-confirmed\n  class  succeeded\n" in proc.stdout
    assert proc.stdout.rstrip("\n").endswith(drawn(done))

    proc = fsm_cli(*local(fleet, "explain", "--attempt", "1", "--arm", "hyperstack"))
    assert proc.returncode == 0, proc.stderr
    assert '"rule": "worker-host-fault"' in proc.stdout
    assert "  class  retriable\n  where  VerifyRemote\n" in proc.stdout


def test_explain_needs_an_arm_when_several_ran_the_attempt(fleet: Layout) -> None:
    line = one_line(fsm_cli(*local(fleet, "explain", "--attempt", "1")), 2)
    assert "attempt 1" in line and "hyperstack, lambda" in line and "--arm" in line


def test_explain_of_an_unreadable_marker_says_so(fleet: Layout) -> None:
    proc = fsm_cli(*local(fleet, "explain", "--attempt", "2"))
    assert proc.returncode == 0, proc.stderr
    assert "unreadable: not JSON" in proc.stdout and '{"ok": tru' in proc.stdout
    assert "decided by  unknown: the marker is unreadable" in proc.stdout
    assert "path  cannot be drawn: the marker is unreadable" in proc.stdout


def test_explain_of_a_missing_attempt_is_one_line_exit_1(fleet: Layout) -> None:
    line = one_line(fsm_cli(*local(fleet, "explain", "--attempt", "9")), 1)
    assert "attempt 9" in line and f"{ARM}_attempt0.json" in line
    line = one_line(fsm_cli(*local(fleet, "explain", "--attempt", "0", "--arm", "hyperstack")), 1)
    assert "hyperstack_attempt0.json" in line


def test_the_store_can_come_from_flash_store(fleet: Layout) -> None:
    proc = fsm_cli("status", "--repo", REPO, "--prefix", PREFIX,
                   env={"FLASH_STORE": fleet.store_url})
    assert proc.returncode == 0, proc.stderr
    assert len(table(proc.stdout)) == 5


def test_no_markers_is_one_line_and_exit_0(layout: Layout) -> None:
    proc = fsm_cli(*local(layout, "status"))
    assert (proc.returncode, proc.stderr) == (0, "")
    assert proc.stdout.count("\n") == 1 and proc.stdout.startswith("no attempt markers under ")
    proc = fsm_cli(*local(layout, "status", "--json"))
    assert (proc.returncode, json.loads(proc.stdout)) == (0, [])


def test_explain_without_a_console_tail_and_with_an_unknown_rule(layout: Layout) -> None:
    folder = layout.store / PREFIX
    folder.mkdir(parents=True)
    odd = marker(4, rule="rule-of-the-future", ok=False, retriable=False)
    (folder / "lambda_attempt4.json").write_text(json.dumps(odd))
    proc = fsm_cli(*local(layout, "explain", "--attempt", "4"))
    assert proc.returncode == 0, proc.stderr
    assert "decided by  rule-of-the-future: not a rule of this runner's policy" in proc.stdout
    assert "console tail  no console tail in the store" in proc.stdout
    assert proc.stdout.rstrip("\n").endswith(drawn(odd))


def test_a_missing_local_store_is_one_line_exit_1(tmp_path: Path) -> None:
    url = (tmp_path / "nowhere").as_uri()
    for command in (["status"], ["explain", "--attempt", "0"]):
        line = one_line(fsm_cli(*command, "--repo", REPO, "--prefix", PREFIX, "--store", url), 1)
        assert "store unavailable" in line and "not a directory" in line


@pytest.mark.parametrize(
    ("args", "env", "says"),
    [
        (["status", "--prefix", PREFIX], {}, "the following arguments are required: --repo"),
        (["status", "--repo", REPO], {}, "the following arguments are required: --prefix"),
        (["status", "--repo", "no-slash", "--prefix", PREFIX], {}, "--repo 'no-slash'"),
        (["status", "--repo", REPO, "--prefix", "../up"], {}, "--prefix '../up'"),
        (["status", "--repo", REPO, "--prefix", PREFIX, "--store", "s3://b"], {}, "--store"),
        (["status", "--repo", REPO, "--prefix", PREFIX, "--store", "file://rel/dir"], {},
         "file:///absolute/dir"),
        (["status", "--repo", REPO, "--prefix", PREFIX], {"FLASH_STORE": "ftp://x"},
         "FLASH_STORE='ftp://x'"),
        (["status", "--repo", REPO, "--prefix", PREFIX, "--timeout", "0"], {}, "--timeout"),
        (["explain", "--repo", REPO, "--prefix", PREFIX], {},
         "the following arguments are required: --attempt"),
        (["explain", "--repo", REPO, "--prefix", PREFIX, "--attempt", "-1"], {}, "--attempt"),
        (["explain", "--repo", REPO, "--prefix", PREFIX, "--attempt", "1.5"], {}, "--attempt"),
        (["explain", "--repo", REPO, "--prefix", PREFIX, "--attempt", "x"], {}, "--attempt"),
        (["explain", "--repo", REPO, "--prefix", PREFIX, "--attempt", "1", "--arm", "a/b"], {},
         "--arm 'a/b'"),
    ],
)
def test_a_bad_command_line_is_one_line_exit_2(
    args: list[str], env: dict[str, str], says: str
) -> None:
    assert says in one_line(fsm_cli(*args, env=env), 2)


def test_run_does_not_import_the_fleet_view() -> None:
    code = ("import sys; from fsm import cli; cli.build_parser().parse_args(['run']); "
            "print(sorted(m for m in sys.modules if m in ('fsm.ops.fleet', 'fsm.payload', "
            "'fsm.store', 'fsm.policy', 'fsm.ops.diagram', 'huggingface_hub')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=60)
    assert proc.stdout.strip() == "[]"


# --- the local Hub server -------------------------------------------------------------------


@pytest.fixture
def hub(hub_server: LocalHubServer) -> LocalHubServer:
    """The server's repo holds two arms' attempt 0, attempt 1 of one of them, a console tail
    that carries the token (as if it had leaked) and a file that is no marker."""
    hub_server.create_repo(REPO)
    put = hub_server.add_file
    put(REPO, f"{PREFIX}/lambda_attempt0.json", json.dumps(marker(0)))
    put(REPO, f"{PREFIX}/hyperstack_attempt0.json",
        json.dumps(marker(0, ok=True, retriable=False, rule="completion-confirmed", error="",
                          ts=time.time() - 4 * 86_400 - 5)))
    put(REPO, f"{PREFIX}/lambda_attempt1.json", json.dumps(marker(
        1, retriable=False, rule="worker-failed", state="Train", ts=time.time() - 192.1,
        path=["LoadPayload", "InstallExtras", "FetchCode", "ResolveSpec", "Train", "Mark"])))
    put(REPO, f"{PREFIX}/metrics.json", "{}")
    return hub_server


def on_hub(server: LocalHubServer, *args: str) -> list[str]:
    return [*args, "--repo", REPO, "--prefix", PREFIX, "--store", server.url]


@pytest.mark.hub
def test_status_on_the_hub(hub: LocalHubServer, hub_token: str) -> None:
    env = {"HF_TOKEN": hub_token}
    proc = fsm_cli(*on_hub(hub, "status"), env=env, secrets=(hub_token,))
    assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr
    rows = table(proc.stdout)[1:]
    assert [r[:6] for r in rows[:2]] == [
        ["hyperstack", "0", "ok", "succeeded", "completion-confirmed", "4d"],
        [ARM, "0", "failed", "retriable", "worker-host-fault", "2h05m"],
    ]
    assert rows[2][:5] == [ARM, "1", "failed", "fatal", "worker-failed"]
    # written 192.1 s before the command, which a loaded machine starts seconds later
    assert rows[2][5] in {f"3m{s}s" for s in range(12, 23)}
    hub.clear_requests()
    proc = fsm_cli(*on_hub(hub, "status", "--json"), env=env, secrets=(hub_token,))
    assert [(r["arm"], r["attempt"], r["state"]) for r in json.loads(proc.stdout)] == [
        ("hyperstack", 0, "VerifyRemote"), (ARM, 0, "VerifyRemote"), (ARM, 1, "Train")]
    # one listing, then one download per marker
    gets = [r.path for r in hub.requests if r.method == "GET"]
    assert sum("/tree/" in p for p in gets) == 1
    assert sorted(p.rsplit("/", 1)[-1] for p in gets if "/resolve/" in p) == [
        "hyperstack_attempt0.json", "lambda_attempt0.json", "lambda_attempt1.json"]


@pytest.mark.hub
def test_explain_on_the_hub_masks_the_token(hub: LocalHubServer, hub_token: str) -> None:
    lines = [f"step {i}" for i in range(25)] + [f"oops HF_TOKEN={hub_token}"]
    hub.add_file(REPO, f"{PREFIX}/console_sft.txt", "\n".join(lines) + "\n")
    env = {"HF_TOKEN": hub_token}
    proc = fsm_cli(*on_hub(hub, "explain", "--attempt", "1"), env=env, secrets=(hub_token,))
    assert proc.returncode == 0, proc.stderr
    assert "decided by  worker-failed\n  class  fatal\n" in proc.stdout
    assert tail_lines(proc.stdout) == [f"step {i}" for i in range(6, 25)] + ["oops HF_TOKEN=***"]
    assert "note: the prefix holds other attempts' markers too" in proc.stdout
    assert "Class Train s_decided_fatal" in proc.stdout
    # the arm is needed for attempt 0
    line = one_line(fsm_cli(*on_hub(hub, "explain", "--attempt", "0"), env=env), 2)
    assert "hyperstack, lambda" in line


@pytest.mark.hub
def test_the_hub_by_default_at_hf_endpoint(hub: LocalHubServer, hub_token: str) -> None:
    proc = fsm_cli("status", "--repo", REPO, "--prefix", PREFIX, "--json",
                   env={"HF_TOKEN": hub_token, "HF_ENDPOINT": hub.url}, secrets=(hub_token,))
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)) == 3


@pytest.mark.hub
def test_a_refused_token_is_one_line_exit_1(hub: LocalHubServer, hub_token: str) -> None:
    wrong = f"hf_wrong_{hub_token}"
    for command in (["status"], ["explain", "--attempt", "1"]):
        proc = fsm_cli(*on_hub(hub, *command), env={"HF_TOKEN": wrong},
                       secrets=(hub_token, wrong))
        line = one_line(proc, 1)
        assert "refused the credentials" in line and "HTTP 401" in line


@pytest.mark.hub
def test_an_unavailable_hub_is_one_line_exit_1(hub: LocalHubServer, hub_token: str) -> None:
    env = {"HF_TOKEN": hub_token, "FLASH_STORE_MAX_ATTEMPTS": "1"}
    # One try of the adapter's; within it huggingface_hub 2.x retries a listing itself (5
    # more, 1 to 8 s apart, inside the --timeout bound), 0.x does not.
    hub.fail("GET", r"/tree/", status=503, times=100)
    line = one_line(fsm_cli(*on_hub(hub, "status"), env=env, secrets=(hub_token,)), 1)
    assert "store unavailable" in line and "HTTP 503" in line
    assert 1 <= len([r for r in hub.requests if "/tree/" in r.path]) <= 6
    hub.clear_faults()
    hub.fail("GET", r"/resolve/.*lambda_attempt1\.json", status=507, times=100)
    line = one_line(fsm_cli(*on_hub(hub, "explain", "--attempt", "1"), env=env), 1)
    assert "store unavailable" in line and "lambda_attempt1.json" in line
    hub.clear_faults()
    # a store that does not answer: --timeout bounds the wait
    hub.hang("GET", r"/tree/", seconds=20, times=100)
    started = time.monotonic()
    proc = fsm_cli(*on_hub(hub, "status", "--timeout", "1.5"), env=env, secrets=(hub_token,))
    assert "did not answer within --timeout 1.5s" in one_line(proc, 1)
    assert time.monotonic() - started < 10


def test_hostile_store_contents_are_skipped_and_said_never_fatal_to_the_rest(
    layout: Layout,
) -> None:
    """A link out of the store's root, a 50 MB marker, NaN, and a look-alike name beside
    good markers (issue 26 item 5): status lists every attempt, the hostile ones as
    unreadable, --json stays JSON, and explain still explains a good one."""
    folder = layout.store / PREFIX
    folder.mkdir(parents=True)
    (folder / "lambda_attempt0.json").write_text(json.dumps(marker(0)))
    (folder / "lambda_attempt1.json").write_text(
        '{"ok": false, "ts": NaN, "attempt": 1, "retriable": true, "error": "n"}')
    (folder / "lambda_attempt01.json").write_text(json.dumps(marker(1, error="look-alike")))
    (folder / "lambda_attempt2.json").symlink_to("/etc/hostname")
    with open(folder / "lambda_attempt3.json", "wb") as big:
        big.truncate(50 << 20)

    proc = fsm_cli(*local(layout, "status"))
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines()[1:]]
    assert [(r[1], r[2]) for r in rows] == [("0", "failed"), ("1", "failed"),
                                           ("2", "unreadable"), ("3", "unreadable")]
    listed = json.loads(fsm_cli(*local(layout, "status", "--json")).stdout)  # valid JSON
    assert [row["file"] for row in listed] == [f"lambda_attempt{i}.json" for i in range(4)]
    assert listed[1]["ts"] is None  # NaN is no time

    explained = fsm_cli(*local(layout, "explain", "--attempt", "0"))
    assert explained.returncode == 0, explained.stderr
    assert "worker exited 1; GPU fault" in explained.stdout
    assert "look-alike" not in fsm_cli(*local(layout, "explain", "--attempt", "1")).stdout


def test_explain_reads_a_huge_console_file_no_further_than_its_bound(layout: Layout) -> None:
    folder = layout.store / PREFIX
    folder.mkdir(parents=True)
    (folder / "lambda_attempt0.json").write_text(json.dumps(marker(0)))
    with open(folder / "console_sft.txt", "wb") as huge:
        huge.truncate(200 << 20)
    proc = fsm_cli(*local(layout, "explain", "--attempt", "0"))
    assert proc.returncode == 0, proc.stderr
    assert "larger than 4,194,304 bytes, not a file the runner wrote; not shown" in proc.stdout
    assert len(proc.stdout) < 20_000

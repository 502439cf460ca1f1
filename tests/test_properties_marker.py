"""The marker's destination and the persisted result, through the real runner as a process.

For generated payloads (valid; invalid in exactly one destination key; valid with another
run's persisted result next to it; valid with a malformed persisted record; valid with this
very attempt's persisted result) ``python -m fsm run`` writes a marker iff the destination
is valid as given, at exactly ``<hf_prefix>/<flash_arm>_attempt<attempt>.json`` and nowhere
else; the marker carries this payload's ``run_id`` and is the result of running this
attempt's worker, unless this attempt's own result was persisted (then it is replayed and
the worker does not run); a record that is not exactly this attempt's is moved aside, kept
byte for byte, logged, and never published; the exit status says what was published
(CONTRACT sections 2-4).
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from conftest import CANARY, Layout
from hypothesis import event, example, given
from hypothesis import strategies as st

Situation = Literal["fresh", "invalid", "own", "foreign", "malformed"]
DEST_KEYS = ("hf_repo", "hf_prefix", "flash_arm", "attempt")
#: Text only a record written before this run carries: it must never reach the store.
STALE = "STALE-record-of-an-earlier-container"
RESULT_VERSION = 1  # the persisted result's format (CONTRACT section 4's persisted result)


@dataclass(frozen=True)
class Case:
    situation: Situation
    #: The destination keys, ``run_id`` and the spec's prefix as written (None: absent).
    fields: dict[str, Any]
    worker_succeeds: bool
    #: The bytes found at the attempt's result path before the run, if any.
    record: bytes | None = None
    #: What the record is (which key is invalid, how the record differs or is malformed).
    note: str = ""
    #: The marker an exactly-matching record carries (situation "own").
    replayed: dict[str, Any] | None = field(default=None, compare=False)

    @property
    def arm(self) -> str:
        return self.fields["flash_arm"] if self.fields["flash_arm"] is not None else "instance"

    @property
    def attempt(self) -> int:
        return self.fields["attempt"] if self.fields["attempt"] is not None else 0

    @property
    def marker_path(self) -> str:
        return f"{self.fields['hf_prefix']}/{self.arm}_attempt{self.attempt}.json"

    @property
    def result_name(self) -> str:
        return f".flash-{self.arm}_attempt{self.attempt}.result.json"

    def identity(self, **differ: Any) -> dict[str, Any]:
        ident = {
            "hf_repo": self.fields["hf_repo"],
            "hf_prefix": self.fields["hf_prefix"],
            "run_id": self.fields["run_id"],
            "mode": "train",
            "flash_arm": self.arm,
            "attempt": self.attempt,
        }
        return {**ident, **differ}


# --- generated payloads and records ------------------------------------------------------------

NAME = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,11}", fullmatch=True)
UNICODE_PART = st.text(st.characters(categories=("L", "N")), min_size=1, max_size=6)
PREFIX = st.lists(NAME | UNICODE_PART, min_size=1, max_size=3).map("/".join)
REPO = st.builds(lambda org, name: f"{org}/{name}", NAME, NAME)
ATTEMPT = st.integers(0, 3) | st.integers(0, 1_000_000)
RUN_ID = st.none() | st.from_regex(r"run-[a-z0-9]{1,8}", fullmatch=True)

#: Values each destination key must refuse as given (CONTRACT section 3); None: absent.
INVALID: dict[str, st.SearchStrategy[Any]] = {
    "hf_repo": st.sampled_from(
        [None, "", "noslash", "/lead", "org/", "a/b/c", "-org/name", "org/na me", 5,
         ["org/name"], "org/" + "n" * 200]
    ),
    "hf_prefix": st.sampled_from(
        [None, "", "/abs/run", "a/../b", "a//b", ".", "a/./b", "a\\b", "x/.git/y", ".cache",
         "a\x00b", "a\nb", "x" * 256, "a/" * 501, 7, ["sft"]]
    ),
    "flash_arm": st.sampled_from(
        ["", "-lead", "a/b", "x" * 65, "a b", ".hidden", "ü", 7, True, ["lambda"]]
    ),
    "attempt": st.sampled_from([-1, 1_000_001, True, False, 1.0, 0.0, "0", "1", [0], 2**64]),
}


@st.composite
def valid_fields(draw: st.DrawFn) -> dict[str, Any]:
    return {
        "hf_repo": draw(REPO),
        "hf_prefix": draw(PREFIX),
        "flash_arm": draw(st.none() | NAME),  # absent: the default arm "instance"
        "attempt": draw(st.none() | ATTEMPT),  # absent: the default attempt 0
        "run_id": draw(RUN_ID),
    }


def stale_marker(case: Case, *, ok: bool, retriable: bool) -> dict[str, Any]:
    """A well-formed marker of ``case``'s attempt, as an earlier container persisted it."""
    return {
        "ok": ok,
        "ts": 1_700_000_000.5,
        "attempt": case.attempt,
        "retriable": retriable and not ok,
        "error": "" if ok else f"worker exited 1 ({STALE})",
        "state": "VerifyRemote",
        "rule": "completion-confirmed" if ok else "worker-failed",
        "run_id": case.fields["run_id"],
    }


def record_bytes(ident: dict[str, Any], marker: object) -> bytes:
    return json.dumps(
        {"version": RESULT_VERSION, "identity": ident, "marker": marker,
         "artifacts": {"console_sft.txt": f"the earlier container's tail ({STALE})\n"}}
    ).encode()


#: How the marker of a record of this very attempt can be malformed: (note, mutation).
MALFORMED_MARKER: list[tuple[str, Callable[[dict[str, Any]], object]]] = [
    ("ok missing", lambda m: {k: v for k, v in m.items() if k != "ok"}),
    ("ok a string", lambda m: {**m, "ok": "true"}),
    ("ok a number", lambda m: {**m, "ok": 1}),
    ("retriable missing", lambda m: {k: v for k, v in m.items() if k != "retriable"}),
    ("retriable a string", lambda m: {**m, "retriable": "false"}),
    ("retriable null", lambda m: {**m, "retriable": None}),
    ("attempt missing", lambda m: {k: v for k, v in m.items() if k != "attempt"}),
    ("attempt a string", lambda m: {**m, "attempt": str(m["attempt"])}),
    ("attempt a float", lambda m: {**m, "attempt": float(m["attempt"])}),
    ("attempt another", lambda m: {**m, "attempt": m["attempt"] + 1}),
    ("attempt a bool", lambda m: {**m, "attempt": True}),
    ("ts missing", lambda m: {k: v for k, v in m.items() if k != "ts"}),
    ("ts a string", lambda m: {**m, "ts": "yesterday"}),
    ("ts a bool", lambda m: {**m, "ts": True}),
    ("ts NaN", lambda m: {**m, "ts": math.nan}),
    ("error a number", lambda m: {**m, "error": 1}),
    ("marker not an object", lambda m: [m]),
]


@st.composite
def cases(draw: st.DrawFn) -> Case:
    situation: Situation = draw(
        st.sampled_from(["fresh", "invalid", "own", "foreign", "malformed"])
    )
    fields = draw(valid_fields())
    succeeds = draw(st.booleans())
    if situation == "fresh":
        return Case(situation, fields, succeeds)
    if situation == "invalid":
        key = draw(st.sampled_from(DEST_KEYS))
        fields[key] = draw(INVALID[key])
        return Case(situation, fields, succeeds, note=f"{key}={fields[key]!r:.40}")
    case = Case(situation, fields, succeeds)
    marker = stale_marker(case, ok=draw(st.booleans()), retriable=draw(st.booleans()))
    if situation == "own":
        return Case(situation, fields, succeeds, record_bytes(case.identity(), marker),
                    "this attempt's", replayed=marker)
    if situation == "foreign":
        differ = draw(st.sampled_from(["run_id", "mode", "hf_prefix", "hf_repo"]))
        other = {
            "run_id": f"{fields['run_id'] or 'run'}-other",
            "mode": "preload",
            "hf_prefix": f"{fields['hf_prefix']}/other",
            "hf_repo": f"{fields['hf_repo']}x",
        }[differ]
        return Case(situation, fields, succeeds,
                    record_bytes(case.identity(**{differ: other}), marker), f"{differ} differs")
    how = draw(st.sampled_from(
        [*(note for note, _ in MALFORMED_MARKER), "not JSON", "empty", "not UTF-8",
         "not an object", "old format (a bare marker)"]
    ))
    mutate = dict(MALFORMED_MARKER).get(how)
    data = {
        "not JSON": record_bytes(case.identity(), marker)[:-7],
        "empty": b"",
        "not UTF-8": b"\xff\xfe" + STALE.encode(),
        "not an object": json.dumps([STALE]).encode(),
        "old format (a bare marker)": json.dumps(marker).encode(),
    }.get(how)
    if mutate is not None:
        data = record_bytes(case.identity(), mutate(marker))
    assert data is not None
    return Case(situation, fields, succeeds, data, how)


# --- running one case --------------------------------------------------------------------------


@dataclass
class Run:
    layout: Layout
    case: Case
    returncode: int
    stderr: str
    started: float

    @property
    def worker_ran(self) -> Path:
        return self.layout.root / "worker-ran"

    def store_files(self) -> dict[str, Path]:
        """Every file in the store outside ``code/`` (what the control plane put there)."""
        return {
            path.relative_to(self.layout.store).as_posix(): path
            for path in self.layout.store.rglob("*")
            if path.is_file() and path.relative_to(self.layout.store).parts[0] != "code"
        }

    def logged(self, msg: str) -> list[dict[str, Any]]:
        lines = []
        for line in self.stderr.splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict) and entry.get("msg") == msg:
                lines.append(entry)
        return lines


def worker_body(flag: Path, succeeds: bool) -> str:
    """Say that the worker ran (and as which attempt), then succeed or fail."""
    finish = "complete()" if succeeds else "sys.exit(1)"
    return (
        f"Path({str(flag)!r}).write_text(os.environ['FLASH_ARM'] + ' ' + os.environ['ATTEMPT'])\n"
        f"{finish}\n"
    )


def run_case(root: Path, case: Case) -> Run:
    layout = Layout(root)
    for sub in ("store", "scratch", "runcode", "flash"):
        (root / sub).mkdir()
    layout.write_worker(worker_body(root / "worker-ran", case.worker_succeeds))
    prefix = case.fields["hf_prefix"]
    layout.write_payload(
        **{key: case.fields[key] for key in (*DEST_KEYS, "run_id")},
        job_spec_json=json.dumps({"hf_prefix": prefix if isinstance(prefix, str) else "x"}),
    )
    if case.record is not None:
        (layout.payload_path.parent / case.result_name).write_bytes(case.record)
    started = time.time()
    proc = layout.cli(*layout.run_args())
    return Run(layout, case, proc.returncode, proc.stderr.decode("utf-8", "replace"), started)


# --- the property ------------------------------------------------------------------------------


def _check_no_marker(run: Run) -> None:
    """An unusable destination: status 2, nothing written for any attempt, no worker."""
    assert run.returncode == 2, run.stderr[-2000:]
    assert run.store_files() == {}, "no marker (nor anything else) at a coerced path"
    written = {p.name for p in run.layout.payload_path.parent.iterdir()}
    assert written == {"payload.json"}, "no persisted result, no lock"
    assert not run.worker_ran.exists()


def _check_marker(run: Run) -> dict[str, Any]:
    """A usable destination: the one marker at exactly its path; the status says it."""
    case = run.case
    files = run.store_files()
    markers = [name for name in files if name.endswith(".json") and name.rsplit("/", 1)[-1]
               not in ("metrics.json",)]
    assert markers == [case.marker_path], (markers, run.stderr[-2000:])
    prefix = case.fields["hf_prefix"]
    allowed = {f"{prefix}/{name}" for name in ("DONE", "metrics.json", "console_sft.txt")}
    assert set(files) <= {case.marker_path} | allowed, set(files)
    marker = json.loads(files[case.marker_path].read_text())
    assert isinstance(marker, dict)
    assert (marker["attempt"], marker["run_id"]) == (case.attempt, case.fields["run_id"])
    expected = 0 if marker["ok"] is True else 75 if marker["retriable"] is True else 1
    assert run.returncode == expected, run.stderr[-2000:]
    return marker


def _check_set_aside(run: Run) -> None:
    """The record that was not exactly this attempt's is kept aside byte for byte, logged,
    and never published: the result file now holds this run's own outcome."""
    case = run.case
    folder = run.layout.payload_path.parent
    aside = sorted(folder.glob(f"{case.result_name}.set-aside-*"))
    assert len(aside) == 1, sorted(p.name for p in folder.iterdir())
    assert aside[0].read_bytes() == case.record
    logged = run.logged("result.set_aside")
    assert [entry["kept_as"] for entry in logged] == [str(aside[0])]
    for path in run.layout.store.rglob("*"):
        if path.is_file():
            assert STALE.encode() not in path.read_bytes(), f"the set-aside record reached {path}"
    persisted = json.loads((folder / case.result_name).read_text())
    assert persisted["identity"] == case.identity()


def _check_canary_nowhere(run: Run) -> None:
    for path in run.layout.store.rglob("*"):
        if path.is_file():
            assert CANARY.encode() not in path.read_bytes(), f"token leaked into {path}"


_FIELDS = {"hf_repo": "org/flash-runs", "hf_prefix": "sft/run-1/seed3", "flash_arm": "lambda",
           "attempt": 2, "run_id": "run-1"}
_OWN = Case("own", _FIELDS, False)


@given(cases())
@example(Case("fresh", {**_FIELDS, "flash_arm": None, "attempt": None}, True))
@example(Case("invalid", {**_FIELDS, "attempt": True}, True, note="attempt=True"))
@example(Case("invalid", {**_FIELDS, "hf_prefix": "a/../b"}, True, note="hf_prefix=a/../b"))
@example(Case("own", _FIELDS, False,
              record_bytes(_OWN.identity(), stale_marker(_OWN, ok=True, retriable=False)),
              "this attempt's", replayed=stale_marker(_OWN, ok=True, retriable=False)))
@example(Case("foreign", _FIELDS, True,
              record_bytes(_OWN.identity(run_id="run-0"), stale_marker(_OWN, ok=False,
                                                                       retriable=True)),
              "run_id differs"))
@example(Case("malformed", _FIELDS, True,
              json.dumps(stale_marker(_OWN, ok=True, retriable=False)).encode(),
              "old format (a bare marker)"))
def test_a_marker_is_written_iff_its_destination_is_valid_and_replays_only_this_attempt(
    case: Case,
) -> None:
    """A marker iff hf_repo, hf_prefix, flash_arm and attempt are valid as given, at exactly
    <hf_prefix>/<flash_arm>_attempt<attempt>.json and nowhere else, carrying this payload's
    run_id; it is the outcome of running this attempt's worker, unless this attempt's own
    result was persisted (then it is replayed as it was and the worker does not run); any
    other record at the result path (another run's, another mode's, malformed, an old
    format) is moved aside, kept, logged and never published; status 0 with ok, 1 without,
    2 (and nothing written) for an unusable destination."""
    event(case.situation)
    with tempfile.TemporaryDirectory(prefix="flash-marker-") as tmp:
        run = run_case(Path(tmp), case)
        _check_canary_nowhere(run)
        if case.situation == "invalid":
            _check_no_marker(run)
            return
        marker = _check_marker(run)
        folder = run.layout.payload_path.parent
        if case.situation == "own":
            assert marker == case.replayed, "replayed as persisted"
            assert not run.worker_ran.exists(), "a replay does not run the worker again"
            assert not list(folder.glob("*.set-aside-*"))
            assert (folder / case.result_name).read_bytes() == case.record
            tail = run.layout.store / case.fields["hf_prefix"] / "console_sft.txt"
            assert tail.read_text() == f"the earlier container's tail ({STALE})\n", (
                "the persisted artifacts go up with the replayed marker"
            )
            return
        assert run.worker_ran.read_text() == f"{case.arm} {case.attempt}", "this attempt ran"
        assert marker["ok"] is case.worker_succeeds
        assert marker["ts"] >= run.started
        if case.situation == "fresh":
            assert not list(folder.glob("*.set-aside-*"))
            assert run.logged("result.set_aside") == []
        else:
            _check_set_aside(run)

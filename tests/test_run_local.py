"""Whole attempts through the machine on the local store, with real worker processes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import ARM, CANARY, PREFIX, TRAIN_PATH, Layout, assert_no_secret

from fsm import table
from fsm.output.redact import Redactor


def test_a_worker_that_uploads_metrics_and_done_succeeds(layout: Layout) -> None:
    layout.write_worker("print('training'); complete()")
    outcome = layout.run()
    assert outcome.exit_code == 0
    assert outcome.context.path == TRAIN_PATH
    marker = layout.marker()
    assert marker is not None
    assert marker["ok"] is True
    assert marker["retriable"] is False
    assert marker["error"] == ""
    assert marker["attempt"] == 0
    assert marker["rule"] == "completion-confirmed"
    assert marker["run_id"] == "run-1"
    assert marker["worker"]["exit_code"] == 0
    assert marker["path"] == TRAIN_PATH[:-1]
    assert isinstance(marker["ts"], float)
    assert b"training" in (layout.root / "stdout.bin").read_bytes()


def test_a_worker_that_crashes_after_uploading_done_still_succeeds(layout: Layout) -> None:
    layout.write_worker("complete(); sys.exit(139)")
    outcome = layout.run()
    assert outcome.exit_code == 0
    marker = layout.marker()
    assert marker is not None and marker["ok"] is True
    assert marker["worker"]["exit_code"] == 139


def test_a_worker_that_crashes_before_writing_anything_fails_the_run(layout: Layout) -> None:
    layout.write_worker("print('boom', file=sys.stderr); sys.exit(3)")
    outcome = layout.run()
    assert outcome.exit_code == 1
    marker = layout.marker()
    assert marker is not None
    assert (marker["ok"], marker["retriable"], marker["rule"]) == (False, False, "worker-failed")
    assert "exited 3" in marker["error"]
    assert marker["state"] == "VerifyRemote"
    # A failed attempt always leaves its console tail in the store.
    assert b"boom" in layout.artifact("console_sft.txt").read_bytes()


def test_a_worker_killed_by_a_signal_is_reported_by_signal_name(layout: Layout) -> None:
    layout.write_worker("import signal; os.kill(os.getpid(), signal.SIGSEGV)")
    layout.run()
    marker = layout.marker()
    assert marker is not None
    assert marker["worker"]["signal"] == "SIGSEGV"
    assert marker["rule"] == "worker-failed"


def test_local_metrics_without_remote_artifacts_is_a_lost_upload_and_retriable(
    layout: Layout,
) -> None:
    layout.write_worker("write_metrics(); sys.exit(1)")
    outcome = layout.run()
    marker = layout.marker()
    assert marker is not None
    assert (marker["ok"], marker["retriable"], marker["rule"]) == (
        False,
        True,
        "worker-upload-lost",
    )
    assert outcome.terminal == table.FAILED_RETRIABLE
    assert outcome.exit_code == 75


def test_metrics_without_done_is_not_a_success(layout: Layout) -> None:
    layout.write_worker("upload(write_metrics(), 'metrics.json')")
    layout.run()
    marker = layout.marker()
    assert marker is not None
    assert marker["ok"] is False
    assert "DONE" in marker["error"]


def test_the_workers_own_retriable_heartbeat_for_this_attempt_makes_it_retriable(
    layout: Layout,
) -> None:
    layout.write_worker("""
        beat = SCRATCH / "hb.json"
        beat.write_text(json.dumps({"stage": "x", "ts": 1, "attempt": 2, "retriable": True}))
        upload(beat, "heartbeat.json")
        sys.exit(1)
    """)
    layout.run(attempt=2)
    marker = layout.marker(attempt=2)
    assert marker is not None
    assert (marker["retriable"], marker["rule"]) == (True, "worker-heartbeat-retriable")


def test_a_retriable_heartbeat_of_another_attempt_is_ignored(layout: Layout) -> None:
    layout.write_worker("""
        beat = SCRATCH / "hb.json"
        beat.write_text(json.dumps({"stage": "x", "ts": 1, "attempt": 0, "retriable": True}))
        upload(beat, "heartbeat.json")
        sys.exit(1)
    """)
    layout.run(attempt=1)
    marker = layout.marker(attempt=1)
    assert marker is not None
    assert (marker["retriable"], marker["rule"]) == (False, "worker-failed")


def test_the_worker_gets_the_contract_environment(layout: Layout) -> None:
    layout.write_worker("""
        keys = ["PHASE", "RUN_MODE", "SEED", "FLASH_ARM", "ATTEMPT", "FLASH_JOB_SPEC_JSON",
                "FLASH_RUN_DEADLINE_AT", "FLASH_SCRATCH_DIR", "FLASH_STORE", "PYTHONPATH",
                "CUSTOM", "FLASH_JOB_SPEC_PATH"]
        (SCRATCH / "env.json").write_text(json.dumps({k: os.environ.get(k) for k in keys}))
        (SCRATCH / "cwd.txt").write_text(os.getcwd())
        complete()
    """)
    layout.run(
        attempt=4,
        flash_arm="hyperstack",
        max_wall_s=1000,
        env={
            "HF_TOKEN": CANARY,
            "CUSTOM": "yes",
            "FLASH_ARM": "runpod",
            "PYTHONPATH": "/opt/extra",
        },
    )
    env = json.loads((layout.scratch / "env.json").read_text())
    assert env["PHASE"] == env["RUN_MODE"] == "sft"
    assert env["SEED"] == "3"
    assert env["FLASH_ARM"] == "hyperstack"  # the payload env said runpod: overridden
    assert env["ATTEMPT"] == "4"
    assert json.loads(env["FLASH_JOB_SPEC_JSON"])["hf_prefix"] == PREFIX
    assert env["FLASH_JOB_SPEC_PATH"] is None
    assert env["FLASH_SCRATCH_DIR"] == str(layout.scratch)
    assert env["FLASH_STORE"] == layout.store_url
    assert env["CUSTOM"] == "yes"
    code_dir = str(layout.code_root / "code")
    assert env["PYTHONPATH"].split(os.pathsep) == [code_dir, "/opt/extra"]
    assert (layout.scratch / "cwd.txt").read_text() == code_dir
    import time as _time

    assert _time.time() < float(env["FLASH_RUN_DEADLINE_AT"]) < _time.time() + 1000


def test_a_spec_over_96000_bytes_reaches_the_worker_as_a_file(layout: Layout) -> None:
    layout.write_worker("""
        (SCRATCH / "spec_env.json").write_text(json.dumps({
            "inline": os.environ.get("FLASH_JOB_SPEC_JSON"),
            "path": os.environ.get("FLASH_JOB_SPEC_PATH"),
            "size": len(SPEC["big"]),
        }))
        complete()
    """)
    outcome = layout.run(spec={"big": "x" * 100_000})
    assert outcome.exit_code == 0
    seen = json.loads((layout.scratch / "spec_env.json").read_text())
    assert seen["inline"] is None
    assert seen["size"] == 100_000
    assert Path(seen["path"]).parent == layout.scratch


def test_a_spilled_spec_is_fetched_from_the_store(layout: Layout) -> None:
    layout.write_worker("assert SPEC['spilled'] is True; complete()")
    spill = layout.store / PREFIX / "job_spec.json"
    spill.parent.mkdir(parents=True)
    spill.write_text(json.dumps({"hf_prefix": PREFIX, "spilled": True}))
    outcome = layout.run(job_spec_json=None, job_spec_in_hf=True)
    assert outcome.exit_code == 0, outcome.reason


def test_a_spilled_spec_missing_from_the_store_is_retriable(layout: Layout) -> None:
    layout.write_worker("complete()")
    outcome = layout.run(job_spec_json=None, job_spec_in_hf=True)
    marker = layout.marker()
    assert marker is not None
    assert (marker["retriable"], marker["rule"], marker["state"]) == (
        True,
        "spec-fetch",
        "ResolveSpec",
    )
    assert outcome.exit_code == 75


def test_no_inline_spec_and_no_spill_flag_is_fatal(layout: Layout) -> None:
    layout.write_worker("complete()")
    layout.run(job_spec_json=None)
    marker = layout.marker()
    assert marker is not None
    assert (marker["retriable"], marker["rule"]) == (False, "spec-absent")


def test_a_stale_metrics_json_is_removed_before_the_worker_starts(layout: Layout) -> None:
    (layout.scratch / "metrics.json").write_text("{}")
    layout.write_worker(
        "(SCRATCH / 'saw.txt').write_text(str((SCRATCH / 'metrics.json').exists())); sys.exit(1)"
    )
    layout.run()
    assert (layout.scratch / "saw.txt").read_text() == "False"
    marker = layout.marker()
    assert marker is not None and marker["rule"] == "worker-failed"  # not a lost upload


def test_a_repo_without_a_worker_module_is_fatal(layout: Layout) -> None:
    (layout.store / "code" / "other").mkdir(parents=True)
    (layout.store / "code" / "other" / "x.py").write_text("")
    layout.run()
    marker = layout.marker()
    assert marker is not None
    assert (marker["retriable"], marker["rule"]) == (False, "code-missing")


def test_a_repo_without_code_is_fatal(layout: Layout) -> None:
    layout.run()
    marker = layout.marker()
    assert marker is not None
    assert (marker["retriable"], marker["rule"], marker["state"]) == (
        False,
        "code-missing",
        "FetchCode",
    )


def test_an_unreachable_store_is_retriable_and_the_marker_stays_local(layout: Layout) -> None:
    layout.write_worker("complete()")
    layout.write_payload()
    outcome = layout.run(environ={})
    assert outcome.exit_code == 0
    # Now the store directory disappears: every store call fails as unavailable.
    gone = layout.root / "store-gone"
    layout.store.rename(gone)
    layout.write_payload(attempt=1)
    outcome = layout.run()
    assert outcome.terminal == table.FAILED_RETRIABLE
    assert outcome.context.failure is not None
    assert outcome.context.failure.rule.id == "store-unavailable"
    local = json.loads((layout.scratch / f"{ARM}_attempt1.json").read_text())
    assert local["retriable"] is True


def test_starting_a_finished_attempt_again_replays_its_marker_and_never_reruns_the_worker(
    layout: Layout,
) -> None:
    layout.write_worker("""
        with open(SCRATCH / "runs.txt", "a") as f:
            f.write("ran\\n")
        complete()
    """)
    first = layout.run()
    assert first.exit_code == 0
    marker_path = layout.artifact(f"{ARM}_attempt0.json")
    original = json.loads(marker_path.read_text())
    marker_path.unlink()  # say the upload of the first marker was lost
    second = layout.run(environ={})
    assert second.context.path == ["LoadPayload", "Mark", "Succeeded"]
    assert second.exit_code == 0
    assert (layout.scratch / "runs.txt").read_text() == "ran\n"
    assert json.loads(marker_path.read_text()) == original


def test_a_replayed_failure_keeps_its_class_and_exit_code(layout: Layout) -> None:
    layout.write_worker("write_metrics(); sys.exit(1)")
    first = layout.run()
    second = layout.run(environ={})
    assert second.context.path == ["LoadPayload", "Mark", "FailedRetriable"]
    assert second.exit_code == first.exit_code == 75


def test_exactly_one_marker_is_written_and_it_is_the_last_artifact(layout: Layout) -> None:
    layout.write_worker("print('x'); complete(); sys.exit(1)")
    layout.run(env={"HF_TOKEN": CANARY, "FLASH_UPLOAD_CONSOLE": "1"})
    markers = layout.markers()
    assert [m.name for m in markers] == [f"{ARM}_attempt0.json"]
    others = [p for p in (layout.store / PREFIX).iterdir() if p not in markers]
    assert others, "the worker's artifacts and the console tail are there too"
    assert all(p.stat().st_mtime_ns <= markers[0].stat().st_mtime_ns for p in others)


def test_the_token_never_reaches_the_store_logs_or_marker(
    layout: Layout, captured_logs: list[dict[str, object]]
) -> None:
    layout.write_worker("""
        print("my token is " + os.environ["HF_TOKEN"])
        raise SystemExit("failing with " + os.environ["HF_TOKEN"])
    """)
    outcome = layout.run()
    assert CANARY not in outcome.reason
    assert CANARY.encode() in (layout.root / "stdout.bin").read_bytes()  # stdout is untouched
    assert b"***" in layout.artifact("console_sft.txt").read_bytes()
    assert_no_secret(layout.store)
    assert CANARY not in json.dumps(captured_logs, default=str)


#: A value no rule masks by its shape (no URL credentials, no header): only as a listed key's.
DSN = "dsn-7Hq2mZ-replica-eu"


@pytest.mark.parametrize("listed_by", ["payload", "host"])
def test_extra_secret_keys_are_redacted_too(
    layout: Layout, captured_logs: list[dict[str, object]], listed_by: str
) -> None:
    """FLASH_SECRET_ENV_KEYS, in the payload's env or the runner's own, makes DB_DSN a
    secret; LoadPayload learns the env with ``Redactor.learn`` and logs the keys it learnt."""
    layout.write_worker("print('db=' + os.environ['DB_DSN'] + ' plain=' + os.environ['PLAIN'])"
                        "; sys.exit(1)")
    env = {"HF_TOKEN": CANARY, "DB_DSN": DSN, "PLAIN": "visible-value"}
    host = {"FLASH_SECRET_ENV_KEYS": "DB_DSN"}
    if listed_by == "payload":
        env, host = {**env, **host}, {}
    layout.run(env=env, environ=host)
    tail = layout.artifact("console_sft.txt").read_bytes()
    assert b"db=*** plain=visible-value" in tail
    assert DSN.encode() not in tail
    redactor = Redactor()
    keys = redactor.learn(env, ["DB_DSN"])
    assert {"DB_DSN", "HF_TOKEN"} <= keys and "PLAIN" not in keys
    # the event is logged through the attempt's redactor, as every event is
    logged = [e["keys"] for e in captured_logs if e["event"] == "secrets.keys"]
    assert logged == [redactor.deep(sorted(keys))]


def test_console_upload_is_off_by_default_on_success(layout: Layout) -> None:
    layout.write_worker("print('quiet'); complete()")
    layout.run()
    assert not layout.artifact("console_sft.txt").exists()


@pytest.mark.parametrize("value", ["1", "true", "yes", "on", "anything"])
def test_console_upload_on_uploads_the_tail_on_success(layout: Layout, value: str) -> None:
    layout.write_worker("print('loud'); complete()")
    layout.run(env={"FLASH_UPLOAD_CONSOLE": value})
    assert b"loud" in layout.artifact("console_sft.txt").read_bytes()


def test_the_uploaded_console_tail_is_the_last_64000_bytes(layout: Layout) -> None:
    layout.write_worker("""
        sys.stdout.write("HEAD" + "a" * 100_000 + "TAIL\\n"); sys.stdout.flush(); sys.exit(2)
    """)
    layout.run()
    tail = layout.artifact("console_sft.txt").read_bytes()
    assert len(tail) == 64_000
    assert tail.endswith(b"TAIL\n")


def test_an_unwritable_scratch_directory_still_gets_its_marker_into_the_store(
    layout: Layout,
) -> None:
    layout.write_worker("complete()")
    layout.scratch.rmdir()
    layout.scratch.write_text("a file where the scratch directory should be")
    outcome = layout.run()
    assert outcome.exit_code == 1
    marker = layout.marker()
    assert marker is not None
    assert (marker["ok"], marker["retriable"], marker["state"]) == (False, False, "LoadPayload")

"""Preload mode on the local store: warm a mounted cache, never ephemeral disk."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import ARM, CANARY, Layout

from fsm.store.base import PRELOAD_IGNORE_PATTERNS

SENTINEL = ".cache-mounted"


def _model(layout: Layout, repo_id: str) -> None:
    root = layout.store / "models" / repo_id
    (root / "original").mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"model": repo_id}))
    (root / "model.safetensors").write_bytes(b"\x00" * 4096)
    (root / "original" / "consolidated.pth").write_bytes(b"skip me")
    (root / "weights.gguf").write_bytes(b"skip me too")


def _preload(
    layout: Layout, models: list[str], *, sentinel: bool = True, **overrides: Any
) -> dict[str, Any]:
    mount = layout.root / "mnt"
    mount.mkdir(exist_ok=True)
    if sentinel:
        (mount / SENTINEL).write_text("")
    payload = layout.payload(
        mode="preload",
        models=models,
        phase=None,
        seed=None,
        job_spec_json=None,
        cache_mount_marker=SENTINEL,
        env={"HF_TOKEN": CANARY, "HF_HOME": str(mount / "hf")},
    )
    payload.update(overrides)
    return payload


def _result(layout: Layout) -> dict[str, Any]:
    return json.loads(layout.artifact("preload_result.json").read_text())


def test_preload_warms_each_model_into_the_standard_hf_cache(layout: Layout) -> None:
    from huggingface_hub import snapshot_download

    for repo in ("org/alpha", "org/beta"):
        _model(layout, repo)
    outcome = layout.run(**_preload(layout, ["org/alpha", "org/beta"]))
    assert outcome.exit_code == 0, outcome.reason
    assert outcome.context.path == ["LoadPayload", "Preload", "Mark", "Succeeded"]
    # The lease was kept while the models warmed; the marker's commit removed it.
    marker = layout.marker()
    assert marker is not None and marker["lease"]["period_s"] == 300
    assert not layout.artifact(f"{ARM}_attempt0.lease.json").exists()
    assert _result(layout) == {
        "preloaded": ["org/alpha", "org/beta"],
        "already_cached": [],
        "failed": {},
    }
    cache = layout.root / "mnt" / "hf" / "hub"
    for repo in ("org/alpha", "org/beta"):
        snapshot = Path(
            snapshot_download(
                repo,
                cache_dir=cache,
                ignore_patterns=list(PRELOAD_IGNORE_PATTERNS),
                local_files_only=True,
            )
        )
        assert json.loads((snapshot / "config.json").read_text()) == {"model": repo}
        assert (snapshot / "model.safetensors").stat().st_size == 4096
        assert not (snapshot / "original").exists()
        assert not (snapshot / "weights.gguf").exists()
    marker = layout.marker()
    assert marker is not None and marker["ok"] is True
    # The result file lands before the marker.
    assert (
        layout.artifact("preload_result.json").stat().st_mtime_ns
        <= layout.artifact("lambda_attempt0.json").stat().st_mtime_ns
    )


def test_a_model_already_in_the_cache_is_skipped(layout: Layout) -> None:
    _model(layout, "org/alpha")
    layout.run(**_preload(layout, ["org/alpha"]))
    outcome = layout.run(**_preload(layout, ["org/alpha"], attempt=1))
    assert outcome.exit_code == 0
    assert _result(layout)["already_cached"] == ["org/alpha"]
    assert _result(layout)["preloaded"] == []


def test_a_missing_cache_mount_is_fatal_and_still_reports_a_result(layout: Layout) -> None:
    _model(layout, "org/alpha")
    payload = _preload(layout, ["org/alpha"])
    payload["env"]["HF_HOME"] = str(layout.root / "not-mounted" / "hf")
    outcome = layout.run(**payload)
    assert outcome.exit_code == 1
    marker = layout.marker()
    assert marker is not None
    assert (marker["retriable"], marker["rule"]) == (False, "preload-unmounted")
    assert "refusing to warm ephemeral disk" in _result(layout)["error"]
    assert not (layout.root / "not-mounted").exists()


@pytest.mark.parametrize("block", [True, False])
def test_a_mount_without_its_sentinel_is_fatal(layout: Layout, block: bool) -> None:
    _model(layout, "org/alpha")
    layout.run(**_preload(layout, ["org/alpha"], sentinel=False, cache_block_device=block))
    marker = layout.marker()
    assert marker is not None
    assert marker["rule"] == "preload-unmounted"
    assert ("block volume" if block else "NFS filesystem") in marker["error"]
    assert not (layout.root / "mnt" / "hf").exists()


def test_a_model_that_cannot_be_warmed_fails_the_preload_after_warming_the_rest(
    layout: Layout,
) -> None:
    _model(layout, "org/alpha")
    layout.run(**_preload(layout, ["org/missing", "org/alpha"]))
    result = _result(layout)
    assert result["preloaded"] == ["org/alpha"]
    assert list(result["failed"]) == ["org/missing"]
    marker = layout.marker()
    assert marker is not None
    assert (marker["retriable"], marker["rule"]) == (False, "preload-model-failed")


def test_preload_needs_no_code_pip_or_worker(layout: Layout) -> None:
    _model(layout, "org/alpha")
    outcome = layout.run(**_preload(layout, ["org/alpha"], extra_pip=["no-such-package==0"]))
    assert outcome.exit_code == 0
    assert not (layout.code_root / "code").exists()

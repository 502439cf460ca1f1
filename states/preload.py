"""Preload: warm the mounted weight cache with the payload's models; no code, no worker.

Refuses to warm ephemeral disk: the parent of ``HF_HOME`` must exist and, when the
payload names a sentinel, hold it. ``preload_result.json`` is the completion signal the
warm driver polls: it goes up in one commit with the marker.

The models warm while the GPUs answer (as setup does): a fault they report stops the
warming at once, and a preload claims success only once their verdict is in
(``Context.settle_host``), so its marker does not depend on which came first.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Sequence
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Any

import structlog

from fsm import rules, table
from fsm.context import Context
from fsm.errors import FatalError, FlashError, Interrupted
from fsm.output.log import Progress
from fsm.prefetch import Branch
from fsm.store.base import PRELOAD_IGNORE_PATTERNS, PRELOAD_RESULT_NAME, Store, WarmOutcome
from fsm.worker.console import start_lease

log = structlog.get_logger("states.preload")


def preload(ctx: Context) -> str:
    p = ctx.require_payload()
    hf_home = ctx.merged_env().get("HF_HOME", "")
    warmed: dict[str, Any] = {"preloaded": [], "already_cached": [], "failed": {}}
    problem = _mount_problem(hf_home, p.cache_mount_marker, p.cache_block_device)
    if problem is None:
        cache_dir = Path(hf_home) / "hub"
        # The lease, kept while the models warm (a later attempt found halts the state).
        lease = start_lease(ctx, table.PRELOAD)
        try:
            outcomes = _warm_all(ctx, p.models, cache_dir)
        finally:
            if lease is not None:
                # A lease write in flight is fenced: no reason to wait long for it.
                lease.stop(timeout_s=ctx.stop_deadline.bound(1.0))
                ctx.evidence["lease"] = lease.evidence()
        for repo_id, outcome in outcomes:
            # (A DeadlineExceeded is none of these: like any other failure, it is raised.)
            if isinstance(outcome, FlashError | OSError | ValueError):
                warmed["failed"][repo_id] = ctx.redactor.line(str(outcome), 500)
                log.warning("preload.model_failed", repo_id=repo_id, error=str(outcome))
                continue
            if isinstance(outcome, BaseException):
                raise outcome
            warmed["already_cached" if outcome == "cached" else "preloaded"].append(repo_id)
            log.info("preload.model_ready", repo_id=repo_id, outcome=outcome, cache=str(cache_dir))
    ctx.evidence["preload"] = warmed
    result = warmed if problem is None else {**warmed, "error": problem}
    # The warm driver polls preload_result.json: it goes up in the marker's own commit, so
    # it has landed exactly when the marker has.
    ctx.end_artifacts[PRELOAD_RESULT_NAME] = ctx.redactor.text(json.dumps(result))
    # The verdict waits for the GPUs' (whichever came first, the same marker).
    ctx.settle_host(p.expect_gpus)
    if problem is not None:
        raise FatalError(problem, rule=rules.PRELOAD_UNMOUNTED)
    if warmed["failed"]:
        names = ", ".join(sorted(warmed["failed"]))
        raise FatalError(f"preload failed for {names}", rule=rules.PRELOAD_MODEL_FAILED)
    return table.CACHE_WARMED


def _warm_all(ctx: Context, models: Sequence[str], cache_dir: Path,
              ) -> list[tuple[str, WarmOutcome | BaseException]]:
    """Each model warmed at once, each in a branch with a store handle of its own
    (``fsm.prefetch``; a model's files are fetched several at once too): each model's
    outcome, or what it failed with, in the payload's order. A model refused for its
    token does not stop the others: each says what it met. A signal while waiting
    cancels them all."""
    branches = []
    for repo_id in models:
        flag = ctx.setup_stop.follower()  # a signal, or a fault the GPUs report
        work = partial(_warm, ctx.setup_store(flag), repo_id, cache_dir)
        branches.append((repo_id, Branch(f"warm-{repo_id}", work, flag)))
    outcomes: list[tuple[str, WarmOutcome | BaseException]] = []
    try:
        for repo_id, branch in branches:
            try:
                outcomes.append((repo_id, branch.join()))
            except (Interrupted, KeyboardInterrupt):
                raise
            except BaseException as exc:  # the caller decides
                outcomes.append((repo_id, exc))
    finally:
        for _, branch in branches:
            branch.cancel()  # (a no-op for a branch that ended)
    return outcomes


def _warm(store: Store, repo_id: str, cache_dir: Path) -> WarmOutcome:
    """Warm one model, reporting its progress (``preload.progress``) once the store says
    what it will fetch: files and bytes in the cache, measured from a monitor thread (the
    same on both stores and both hub lines, whatever transfers the bytes)."""
    with ExitStack() as stack:  # on the way out: the last measurement, then the end event

        def on_start(files: int, nbytes: int) -> None:
            progress = stack.enter_context(
                Progress("preload", total_files=files, total_bytes=nbytes, model=repo_id))
            stack.enter_context(progress.watch(partial(_in_cache, cache_dir, repo_id)))

        return store.warm_model(repo_id, cache_dir, PRELOAD_IGNORE_PATTERNS, on_start)


def _in_cache(cache_dir: Path, repo_id: str) -> dict[str, int]:
    """What the cache holds of model ``repo_id`` (the standard layout): its snapshot's
    files, and their bytes plus those of the blobs still downloading."""
    folder = cache_dir / ("models--" + repo_id.replace("/", "--"))
    files = nbytes = 0
    for top, _dirs, names in os.walk(folder / "snapshots"):
        for name in names:
            with contextlib.suppress(OSError):  # a link whose blob is not there (yet)
                nbytes += os.stat(os.path.join(top, name)).st_size
                files += 1
    with contextlib.suppress(FileNotFoundError), os.scandir(folder / "blobs") as blobs:
        for blob in blobs:  # hf's "<sha>.incomplete", the local store's ".<sha>.<tmp>"
            if blob.name.endswith(".incomplete") or blob.name.startswith("."):
                with contextlib.suppress(FileNotFoundError):  # renamed while counted
                    nbytes += blob.stat(follow_symlinks=False).st_size
    return {"files": files, "bytes": nbytes}


def _mount_problem(hf_home: str, sentinel: str | None, block_device: bool) -> str | None:
    mount = Path(hf_home.rstrip("/")).parent
    if not hf_home or not mount.is_dir():
        return f"weight cache not mounted (HF_HOME={hf_home!r}); refusing to warm ephemeral disk"
    if sentinel and not (mount / sentinel).exists():
        kind = "block volume" if block_device else "NFS filesystem"
        return (
            f"weight cache {kind} not mounted (no sentinel {mount / sentinel}); "
            "refusing to warm ephemeral disk"
        )
    return None

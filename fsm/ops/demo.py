"""``flash-bootstrap demo``: a real attempt through the machine on a temporary local store.

No network: the store is a directory holding the example worker tree shipped in this
package (and, for preload, a tiny model repo). The worker is a real subprocess.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any, NamedTuple


class Scenario(NamedTuple):
    about: str
    expect: str  # the terminal state it should end in


SCENARIOS: dict[str, Scenario] = {
    "success": Scenario("the worker trains and uploads metrics.json and DONE", "Succeeded"),
    "crash": Scenario("the worker crashes before writing anything", "FailedFatal"),
    "crash-after-done": Scenario(
        "the worker exits 139 after uploading both artifacts: still a success", "Succeeded"
    ),
    "upload-lost": Scenario(
        "the worker wrote metrics.json locally but its upload never landed", "FailedRetriable"
    ),
    "gpu-fault": Scenario(
        "the worker dies of an uncorrectable ECC error: a bad host, retried on a fresh one",
        "FailedRetriable",
    ),
    "heartbeat-retriable": Scenario(
        "the worker's own heartbeat judges its failure retriable", "FailedRetriable"
    ),
    "spilled-spec": Scenario("the job spec lives in the store, not the payload", "Succeeded"),
    "deadline": Scenario("the worker hangs past the attempt's wall-clock budget", "FailedFatal"),
    "preload": Scenario("warm a model cache on a mounted volume; no worker", "Succeeded"),
}

DEMO_MODEL = "demo/tiny-model"
SENTINEL = ".flash-cache-mounted"


def lay_out(root: Path, name: str) -> Path:
    """Write the store, the payload and the directories of scenario ``name`` under ``root``;
    return the payload's path."""
    store = root / "store"
    with resources.as_file(resources.files("fsm.ops") / "demo_tree") as source:
        shutil.copytree(
            source, store, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__")
        )
    prefix = f"demo/run-{name}/seed0"
    payload: dict[str, Any] = {
        "hf_repo": "demo/flash-runs",
        "hf_prefix": prefix,
        "flash_arm": "demo",
        "attempt": 0,
        "run_id": f"demo-{name}",
        "env": {"HF_TOKEN": "hf_demo_secret_token", "FLASH_STOP_GRACE_S": "1"},
    }
    if name == "preload":
        model = store / "models" / DEMO_MODEL
        (model / "original").mkdir(parents=True, exist_ok=True)
        (model / "config.json").write_text(json.dumps({"hidden_size": 8}))
        (model / "tokenizer.json").write_text(json.dumps({"vocab": ["a", "b"]}))
        (model / "model.safetensors").write_bytes(os.urandom(64 * 1024))
        (model / "original" / "consolidated.pth").write_bytes(b"not warmed")
        mount = root / "weight-cache"
        mount.mkdir(exist_ok=True)
        (mount / SENTINEL).write_text("mounted\n")
        payload |= {
            "mode": "preload",
            "models": [DEMO_MODEL],
            "cache_mount_marker": SENTINEL,
            "env": payload["env"] | {"HF_HOME": str(mount / "hf-cache")},
        }
    else:
        spec = json.dumps({"scenario": "slow" if name == "deadline" else name, "hf_prefix": prefix})
        payload |= {"phase": "sft", "seed": 0}
        if name == "spilled-spec":
            (store / prefix).mkdir(parents=True, exist_ok=True)
            (store / prefix / "job_spec.json").write_text(spec)
            payload["job_spec_in_hf"] = True
        else:
            payload["job_spec_json"] = spec
        if name == "deadline":
            payload["max_wall_s"] = 4
    for sub in ("scratch", "runcode", "flash"):
        (root / sub).mkdir(exist_ok=True)
    path = root / "flash" / "payload.json"
    path.write_text(json.dumps(payload, indent=2))
    return path


def run_demo(name: str, keep: Path | None = None) -> int:
    """Run scenario ``name``; exit 0 when it ended the way the scenario says it should."""
    from fsm.attempt.runner import run_attempt
    from fsm.context import Settings
    from fsm.output import log

    log.configure()
    root = keep or Path(tempfile.mkdtemp(prefix="flash-demo-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        payload = lay_out(root, name)
        settings = Settings(
            payload_path=payload,
            store_url=(root / "store").as_uri(),
            code_root=root / "runcode",
            scratch_dir=root / "scratch",
        )
        outcome = run_attempt(settings)
        scenario = SCENARIOS[name]
        expected = outcome.terminal == scenario.expect
        print(f"\nscenario   {name}: {scenario.about}")
        print(f"states     {' -> '.join(outcome.context.path)}")
        print(f"marker     {json.dumps(outcome.marker, indent=2, sort_keys=True)}")
        print(f"exit code  {outcome.exit_code} ({outcome.reason})")
        print(f"expected   {scenario.expect}: {'yes' if expected else 'NO'}")
        if keep:
            print(f"kept       {root}")
        return 0 if expected else 1
    finally:
        if keep is None:
            shutil.rmtree(root, ignore_errors=True)

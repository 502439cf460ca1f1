"""A fleet shares one Hub account: five real runners at once, one local Hub server whose
commit quota is below what they would ask for unpaced. Every marker lands, each is right,
and nothing of an attempt lands after its marker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import fsm
from fsm.testing import LocalHubServer

pytestmark = pytest.mark.hub

REPO = "org/fleet-runs"
RUNNERS = 5
PROJECT_ROOT = Path(fsm.__file__).resolve().parents[1]

#: About 13 s of steady output, then a failure without completion artifacts: every
#: periodic tail has news, and every marker must say worker-failed (fatal).
WORKER = """
import sys, time
for i in range(60):
    print(f"step {i}", flush=True)
    time.sleep(0.2)
print("last line of the worker", flush=True)
sys.exit(1)
"""


def _start(root: Path, hub: LocalHubServer, token: str, n: int) -> subprocess.Popen[bytes]:
    run = root / f"runner{n}"
    for sub in ("scratch", "runcode", "flash", "hf-home"):
        (run / sub).mkdir(parents=True)
    prefix = f"sft/run-{n}/seed0"
    payload = {
        "hf_repo": REPO, "hf_prefix": prefix, "phase": "sft", "seed": 0, "flash_arm": "lambda",
        "attempt": 0, "run_id": f"run-{n}", "max_wall_s": 120,
        "job_spec_json": json.dumps({"hf_prefix": prefix}),
        "env": {"HF_TOKEN": token, "FLASH_STOP_GRACE_S": "2", "FLASH_UPLOAD_CONSOLE": "1",
                "FLASH_CONSOLE_UPLOAD_INTERVAL_S": "5"},
    }
    (run / "flash" / "payload.json").write_text(json.dumps(payload))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "FLASH_"))}
    env.update(HF_HOME=str(run / "hf-home"), HF_HUB_DISABLE_TELEMETRY="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(PROJECT_ROOT),
                                                        os.environ.get("PYTHONPATH")])))
    return subprocess.Popen(
        [sys.executable, "-m", "fsm", "run", "--payload", str(run / "flash" / "payload.json"),
         "--store", hub.url, "--code-root", str(run / "runcode"),
         "--scratch-dir", str(run / "scratch")],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )


def test_five_runners_under_one_commit_quota_all_land_a_right_marker_last(
    hub_server: LocalHubServer, hub_token: str, tmp_path: Path
) -> None:
    hub_server.create_repo(REPO)
    hub_server.add_file(REPO, "code/flash/engine/worker/__main__.py", WORKER)
    # Unpaced, each runner commits its lease at the worker's start, a tail at 5 s and 10 s
    # and then its marker: 20 commits in about 13 s. The account gets 6 per rolling 10 s.
    hub_server.set_quota(commits=6, window_s=10.0)
    procs = [_start(tmp_path, hub_server, hub_token, n) for n in range(RUNNERS)]
    errs = [proc.communicate(timeout=120)[1] for proc in procs]

    repo = hub_server.repo_dir(REPO)
    for n, (proc, err) in enumerate(zip(procs, errs, strict=True)):
        assert proc.returncode == 1, err.decode()[-3000:]
        marker = json.loads((repo / f"sft/run-{n}/seed0/lambda_attempt0.json").read_text())
        assert (marker["ok"], marker["retriable"], marker["rule"]) == (
            False, False, "worker-failed"
        )
        assert (marker["attempt"], marker["run_id"]) == (0, f"run-{n}")
        # The tail in the repo is the final one, from the marker's own commit: no periodic
        # tail (older text) landed after it.
        tail = (repo / f"sft/run-{n}/seed0/console_sft.txt").read_text()
        assert "last line of the worker" in tail
        # At most the two periodic tails, and the lease's commits of its own (CONTRACT
        # section 10: written when the worker starts; a renewal that rode a tail is none).
        lease = marker["lease"]
        assert marker["store"]["commits"] <= 2 + lease["renewals"] - lease["rode"], marker
        assert hub_token.encode() not in err
    counts = hub_server.counts()
    assert counts["throttled"] >= 1, counts  # the quota really bit
    landed = [r for r in hub_server.requests if r.kind == "commit" and r.status == 200]
    assert len(landed) <= RUNNERS * 4, counts  # never more than the unpaced demand

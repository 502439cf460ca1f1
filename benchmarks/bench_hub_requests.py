"""Hub API requests per attempt, by kind, counted by the local Hub server.

One real ``flash-bootstrap run`` process per scenario against the project's local Hub
server, with the real ``huggingface_hub`` client; the server's request log is split into
``api`` (every ``/api/`` call but commits), ``resolver`` (``/resolve/`` downloads and
metadata) and ``commit``. ``--tree`` runs the runner from another checkout (e.g. a git
worktree of an older commit) against the same server, to compare before and after::

    python benchmarks/bench_hub_requests.py
    git worktree add /tmp/before <rev> && \\
        python benchmarks/bench_hub_requests.py --tree /tmp/before
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from fsm.testing import LocalHubServer

TOKEN = "hf_bench_requests_token"
REPO = "org/runs"

WORKERS = {
    # the worker uploads metrics.json and DONE through the Hub, then exits 0
    "success": """
import os, json
from huggingface_hub import HfApi
spec = json.loads(os.environ["FLASH_JOB_SPEC_JSON"])
api = HfApi(endpoint=os.environ["HF_ENDPOINT"], token=os.environ["HF_TOKEN"])
print("step 1/1", flush=True)
for name in ("metrics.json", "DONE"):
    api.upload_file(path_or_fileobj=b"{}", path_in_repo=spec["hf_prefix"] + "/" + name,
                    repo_id=os.environ["REPO"], repo_type="dataset")
""",
    # the worker crashes before writing anything
    "crash": """
import sys
print("Traceback (most recent call last):\\nRuntimeError: boom", file=sys.stderr)
sys.exit(1)
""",
}


def kind_of(method: str, path: str) -> str:
    if "/resolve/" in path:
        return "resolver"
    if method == "POST" and "/commit/" in path:
        return "commit"
    return "api"


def run_one(tree: Path | None, scenario: str, code_files: int) -> Counter[str]:
    root = Path(tempfile.mkdtemp(prefix="bench-req-"))
    with LocalHubServer(root / "hub", token=TOKEN) as hub:
        hub.create_repo(REPO)
        hub.add_file(REPO, "code/flash/engine/worker/__main__.py", WORKERS[scenario].encode())
        for i in range(code_files - 1):
            hub.add_file(REPO, f"code/flash/lib/mod{i}.py", f"X = {i}\n".encode())
        for sub in ("scratch", "runcode", "flash"):
            (root / sub).mkdir()
        payload = {
            "hf_repo": REPO, "hf_prefix": f"bench/{scenario}/0", "phase": "sft", "seed": 0,
            "job_spec_json": json.dumps({"hf_prefix": f"bench/{scenario}/0"}),
            "env": {"HF_TOKEN": TOKEN, "REPO": REPO, "FLASH_STOP_GRACE_S": "1"},
        }
        (root / "flash" / "payload.json").write_text(json.dumps(payload))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "FLASH_"))}
        if tree is not None:
            env["PYTHONPATH"] = str(tree)
        hub.clear_requests()
        subprocess.run(
            [sys.executable, "-m", "fsm", "run", "--payload", str(root / "flash/payload.json"),
             "--store", hub.url, "--code-root", str(root / "runcode"),
             "--scratch-dir", str(root / "scratch")],
            env=env, cwd=tree or Path.cwd(), capture_output=True, timeout=120, check=False,
        )
        return Counter(kind_of(r.method, r.path) for r in hub.requests)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, help="run the runner from this checkout")
    parser.add_argument("--code-files", type=int, default=3)
    args = parser.parse_args()
    print(f"runner: {args.tree or 'this tree'}; code files: {args.code_files}")
    print(f"{'scenario':10} {'api':>5} {'resolver':>9} {'commit':>7} {'total':>6}")
    for scenario in WORKERS:
        counts = run_one(args.tree, scenario, args.code_files)
        total = sum(counts.values())
        print(f"{scenario:10} {counts['api']:5} {counts['resolver']:9} {counts['commit']:7} "
              f"{total:6}")


if __name__ == "__main__":
    main()

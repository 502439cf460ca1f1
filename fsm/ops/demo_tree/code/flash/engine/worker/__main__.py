"""The demo worker: a stand-in for the real training worker, driven by the job spec.

It speaks the worker side of CONTRACT section 5 on a local store (``FLASH_STORE``):
prints a training log, writes ``metrics.json`` to the scratch directory, uploads it and
then ``DONE`` under the run's prefix. The spec's ``scenario`` makes it misbehave.
"""

import json
import os
import shutil
import sys
import time
from typing import Any
from urllib.parse import unquote, urlparse


def spec() -> dict[str, Any]:
    if os.environ.get("FLASH_JOB_SPEC_PATH"):
        with open(os.environ["FLASH_JOB_SPEC_PATH"], encoding="utf-8") as f:
            text = f.read()
    else:
        text = os.environ["FLASH_JOB_SPEC_JSON"]
    job: dict[str, Any] = json.loads(text)
    return job


def upload(local: str, name: str, prefix: str) -> None:
    root = unquote(urlparse(os.environ["FLASH_STORE"]).path)
    target = os.path.join(root, prefix, name)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    shutil.copyfile(local, target + ".part")
    os.replace(target + ".part", target)


def main() -> int:
    job = spec()
    scenario = job.get("scenario", "success")
    prefix = job["hf_prefix"]
    scratch = os.environ["FLASH_SCRATCH_DIR"]
    phase = os.environ["PHASE"]
    print(f"worker: phase={phase} seed={os.environ['SEED']} attempt={os.environ['ATTEMPT']} "
          f"arm={os.environ['FLASH_ARM']} scenario={scenario}", flush=True)
    for step in range(1, 6):
        print(f"step {step}/5 loss={2.0 / step:.4f}", flush=True)
    if scenario == "slow":
        print("worker: pretending to hang in a collective", flush=True)
        time.sleep(3600)
    if scenario == "crash":
        error = os.path.join(scratch, f"error_{phase}.txt")
        # A job's own fault: a kernel's assertion on bad labels, on any host.
        crash = "RuntimeError: CUDA error: device-side assert triggered"
        with open(error, "w") as f:
            f.write(f"Traceback (most recent call last):\n  ...\n{crash}\n")
        upload(error, f"error_{phase}.txt", prefix)
        print(crash, file=sys.stderr, flush=True)
        return 3
    if scenario == "gpu-fault":
        # What PyTorch prints when the GPU's memory fails under a kernel.
        raise RuntimeError(
            "CUDA error: uncorrectable ECC error encountered\n"
            "CUDA kernel errors might be asynchronously reported at some other API call, so "
            "the stacktrace below might be incorrect."
        )
    metrics = os.path.join(scratch, "metrics.json")
    with open(metrics, "w") as f:
        json.dump({"loss": 0.4, "steps": 5}, f)
    if scenario == "upload-lost":
        print("worker: metrics.json upload failed after 3 tries", file=sys.stderr, flush=True)
        return 1
    if scenario == "heartbeat-retriable":
        beat = os.path.join(scratch, "heartbeat.json")
        with open(beat, "w") as f:
            json.dump({"stage": "upload", "ts": time.time(),
                       "attempt": int(os.environ["ATTEMPT"]), "retriable": True}, f)
        upload(beat, "heartbeat.json", prefix)
        return 1
    upload(metrics, "metrics.json", prefix)
    done = os.path.join(scratch, "DONE")
    with open(done, "w") as f:
        f.write(f"{time.time():.3f}\n")
    upload(done, "DONE", prefix)
    print("worker: done", flush=True)
    if scenario == "crash-after-done":
        print("Segmentation fault (core dumped) at interpreter exit", file=sys.stderr, flush=True)
        return 139
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The fast-transfer accelerator is really engaged, on whichever hub line is installed.

The client runs in a fresh interpreter: the switch only counts when it is in the
environment before huggingface_hub's first import, and hf_transfer must not share a
process with the (in-process) server.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fsm.store.hub import configure_transfer
from fsm.testing import LocalHubServer

pytestmark = pytest.mark.hub

HUB_MAJOR = int(importlib.metadata.version("huggingface_hub").split(".")[0])
HAS_HF_TRANSFER = importlib.util.find_spec("hf_transfer") is not None
HAS_HF_XET = importlib.util.find_spec("hf_xet") is not None

CLIENT = """
import json, os, sys
from pathlib import Path
from fsm.store.hub import configure_transfer
accelerator = configure_transfer(os.environ)          # before the first hub import
from fsm.clock import Deadline
from fsm.store.hub import HubStore
import huggingface_hub.constants as constants
out = {"accelerator": accelerator,
       "hf_transfer": getattr(constants, "HF_HUB_ENABLE_HF_TRANSFER", None),
       "xet_high_performance": getattr(constants, "HF_XET_HIGH_PERFORMANCE", None)}
if len(sys.argv) > 1:  # warm a model: the preload, where the large transfers are
    store = HubStore(sys.argv[1], token=os.environ["FLASH_TEST_TOKEN"], endpoint=sys.argv[2],
                     deadline=Deadline.after(60), call_timeout_s=30)
    out["outcome"] = store.warm_model(sys.argv[3], Path(sys.argv[4]), [])
print(json.dumps(out))
"""


def _client(*args: str, token: str = "") -> dict[str, object]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HF_HUB_ENABLE_HF_TRANSFER", "HF_XET_"))}
    env["FLASH_TEST_TOKEN"] = token
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", CLIENT, *args], env=env, capture_output=True,
                          text=True, timeout=60, check=True)
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    assert token not in done.stdout + done.stderr or not token
    return result


@pytest.mark.skipif(HUB_MAJOR != 0 or not HAS_HF_TRANSFER,
                    reason="needs huggingface_hub 0.x with hf_transfer")
def test_hf_transfer_downloads_a_large_file_in_parallel_ranges(
    hub_server: LocalHubServer, hub_dataset: str, hub_token: str, tmp_path: Path
) -> None:
    """0.x + hf_transfer: a model file over 50 MiB arrives in the preload's cache as several
    concurrent 206 ranged GETs."""
    data = os.urandom(1 << 20) * 60
    hub_server.create_repo("org/big-model", "model")
    hub_server.add_file("org/big-model", "weights.bin", data, "model")
    cache = tmp_path / "cache"
    got = _client(hub_dataset, hub_server.url, "org/big-model", str(cache), token=hub_token)
    assert (got["accelerator"], got["outcome"]) == ("hf_transfer", "downloaded")
    [cached] = cache.glob("models--org--big-model/snapshots/*/weights.bin")
    assert cached.read_bytes() == data
    ranged = [r for r in hub_server.requests
              if r.method == "GET" and r.status == 206 and r.range and r.range != "bytes=0-0"]
    assert len({r.range for r in ranged}) >= 5
    overlapping = any(
        a.at < (b.ended_at or 0) and b.at < (a.ended_at or 0)
        for i, a in enumerate(ranged) for b in ranged[i + 1:]
    )
    assert overlapping, "ranged requests ran one after another, not in parallel"


@pytest.mark.skipif(HUB_MAJOR < 1 or not HAS_HF_XET, reason="needs huggingface_hub 1.x/2.x")
def test_hf_xet_high_performance_is_on_at_import() -> None:
    """1.x/2.x: HF_XET_HIGH_PERFORMANCE is set before the import, so the hub sees it on."""
    got = _client()
    assert got == {"accelerator": "hf_xet", "hf_transfer": None, "xet_high_performance": True}


def test_configure_transfer_can_leave_the_accelerator_off() -> None:
    """accelerate=False reports "none" and switches the accelerator off; telemetry is off."""
    environ: dict[str, str] = {"HF_HUB_ENABLE_HF_TRANSFER": "1"}
    assert configure_transfer(environ, accelerate=False) == "none"
    assert environ["HF_HUB_DISABLE_TELEMETRY"] == "1"
    assert environ.get("HF_HUB_ENABLE_HF_TRANSFER", "0") == "0"
    assert environ.get("HF_XET_HIGH_PERFORMANCE", "0") == "0"

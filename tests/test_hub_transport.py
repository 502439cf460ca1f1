"""The payload's transport settings reach the Hub's process (issue 38, item 1; CONTRACT
section 2: the runner obeys the merged environment exactly as the worker does).

The agent (``fsm.hub.agent``) is started at the runner's first instruction, before the
payload is read, with the runner's own environment. A proxy the payload names
(``HTTP_PROXY``, ``NO_PROXY``, and the CA bundles beside them) must still carry every
one of the runner's store calls: here the store's host name is known to the proxy alone,
so a call that went direct fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from hubrun import HubRun

from fsm.testing import LocalHubServer
from fsm.testing.proxy import ForwardProxy

pytestmark = pytest.mark.hub

#: A host name that never resolves (RFC 6761): only the proxy knows where it is.
HIDDEN = "flash-hub.invalid"
#: The proxy's credentials, in its URL as operators write them.
PROXY_PASSWORD = "pr0xy-Pass-7Qz"


def _runner_env(run: HubRun) -> dict[str, str]:
    """The runner's environment without any proxy of this machine's."""
    return {k: v for k, v in run.environ().items()
            if not k.lower().endswith("_proxy") and k not in ("SSL_CERT_FILE",
                                                              "REQUESTS_CA_BUNDLE")}


def _attempt(run: HubRun, store: str, env: dict[str, str]) -> subprocess.CompletedProcess[bytes]:
    run.write_payload(env={"HF_TOKEN": run.token, "FLASH_STOP_GRACE_S": "2", **env})
    proc = subprocess.run(
        [sys.executable, "-m", "fsm", "run", "--payload", str(run.payload_path),
         "--store", store, "--code-root", str(run.code_root),
         "--scratch-dir", str(run.scratch)],
        env=_runner_env(run), capture_output=True, timeout=90, check=False)
    run.stderr.append(proc.stderr)
    return proc


def test_a_store_reachable_only_through_the_payloads_proxy_gets_every_call_and_the_marker(
    hub_run: HubRun,
) -> None:
    """The payload's ``HTTP_PROXY`` (with credentials) carries the runner's own calls: the
    code's download, the verification and the marker's commit all reach the store, and the
    proxy's password is nowhere in what the attempt leaves behind."""
    hub_run.write_worker("print('about to fail', flush=True)\nsys.exit(3)\n")
    hub_run.secrets.append(PROXY_PASSWORD)
    port = urlsplit(hub_run.server.url).port
    with ForwardProxy(hosts={HIDDEN: "127.0.0.1"}) as proxy:
        via = proxy.url.replace("http://", f"http://ops:{PROXY_PASSWORD}@")
        proc = _attempt(hub_run, f"http://{HIDDEN}:{port}", {"HTTP_PROXY": via})
    stderr = proc.stderr.decode("utf-8", "replace")
    marker = hub_run.marker()
    assert marker is not None, stderr[-3000:]
    assert (proc.returncode, marker["rule"]) == (1, "worker-failed"), stderr[-3000:]
    methods = {(seen.method, urlsplit(seen.url).path.split("/")[-1] or "/") for seen in
               proxy.seen}
    assert proxy.seen and all(urlsplit(seen.url).hostname == HIDDEN for seen in proxy.seen)
    assert all(seen.proxy_auth and seen.auth for seen in proxy.seen)
    assert any(method == "POST" for method, _ in methods), methods  # the marker's commit
    assert (hub_run.artifact("console_sft.txt")).read_text().strip().endswith("about to fail")


def test_without_the_payloads_proxy_the_hidden_store_is_unreachable(hub_run: HubRun) -> None:
    """The control: the same attempt without the proxy reaches nothing (so the test above
    proves the calls went through it), and says so in one line with the store's status."""
    hub_run.write_worker("sys.exit(3)\n")
    port = urlsplit(hub_run.server.url).port
    env = {"FLASH_STORE_MAX_ATTEMPTS": "1", "FLASH_STORE_CALL_TIMEOUT_S": "2"}
    proc = _attempt(hub_run, f"http://{HIDDEN}:{port}", env)
    assert proc.returncode == 3, proc.stderr.decode()[-3000:]
    assert hub_run.marker() is None


def test_no_proxy_in_the_payload_sends_the_calls_direct(hub_run: HubRun) -> None:
    """``NO_PROXY`` naming the store's host: the runner's calls go direct (the proxy sees
    none of them) and the attempt completes as without a proxy."""
    hub_run.write_worker("complete()\n")
    with ForwardProxy() as proxy:
        proc = _attempt(hub_run, hub_run.server.url,
                        {"HTTP_PROXY": proxy.url, "NO_PROXY": "127.0.0.1"})
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    assert hub_run.marker() is not None and hub_run.marker()["ok"] is True  # type: ignore[index]
    assert proxy.seen == []


def test_the_agent_holds_the_payloads_transport_settings() -> None:
    """The settings the store sends the agent include the transport ones, and the agent
    puts them in its environment even after the library is loaded."""
    from fsm.hub import library
    from fsm.store.hub import _hub_settings

    env = {"HTTPS_PROXY": "http://p:3128", "no_proxy": "10.0.0.0/8", "SSL_CERT_FILE": "/ca",
           "REQUESTS_CA_BUNDLE": "/ca2", "HF_TOKEN": "hf_secret", "PATH": os.defpath}
    settings = _hub_settings(env)
    assert set(settings) == {"HTTPS_PROXY", "no_proxy", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE"}
    assert set(library.TRANSPORT_SETTINGS) >= set(settings)


def test_a_mirror_behind_a_private_ca_is_trusted_through_the_payloads_ca_bundle(
    tmp_path: Path, hub_token: str,
) -> None:
    """A Hub endpoint whose certificate chains to a CA only the payload's ``SSL_CERT_FILE``
    (httpx, 1.x/2.x) and ``REQUESTS_CA_BUNDLE`` (requests, 0.x) name: the runner's calls
    trust it, and the marker lands over TLS."""
    cert, key = tmp_path / "ca.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    with LocalHubServer(tmp_path / "tls-hub", token=hub_token, tls=(cert, key)) as server:
        (tmp_path / "run").mkdir()
        run = HubRun(tmp_path / "run", server, hub_token)
        run.write_worker("sys.exit(3)\n")
        proc = _attempt(run, server.url, {"SSL_CERT_FILE": str(cert),
                                          "REQUESTS_CA_BUNDLE": str(cert)})
        marker = run.marker()
        assert server.url.startswith("https://")
    assert marker is not None, proc.stderr.decode()[-3000:]
    assert (proc.returncode, marker["rule"]) == (1, "worker-failed")


_APPLY = """
import os, sys
from fsm.hub import library
library.load_library()
from huggingface_hub.utils import get_session
before = get_session()
late = library.apply_settings({"HTTPS_PROXY": "http://127.0.0.1:9"})
print(late, os.environ["HTTPS_PROXY"], get_session() is not before)
"""


def test_the_loaded_librarys_client_is_made_again_from_the_new_transport_settings() -> None:
    """After the import, a transport setting is no late setting: it goes into the agent's
    environment and the library's cached client is replaced (on every hub line)."""
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    done = subprocess.run([sys.executable, "-c", _APPLY], env=env, capture_output=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert done.stdout.decode().split() == ["[]", "http://127.0.0.1:9", "True"]

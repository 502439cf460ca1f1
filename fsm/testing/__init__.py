"""Public test helpers for flash-bootstrap and for users' own tests.

Like ``structlog.testing``, this module is part of the public API. Install it with the
``testing`` extra (``pip install 'flash-bootstrap[testing]'``, which adds pytest for the
plugin). The runtime never imports it, and the container image does not carry it
(docs/testing.md).

:class:`LocalHubServer` is a Hugging Face Hub API server on ``127.0.0.1`` that the real
``huggingface_hub`` client (0.x and 1.x/2.x) accepts: uploads, existence checks,
single-file and snapshot downloads (ranged GETs included), a Bearer token check, and
injected faults (an HTTP status for the first N matching requests, a bounded hang, a
dropped connection), and the Hub's rate limits (a commit and a request quota over a
rolling window, answered 429 with ``Retry-After``), and network conditions for benchmarks
(bandwidth capped per connection, latency per request). Repos are plain directories
under the server's root::

    from fsm.testing import LocalHubServer

    with LocalHubServer(tmp_path / "hub", token="hf_test") as hub:
        hub.add_file("org/data", "code/main.py", b"print('hi')")
        hub.fail("POST", r"/commit/", status=503, times=2)
        store = HubStore("org/data", token="hf_test", deadline=Deadline.after(60),
                         endpoint=hub.url)
        ...
        assert [r.status for r in hub.requests if "/commit/" in r.path] == [503, 503, 200]

The pytest plugin ``fsm.testing.pytest_plugin`` provides the fixtures ``hub_token`` (a
canary token), ``hub_server`` (a started server checking that token) and ``hub_dataset``
(the id of an empty dataset repo on it). It is not an entry point, so no pytest run loads
it on its own: a test suite asks for it with ``pytest_plugins = ["fsm.testing.pytest_plugin"]``
in its top-level ``conftest.py``, or ``pytest -p fsm.testing.pytest_plugin``.

Importing this package is cheap: it needs only the standard library.
"""

from __future__ import annotations

from fsm.testing.hubserver import Fault, LocalHubServer, Network, Quota, RequestRecord

__all__ = ["Fault", "LocalHubServer", "Network", "Quota", "RequestRecord"]

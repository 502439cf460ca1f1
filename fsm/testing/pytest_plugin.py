"""pytest fixtures for tests that talk to a Hugging Face Hub: a local server, no network.

Not a pytest11 entry point (that would load it in every pytest run of the environment,
a worker's own tests included): load it explicitly, with
``pytest_plugins = ["fsm.testing.pytest_plugin"]`` in a top-level ``conftest.py`` or
``pytest -p fsm.testing.pytest_plugin``. Needs the ``testing`` extra. Kept cheap to
import: the standard library and pytest only, no ``huggingface_hub`` (it must be imported
after the transfer settings are in the environment).

* ``hub_token``: a canary token, unique per test. Assert it never shows up in your logs.
* ``hub_server``: a started :class:`fsm.testing.LocalHubServer` that requires
  ``hub_token``, with its repos under the test's ``tmp_path``; stopped after the test.
* ``hub_dataset``: the id of an empty dataset repo created on ``hub_server``.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from fsm.testing.hubserver import LocalHubServer

__all__ = ["hub_dataset", "hub_server", "hub_token"]


@pytest.fixture
def hub_token() -> str:
    """A canary token: a test fails if this string ever reaches a log, an error or a file."""
    return f"hf_canary_{secrets.token_hex(12)}"


@pytest.fixture
def hub_server(tmp_path: Path, hub_token: str) -> Iterator[LocalHubServer]:
    """A local Hub API server on 127.0.0.1 that accepts only ``hub_token``."""
    from fsm.testing.hubserver import LocalHubServer

    with LocalHubServer(tmp_path / "hub-server", token=hub_token) as server:
        yield server


@pytest.fixture
def hub_dataset(hub_server: LocalHubServer) -> str:
    """The id of an empty dataset repo on ``hub_server``."""
    repo_id = "flash/store-test"
    hub_server.create_repo(repo_id, "dataset")
    return repo_id

"""The handlers of the working states: each ``(ctx) -> event``, one module per state."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from fsm import table
from fsm.context import Context
from states.fetch_code import fetch_code
from states.install_extras import install_extras
from states.load_payload import load_payload
from states.mark import mark
from states.preload import preload
from states.resolve_spec import resolve_spec
from states.train import train
from states.verify_remote import verify_remote

HANDLERS: Mapping[str, Callable[[Context], str]] = {
    table.LOAD_PAYLOAD: load_payload,
    table.INSTALL_EXTRAS: install_extras,
    table.FETCH_CODE: fetch_code,
    table.RESOLVE_SPEC: resolve_spec,
    table.TRAIN: train,
    table.VERIFY_REMOTE: verify_remote,
    table.PRELOAD: preload,
    table.MARK: mark,
}

__all__ = ["HANDLERS"]

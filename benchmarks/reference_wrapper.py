"""Run the plain-script bootstrap that flash-bootstrap replaces, unchanged, under a root.

    BENCH_REF_ROOT=/abs/root python benchmarks/reference_wrapper.py [SCRIPT]

``SCRIPT`` (or ``BENCH_REF_SCRIPT``) defaults to
``/work/shared/reference/instance_bootstrap_v0.2.25.py``. The script is imported as a
module (its ``__main__`` guard does not fire) and its ``main()`` called; nothing of it is
copied here. Its fixed locations move under ``BENCH_REF_ROOT``:

* the payload file, ``<root>/flash/payload.json``; the code root, ``<root>/runcode``;
* every path it spells under ``/tmp/`` (console, marker and result copies, the worker's
  ``metrics.json``), ``<root>/tmp/``: the module's ``open``, ``os.path.exists`` and
  ``os.remove`` see the moved path, and so does its upload helper and the spec-path
  variable it hands the worker. The worker is told the directory as ``FLASH_SCRATCH_DIR``
  (the contract's name), so it writes ``metrics.json`` where the script looks.

No bytecode is written next to the script (the reference directory stays as it is), so
the script is compiled on every start, as a script run directly is.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any

DEFAULT_SCRIPT = "/work/shared/reference/instance_bootstrap_v0.2.25.py"


class _PathView:
    """``os.path`` with ``exists`` seeing moved paths."""

    def __init__(self, moved: Callable[[Any], Any]) -> None:
        self._moved = moved

    def exists(self, path: Any) -> bool:
        return os.path.exists(self._moved(path))

    def __getattr__(self, name: str) -> Any:
        return getattr(os.path, name)


class _OsView:
    """``os`` with ``remove`` and ``path.exists`` seeing moved paths."""

    def __init__(self, moved: Callable[[Any], Any]) -> None:
        self._moved = moved
        self.path = _PathView(moved)

    def remove(self, path: Any, *args: Any, **kwargs: Any) -> None:
        os.remove(self._moved(path), *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)


def main() -> int:
    root = os.path.abspath(os.environ["BENCH_REF_ROOT"])
    script = sys.argv[1] if len(sys.argv) > 1 else os.environ.get(
        "BENCH_REF_SCRIPT", DEFAULT_SCRIPT)
    tmp = os.path.join(root, "tmp")
    os.makedirs(tmp, exist_ok=True)
    os.environ["FLASH_SCRATCH_DIR"] = tmp

    def moved(path: Any) -> Any:
        # the script's own /tmp names; the root itself may lie under /tmp
        if (isinstance(path, str) and path.startswith("/tmp/")
                and not path.startswith(root + os.sep)):
            return os.path.join(tmp, path[len("/tmp/"):])
        return path

    spec = importlib.util.spec_from_file_location("reference_bootstrap", script)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {script}")
    module = importlib.util.module_from_spec(spec)
    writes_bytecode = sys.dont_write_bytecode
    sys.dont_write_bytecode = True
    try:
        spec.loader.exec_module(module)
    finally:
        sys.dont_write_bytecode = writes_bytecode

    upload = module.hf_upload
    build_env = module.build_worker_env

    def open_moved(file: Any, *args: Any, **kwargs: Any) -> Any:
        return open(moved(file), *args, **kwargs)

    def hf_upload_moved(payload: Any, local_path: str, repo_subpath: str) -> None:
        upload(payload, moved(local_path), repo_subpath)

    def build_env_moved(payload: Any) -> dict[str, str]:
        env: dict[str, str] = build_env(payload)
        if "FLASH_JOB_SPEC_PATH" in env:
            env["FLASH_JOB_SPEC_PATH"] = moved(env["FLASH_JOB_SPEC_PATH"])
        return env

    for name, value in {
        "PAYLOAD_PATH": os.path.join(root, "flash", "payload.json"),
        "CODE_ROOT": os.path.join(root, "runcode"),
        "CODE_DIR": os.path.join(root, "runcode", "code"),
        "open": open_moved,
        "os": _OsView(moved),
        "hf_upload": hf_upload_moved,
        "build_worker_env": build_env_moved,
    }.items():
        if not hasattr(module, name) and name not in ("open", "os"):
            raise SystemExit(f"{script} has no {name}: not the script this wrapper knows")
        setattr(module, name, value)
    code: int = module.main()
    return code


if __name__ == "__main__":
    sys.exit(main())

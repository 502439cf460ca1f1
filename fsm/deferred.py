"""Imports a runner's libraries make but the runner does not use before the worker starts,
deferred until first use.

structlog's package imports ``asyncio`` (which imports ``ssl``) for its async logging
methods only: a quarter of the runner's start-up (issue 15). ``flash-bootstrap run``
defers it before anything else is imported; the Hub client may still use it later, and
then it loads as usual. The worker is another process: it is not affected.

structlog also imports ``rich``, when it is installed (many images have it), for its
console renderer's tracebacks and its exception dicts' ``repr`` of locals: a tenth of a
second, for output the runner never makes (its events are JSON lines, and locals are
never rendered). :func:`import_without` imports structlog as if rich were absent (its
own fallback); rich stays importable afterwards.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import threading
import types
from collections.abc import Iterable, Iterator, Mapping

UNUSED_BEFORE_THE_WORKER = ("asyncio",)
#: What structlog imports if it can, and the runner does without (see above).
OPTIONAL_FOR_STRUCTLOG = ("rich",)
#: Held while a stand-in is replaced by its module (re-entrant: that import may load
#: another stand-in's module).
_loading = threading.RLock()


class Deferred(types.ModuleType):
    """Stands in ``sys.modules`` for a module not imported yet. ``import name`` binds it
    for free; the first attribute looked up on it imports the real module (which then
    replaces it in ``sys.modules``), and every lookup after that is passed on to it.

    A function named in ``calls`` may be looked up before that without importing: what
    is found is a stand-in that imports the module when it is called (for a library that
    binds ``partial(module.function, ...)`` at its import and calls it only on a path the
    runner never takes).

    (``importlib.util.LazyLoader`` does not do here: on Python 3.11 the import statement
    itself reads the module's ``__spec__``, which loads a lazy module at once.)
    """

    def __init__(self, name: str, calls: Iterable[str] = ()) -> None:
        super().__init__(name)
        self.__dict__["_calls"] = frozenset(calls)

    def __getattr__(self, attr: str) -> object:
        if attr in self.__dict__["_calls"] and self.__dict__.get("_real") is None:
            return lambda *args, **kwargs: getattr(self._load(), attr)(*args, **kwargs)
        return getattr(self._load(), attr)

    def _load(self) -> types.ModuleType:
        real: types.ModuleType | None = self.__dict__.get("_real")
        if real is not None:
            return real
        with _loading:  # two threads' first lookups: one import, one removal of the stand-in
            real = self.__dict__.get("_real")
            if real is None:
                if sys.modules.get(self.__name__) is self:
                    del sys.modules[self.__name__]
                real = importlib.import_module(self.__name__)
                self.__dict__["_real"] = real
        return real


def defer(names: Iterable[str], *, calls: Mapping[str, Iterable[str]] | None = None) -> None:
    """Put a :class:`Deferred` in ``sys.modules`` for each of ``names`` not imported yet
    (with the functions ``calls`` names for it, if any)."""
    for name in names:
        if name not in sys.modules:
            sys.modules[name] = Deferred(name, (calls or {}).get(name, ()))


def import_without(module: str, absent: Iterable[str]) -> None:
    """Import ``module`` as if each of ``absent`` (not imported yet) were not installed
    (:func:`without`), so the module takes its own fallback."""
    with without(absent):
        __import__(module)  # (importlib.import_module would hide it from -X importtime)


@contextlib.contextmanager
def without(absent: Iterable[str]) -> Iterator[None]:
    """Within the block, each of ``absent`` (not imported yet) is as if not installed: an
    ``import`` of it raises ImportError (``sys.modules[name] = None``). Afterwards they
    import as usual."""
    blocked = [name for name in absent if name not in sys.modules]
    for name in blocked:
        sys.modules[name] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        for name in blocked:
            if sys.modules.get(name, False) is None:
                del sys.modules[name]

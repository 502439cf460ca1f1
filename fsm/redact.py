"""Secret redaction for every text that leaves the process.

The values of secret-looking keys in the payload env (DESIGN, "Secrets") are replaced by
``***`` in log events, console tails, error texts and the marker.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

MASK = "***"
_SECRET_KEY = re.compile(r"TOKEN|KEY|SECRET|PASSWORD", re.IGNORECASE)
# Values this short are not redacted: masking "1" or "ab" everywhere would shred the text
# and such a value is no credential anyway.
_MIN_SECRET_LEN = 4


def secret_keys(env: Mapping[str, str], extra: Iterable[str] = ()) -> set[str]:
    """The keys of ``env`` whose values are secrets."""
    listed = {k.strip() for k in extra if k.strip()}
    return {k for k in env if _SECRET_KEY.search(k) or k == "HF_TOKEN" or k in listed}


class Redactor:
    """Replaces every known secret value by ``***``, in text and in bytes."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        self._secrets: list[str] = []
        self._pattern: re.Pattern[str] | None = None
        self._bpattern: re.Pattern[bytes] | None = None
        self.add(secrets)

    @classmethod
    def from_env(cls, env: Mapping[str, str], extra_keys: Iterable[str] = ()) -> Redactor:
        return cls(env[k] for k in secret_keys(env, extra_keys))

    def add(self, secrets: Iterable[str]) -> None:
        new = {s for s in secrets if isinstance(s, str) and len(s) >= _MIN_SECRET_LEN}
        if not new - set(self._secrets):
            return
        # Longest first, so a secret that contains another is masked whole.
        self._secrets = sorted(set(self._secrets) | new, key=len, reverse=True)
        self._pattern = re.compile("|".join(re.escape(s) for s in self._secrets))
        self._bpattern = re.compile(
            b"|".join(re.escape(s.encode("utf-8", "surrogatepass")) for s in self._secrets)
        )

    def __bool__(self) -> bool:
        return bool(self._secrets)

    def text(self, value: str) -> str:
        return self._pattern.sub(MASK, value) if self._pattern else value

    def bytes(self, value: bytes) -> bytes:
        return self._bpattern.sub(MASK.encode(), value) if self._bpattern else value

    def deep(self, value: object) -> object:
        """Redact strings inside nested dicts, lists and tuples (log events, markers)."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {k: self.deep(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(self.deep(v) for v in value)
        return value

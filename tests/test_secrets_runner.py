"""Secrets through the real runner: a worker that prints them whole, cut at the console
tail's boundary, URL-quoted, JSON-escaped and inside URLs, then fails. Nothing the runner
writes (the uploaded tail, the marker, its local copies, the persisted result, its log
lines and last line) holds a fragment of 10 or more characters of a secret in any of
those forms, while the text around them survives.

(The worker's own console also goes to the container's stdout as it is, byte for byte,
like any program's; that stream is the worker's, not the runner's, and is not checked.)
"""

from __future__ import annotations

import json

import pytest
from conftest import Layout, printed_forms

TAIL = 64_000
TOKEN = "hf_SeCrEt_tail_boundary_token_0123456789abcdef"
PASSWORD = 'p@ss/w"rd!%&+ =?#x9Z-with-url-specials'
PEM = "-----BEGIN KEY-----\nMIIEpAIBAAKCAQEA0Z3VS5JJcds3\n  xfn/ygWep4PAtGoRBh\n-----END KEY-----"


def _fragments(secret: str, size: int = 10) -> set[str]:
    forms = printed_forms(secret)
    return {form[i : i + size] for form in forms for i in range(len(form) - size + 1)}


def _leaks(data: bytes, secrets: list[str]) -> list[str]:
    text = data.decode("utf-8", "replace")
    return sorted({f for secret in secrets for f in _fragments(secret) if f in text})


@pytest.mark.parametrize("cut", [1, 7, 20, len(TOKEN) - 10, len(TOKEN) - 1])
def test_a_failing_worker_printing_secrets_leaks_no_fragment_anywhere_the_runner_writes(
    layout: Layout, cut: int
) -> None:
    """``cut`` characters of the token fall outside the console tail's window."""
    secrets = [TOKEN, PASSWORD, PEM]
    # What the worker prints after the boundary token: exactly TAIL - (len - cut) bytes.
    after = TAIL - (len(TOKEN) - cut)
    layout.write_worker(f"""
        from urllib.parse import quote, quote_plus
        token, password, pem = {TOKEN!r}, {PASSWORD!r}, {PEM!r}
        out = sys.stdout
        out.write("BEFORE-THE-TAIL " * 8000)
        lines = [
            "quoted " + quote(password, safe="") + " plus " + quote_plus(password),
            "json " + json.dumps({{"password": password, "pem": pem}}),
            "repr " + repr(password),
            "url git+https://oauth2:" + token + "@github.com/org/repo.git",
            "url https://user:anything-at-all-secret@example.com/x",
            "Authorization: Bearer " + token,
            "pem " + pem,
            "SURVIVES-AROUND-THE-SECRETS",
        ]
        body = "\\n".join(lines) + "\\n"
        pad = {after} - len(body.encode())
        out.write(token)
        out.write(body + "." * pad)
        out.flush()
        sys.exit(1)
    """)
    layout.write_payload(env={
        "HF_TOKEN": TOKEN, "DB_PASSWORD": PASSWORD, "SIGNING_KEY": PEM,
        "TOKENIZERS_PARALLELISM": "false", "FLASH_STOP_GRACE_S": "2",
    })
    proc = layout.cli(*layout.run_args())
    assert proc.returncode == 1, proc.stderr.decode()[-2000:]
    marker = layout.marker()
    assert marker is not None and marker["rule"] == "worker-failed"

    tail = layout.artifact("console_sft.txt").read_bytes()
    assert len(tail) <= TAIL
    assert b"SURVIVES-AROUND-THE-SECRETS" in tail
    assert _leaks(tail, secrets) == []
    assert _leaks(proc.stderr, secrets) == []
    written = [p for p in layout.root.rglob("*")
               if p.is_file() and p.name != "payload.json" and "runcode" not in p.parts
               and p.name != "stdout.bin"]
    for path in written:
        if path.suffix in (".json", ".txt") or path.name.startswith(".flash-"):
            assert _leaks(path.read_bytes(), secrets) == [], path


def test_a_boolean_under_a_secret_looking_key_is_not_masked(layout: Layout) -> None:
    """``TOKENIZERS_PARALLELISM=false`` used to turn every "false" in the tail into ***."""
    layout.write_worker("print('parallel is false, retry is false'); sys.exit(1)")
    layout.write_payload(env={"TOKENIZERS_PARALLELISM": "false", "MAX_TOKENS": "4096"})
    proc = layout.cli(*layout.run_args())
    assert proc.returncode == 1
    tail = layout.artifact("console_sft.txt").read_text()
    assert "parallel is false, retry is false" in tail
    assert b'"secrets.keys"' in proc.stderr
    keys_line = next(json.loads(line) for line in proc.stderr.splitlines()
                     if b'"secrets.keys"' in line)
    assert keys_line["keys"] == []

"""Secrets through the real runner: a worker that prints them whole, cut at the console
tail's boundary, URL-quoted, JSON-escaped and inside URLs, then fails. Nothing the runner
writes (the uploaded tail, the marker, its local copies, the persisted result, its log
lines and last line) holds a fragment of 10 or more characters of a secret in any of
those forms, while the text around them survives.

Nor does a secret the worker printed encoded (issue 38): base64 inside a longer base64
line at each alignment, in either alphabet, or hex in either case, reach the published
files, the runner's stderr or the termination message.

(The worker's own console also goes to the container's stdout as it is, byte for byte,
like any program's; that stream is the worker's, not the runner's, and is not checked.)
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
from conftest import PREFIX, Layout, printed_forms
from test_redact import encoded_forms

from fsm.output.redact import MASK

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


#: A token whose base64 holds "+" and "/" at every alignment: the URL-safe alphabet writes
#: it differently at each.
ENCODED_TOKEN = "hf_EnCoDeD~Zq8?Xw>V3n~~P0rT6~yLm???K2?bC9dF4gH7j"
#: What the worker prints the token inside: bytes before it (a group's offset 0, 1 or 2
#: follows from how many), bytes after it.
BEFORE, AFTER = b"\x00\x9fuser:ab", b"\x00more bytes"


def _encoded_leaks(data: bytes, secret: str) -> list[str]:
    """10-character pieces of an encoded form of ``secret`` in ``data`` (see
    ``test_redact.encoded_forms``: base64 alone and each alignment's stable core, hex)."""
    text = data.decode("utf-8", "replace")
    return sorted({form[i : i + 10] for form in encoded_forms(secret)
                   for i in range(len(form) - 9) if form[i : i + 10] in text})


@pytest.mark.parametrize(
    "encoding",
    ["base64-0", "base64-1", "base64-2", "urlsafe-0", "urlsafe-1", "urlsafe-2", "hex", "HEX"],
)
def test_a_secret_printed_encoded_inside_a_longer_line_leaks_nowhere(
    layout: Layout, tmp_path: Path, encoding: str
) -> None:
    """The worker prints the token encoded inside longer lines (a base64 blob whose
    bytes put the token at offset 0, 1 or 2 of a 3-byte group; a hex dump), and last a
    CUDA OOM line holding it, which the marker's error, the runner's last stderr line and
    the termination message quote. None of them, nor anything under the store prefix, holds
    10 characters of any encoded form of it; the text around survives."""
    assert {"+", "/"} & set(base64.b64encode(ENCODED_TOKEN.encode()).decode())
    kind, _, offset = encoding.partition("-")
    layout.write_worker(f"""
        import base64
        token, kind = {ENCODED_TOKEN!r}.encode(), {kind!r}
        if kind == "hex" or kind == "HEX":
            blob = (bytes(range(0x90, 0xa8)) + token + bytes(range(0x90, 0xa8))).hex()
            blob = blob.upper() if kind == "HEX" else blob
        else:
            encode = base64.b64encode if kind == "base64" else base64.urlsafe_b64encode
            blob = encode({BEFORE!r}[: 6 + {int(offset or 0)}] + token + {AFTER!r}).decode()
        print("loading credentials", flush=True)
        for i in range(3):
            print(f"config[{{i}}]: blob={{blob}} (cached)", flush=True)
        print("SURVIVES-AROUND-THE-SECRETS", flush=True)
        print("torch.OutOfMemoryError: CUDA out of memory. key=" + blob + " end", flush=True)
        sys.exit(1)
    """)
    layout.write_payload(env={"HF_TOKEN": ENCODED_TOKEN, "FLASH_STOP_GRACE_S": "2"})
    termination = tmp_path / "termination-log"
    proc = layout.cli(*layout.run_args(), env={"FLASH_TERMINATION_LOG": str(termination)})
    assert proc.returncode == 1, proc.stderr.decode()[-2000:]
    said = termination.read_bytes()
    published = [p for p in (layout.store / PREFIX).rglob("*") if p.is_file()]
    assert len(published) >= 2  # the marker and the console tail at least
    for path in published:
        assert _encoded_leaks(path.read_bytes(), ENCODED_TOKEN) == [], path
    assert _encoded_leaks(proc.stderr, ENCODED_TOKEN) == []
    assert _encoded_leaks(said, ENCODED_TOKEN) == []
    # ... and the texts checked did quote the lines, masked
    marker = layout.marker()
    assert marker is not None and "CUDA out of memory" in marker["error"], marker
    assert MASK in marker["error"], marker
    assert b"CUDA out of memory" in said and MASK.encode() in said, said
    assert b"CUDA out of memory" in proc.stderr.splitlines()[-1]
    tail = layout.artifact("console_sft.txt").read_bytes()
    assert b"SURVIVES-AROUND-THE-SECRETS" in tail and tail.count(MASK.encode()) == 4, tail
    written = [p for p in layout.root.rglob("*")
               if p.is_file() and p.name != "payload.json" and "runcode" not in p.parts
               and p.name != "stdout.bin" and "code" not in p.relative_to(layout.root).parts]
    for path in written:
        assert _encoded_leaks(path.read_bytes(), ENCODED_TOKEN) == [], path

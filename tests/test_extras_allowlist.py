"""``extra_pip`` installs packages; it cannot make pip read the host (issue 11).

The payload's ``extra_pip`` is checked when the payload is parsed: requirements, package
URLs, wheel/sdist paths and the allow-listed pip options pass; anything else makes the
payload unusable (exit 2, a fatal marker naming the refused entry) before pip could run.
The runs that pip must never start are in tests/test_run_extras.py.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from conftest import CANARY, Layout

from fsm.errors import PayloadError
from fsm.extras.pip import ARCHIVE_SUFFIXES, EXTRA_PIP_OPTIONS
from fsm.payload import QUOTED_ENTRY_CHARS, parse

ROOT = Path(__file__).resolve().parent.parent

#: Entries that are refused, and the entry the message must name (quoted).
REFUSED: dict[str, tuple[list[str], str]] = {
    "requirement file": (["-r", "/etc/shadow"], "-r"),
    "requirement file, attached": (["-r/etc/shadow"], "-r/etc/shadow"),
    "requirement file, long": (["--requirement", "/etc/shadow"], "--requirement"),
    "requirement file, long=": (["--requirement=/etc/shadow"], "--requirement=/etc/shadow"),
    "constraints file": (["-c", "/etc/shadow"], "-c"),
    "constraints file, long=": (["--constraint=/etc/shadow"], "--constraint=/etc/shadow"),
    "editable": (["-e", "/srv/tree"], "-e"),
    "editable, long": (["--editable", "git+https://h/x.git"], "--editable"),
    "target": (["--target", "/usr/lib"], "--target"),
    "target, short": (["-t", "/usr/lib"], "-t"),
    "prefix": (["--prefix=/usr"], "--prefix=/usr"),
    "root": (["--root", "/"], "--root"),
    "user": (["--user", "torch"], "--user"),
    "src": (["--src", "/srv"], "--src"),
    "config settings": (["--config-settings", "k=v"], "--config-settings"),
    "config settings, short": (["-C", "k=v"], "-C"),
    "unknown option": (["--no-build-isolation", "torch"], "--no-build-isolation"),
    "abbreviated option (optparse expands --req)": (["--req", "/etc/shadow"], "--req"),
    "options end marker": (["--", "-r", "/etc/shadow"], "--"),
    "short options clustered": (["-Ur", "/etc/shadow"], "-Ur"),
    "short option with '='": (["-i=https://h/simple"], "-i=https://h/simple"),
    "option missing its value": (["torch", "--index-url"], "--index-url"),
    "flag given a value": (["--pre=yes"], "--pre=yes"),
    "index URL that is a path": (["--index-url", "/etc/pip"], "/etc/pip"),
    "index URL of another scheme": (["--extra-index-url=ftp://h/simple"], "--extra-index-url="),
    "find-links a plain path": (["-f", "/srv/wheels"], "/srv/wheels"),
    "index URL swallowing an option": (["-i", "-r", "/etc/shadow"], "-r"),
    "bad binary value": (["--only-binary", "-r"], "-r"),
    "bad binary list": (["--no-binary", "a,,b"], "a,,b"),
    "bad upgrade strategy": (["--upgrade-strategy", "always"], "always"),
    "trusted host that is a URL": (["--trusted-host", "https://h"], "https://h"),
    "a file that is not a package": (["/etc/shadow"], "/etc/shadow"),
    "a local project directory": (["./src/project"], "./src/project"),
    "not a requirement": (["not a requirement!"], "not a requirement!"),
    "empty entry": ([""], ""),
    "file URL that is not a package": (["file:///etc/shadow"], "file:///etc/shadow"),
    "name @ file URL that is not a package": (["x @ file:///etc/shadow"], "x @ file:///etc/"),
    "file URL of another host": (["file://fileserver/x.whl"], "file://fileserver/x.whl"),
    "http URL that is not a package": (["https://h/readme"], "https://h/readme"),
    "VCS URL over ssh": (["git+ssh://git@h/x.git"], "git+ssh://"),
    "VCS URL of a local repo": (["git+file:///srv/x.git"], "git+file:///srv/x.git"),
    "path with a marker": (["/etc/shadow;.whl"], "/etc/shadow;.whl"),
}

#: Lists that pass, as written.
ALLOWED: dict[str, list[str]] = {
    "names and specifiers": ["torch", "flash-attn==2.6.3", "numpy>=1.26,<3", "x[extra]~=1.0"],
    "markers": ["pywin32; sys_platform == 'win32'"],
    "name @ url": ["flashx @ git+https://oauth2:tok@github.com/o/r.git@v1",
                   "y @ https://h/y-1.0-py3-none-any.whl"],
    "package URLs": ["https://h/pkgs/z-1.0.tar.gz", "git+https://github.com/o/r.git#egg=r",
                     "file:///opt/wheels/a-1.0-py3-none-any.whl"],
    "wheel and sdist paths": ["/opt/wheels/a-1.0-py3-none-any.whl", "./b-2.0.tar.gz",
                              "c-1.0.tgz", "d.zip", "e.tar.bz2", "f.tar.xz"],
    "index options": ["--index-url", "https://u:p@mirror.example/simple", "-i",
                      "http://127.0.0.1:8080/simple/", "--extra-index-url=file:///srv/index",
                      "--find-links", "https://h/links/", "-f", "file:///opt/wheels",
                      "--no-index", "torch"],
    "flags": ["--pre", "--no-deps", "--upgrade", "-U", "--force-reinstall", "--prefer-binary",
              "torch"],
    "valued options": ["--upgrade-strategy", "eager", "--upgrade-strategy=only-if-needed",
                       "--only-binary", ":all:", "--no-binary=:none:",
                       "--only-binary", "torch,flash-attn,x.y_z", "--trusted-host",
                       "mirror.example", "--trusted-host=127.0.0.1:8080", "torch"],
}


def _train(**overrides: Any) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "hf_repo": "org/runs", "hf_prefix": "sft/r/seed1", "phase": "sft", "seed": 1,
        "job_spec_json": "{}", "env": {"HF_TOKEN": CANARY},
    }
    payload.update(overrides)
    return payload


@pytest.mark.parametrize(("entries", "named"), REFUSED.values(), ids=list(REFUSED))
def test_an_entry_outside_the_allow_list_makes_the_payload_unusable(
    entries: list[str], named: str
) -> None:
    """Each refused kind is a PayloadError: one line naming the key and the entry, quoted."""
    with pytest.raises(PayloadError) as err:
        parse(_train(extra_pip=entries))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("payload key 'extra_pip' entry ")
    assert f"'{named}" in message, message


@pytest.mark.parametrize("entries", ALLOWED.values(), ids=list(ALLOWED))
def test_requirements_packages_and_allowed_options_pass_as_written(entries: list[str]) -> None:
    """What extra_pip is for still passes, unchanged and in order."""
    assert parse(_train(extra_pip=entries)).extra_pip == tuple(entries)


def test_every_allowed_option_passes_in_both_spellings_and_with_its_value() -> None:
    """Every option of the list is usable: as ``--opt value`` and (long names) ``--opt=value``."""
    values = {"url": "https://h/simple", "formats": ":all:", "strategy": "eager",
              "host": "h.example", None: None}
    for option in EXTRA_PIP_OPTIONS:
        value = values[option.value]
        for name in option.names:
            entries = [name] if value is None else [name, value]
            assert parse(_train(extra_pip=[*entries, "torch"])).extra_pip[-1] == "torch"
            if value is not None and name.startswith("--"):
                parse(_train(extra_pip=[f"{name}={value}", "torch"]))


def test_archive_suffixes_are_the_package_formats_pip_installs() -> None:
    assert set(ARCHIVE_SUFFIXES) == {".whl", ".tar.gz", ".tgz", ".zip", ".tar.bz2", ".tar.xz"}
    for suffix in ARCHIVE_SUFFIXES:
        parse(_train(extra_pip=[f"/opt/pkgs/p-1.0{suffix}", f"/opt/pkgs/P-1.0{suffix.upper()}"]))


def test_a_long_refused_entry_is_quoted_shortened() -> None:
    """The message quotes at most ~80 characters of the entry."""
    entry = "--config-settings=" + "k" * 500
    with pytest.raises(PayloadError) as err:
        parse(_train(extra_pip=[entry]))
    quoted = re.search(r"entry 0 '([^']*)'", str(err.value))
    assert quoted is not None
    assert len(quoted.group(1)) <= QUOTED_ENTRY_CHARS
    assert quoted.group(1).startswith("--config-settings=kkk")
    assert quoted.group(1).endswith("...")


@pytest.mark.parametrize("offset", range(40, 80, 3))
def test_a_secret_in_a_refused_entry_is_masked_before_the_quote_is_cut(offset: int) -> None:
    """The quote is cut after the env's secrets are masked: a secret across the cut leaves
    no piece of itself (not whole, not 10 characters of it)."""
    entry = "--install-option=" + "o" * (offset - 17) + CANARY
    with pytest.raises(PayloadError) as err:
        parse(_train(extra_pip=[entry]))
    message = str(err.value)
    pieces = [CANARY[i : i + 10] for i in range(len(CANARY) - 9)]
    assert [p for p in pieces if p in message] == []


def test_url_credentials_in_a_refused_entry_are_masked() -> None:
    """A token in a refused URL's userinfo is not quoted, even when no env key names it."""
    token = "glpat-0123456789abcdefghij"
    with pytest.raises(PayloadError) as err:
        parse(_train(extra_pip=[f"git+ssh://oauth2:{token}@gitlab.example/x.git"]))
    assert token[:10] not in str(err.value)
    assert "git+ssh://***@gitlab" in str(err.value)


# --- through the command line -----------------------------------------------------------

VALIDATE_REFUSED = {k: REFUSED[k] for k in (
    "requirement file", "requirement file, attached", "requirement file, long=",
    "constraints file", "editable", "target", "prefix", "root", "user", "src",
    "config settings", "unknown option", "option missing its value",
    "index URL swallowing an option", "a file that is not a package",
)}


@pytest.mark.parametrize(("entries", "named"), VALIDATE_REFUSED.values(),
                         ids=list(VALIDATE_REFUSED))
def test_validate_refuses_each_kind_with_one_line_naming_the_entry(
    layout: Layout, entries: list[str], named: str
) -> None:
    """``flash-bootstrap validate`` exits 2 with one line naming the refused entry."""
    layout.write_payload(extra_pip=entries)
    proc = layout.cli("validate", str(layout.payload_path))
    assert proc.returncode == 2
    last = proc.stderr.decode().strip().splitlines()[-1]
    assert last.startswith("flash-bootstrap: payload unusable: payload key 'extra_pip' entry ")
    assert f"'{named}" in last
    assert "Traceback" not in proc.stderr.decode()
    assert layout.markers() == []


def test_validate_accepts_allowed_options(layout: Layout) -> None:
    layout.write_payload(extra_pip=[entry for entries in ALLOWED.values() for entry in entries])
    proc = layout.cli("validate", str(layout.payload_path))
    assert proc.returncode == 0, proc.stderr.decode()[-500:]


# --- the documented list ------------------------------------------------------------------


def _readme_section() -> str:
    text = (ROOT / "docs" / "running.md").read_text()
    found = re.search(r"^## Extra packages \(`extra_pip`\)\n(.*?)(?=^#|\Z)", text, re.M | re.S)
    assert found is not None, "docs/running.md lost its extra_pip section"
    return found.group(1)


def test_the_readme_table_lists_exactly_the_allowed_options() -> None:
    """docs/running.md's table of allowed options is EXTRA_PIP_OPTIONS, row for row."""
    rows = [line.split("|")[1:3] for line in _readme_section().splitlines()
            if line.startswith("| `-")]
    documented = [tuple(re.findall(r"`(-[^`]*)`", names)) for names, _ in rows]
    assert documented == [option.names for option in EXTRA_PIP_OPTIONS]
    takes_value = [bool(value.strip()) for _, value in rows]
    assert takes_value == [option.value is not None for option in EXTRA_PIP_OPTIONS]


def test_the_readme_names_the_refused_options_and_suffixes() -> None:
    section = _readme_section()
    for option in ("-r", "-c", "-e", "--target", "--prefix", "--root", "--user", "--src",
                   "--config-settings"):
        assert f"`{option}`" in section
    for suffix in ARCHIVE_SUFFIXES:
        assert f"`{suffix}`" in section


HOST_CANARY = "root:$6$host-file-canary-line-never-leaves$"


@pytest.mark.parametrize("setting", ["PIP_REQUIREMENT", "PIP_CONSTRAINT", "PIP_CONFIG_FILE"])
def test_pip_settings_in_the_payload_env_cannot_make_pip_read_a_host_file(
    layout: Layout, tmp_path: Path, setting: str
) -> None:
    """The environment twins of -r, -c and a config file are not handed to pip (the worker
    still gets the payload's env as it is)."""
    secret_file = tmp_path / "host-file"
    secret_file.write_text(f"{HOST_CANARY}\n")
    layout.write_worker("complete()")
    layout.write_payload(extra_pip=["--no-index", "no-such-package-xyz"],
                         env={"HF_TOKEN": CANARY, setting: str(secret_file)})
    proc = layout.cli(*layout.run_args())
    assert proc.returncode == 1, proc.stderr.decode()[-2000:]
    assert HOST_CANARY.encode() not in proc.stderr + proc.stdout
    marker = layout.marker()
    assert marker is not None and marker["rule"] == "pip-failed"
    for path in layout.root.rglob("*"):
        if path.is_file() and path != secret_file and path.name != "payload.json":
            assert HOST_CANARY.encode() not in path.read_bytes(), path

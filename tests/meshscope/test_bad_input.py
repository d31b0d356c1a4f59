"""Every input a user can give ends in a result or a clear message and exit 2, never a
traceback, and a failed command leaves what it read as it was. Hypothesis generates well over
1,000 cases across the families: run stores, CSV series, config files, inject specs, alert
flags and secret files, uploads, Flight Recorder dumps."""

from __future__ import annotations

import shutil
import socket
import sqlite3
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from meshscope.cli import app

REPO = Path(__file__).resolve().parents[2]
RECORDED = REPO / "fixtures" / "stores" / "slow" / "store.sqlite"
runner = CliRunner()
FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def invoke(*args: str):
    """Run the CLI in-process; the result must be a clean exit (0, 1 for a failed check, 2)."""
    result = runner.invoke(app, list(args), catch_exceptions=True)
    exc = result.exception
    assert exc is None or isinstance(exc, SystemExit), f"traceback for {args}: {type(exc).__name__}: {exc}"
    assert result.exit_code in (0, 1, 2), (args, result.exit_code, result.output[-500:])
    if result.exit_code == 2:
        assert "error:" in result.output or "Usage:" in result.output, result.output[-500:]
    return result


def _foreign_sqlite(path: Path, sql: str) -> None:
    conn = sqlite3.connect(path)
    try:
        conn.executescript(sql)
    except sqlite3.DatabaseError:
        pass
    conn.close()


STORES = st.one_of(
    st.binary(max_size=2048).map(lambda b: ("bytes", b)),
    st.sampled_from(
        [
            "CREATE TABLE steps (x INTEGER); INSERT INTO steps VALUES (1);",
            "CREATE TABLE events (id INTEGER);",
            "CREATE TABLE other (a TEXT);",
            "CREATE TABLE steps (rank INTEGER, step INTEGER); INSERT INTO steps VALUES (0, 0);",
            "",
        ]
    ).map(lambda s: ("sql", s)),
    st.integers(0, 60000).map(lambda n: ("truncated", n)),
)


def _make_store(folder: Path, spec) -> Path:
    kind, value = spec
    folder.mkdir(parents=True, exist_ok=True)
    store = folder / "store.sqlite"
    for p in folder.iterdir():
        p.unlink()
    if kind == "bytes":
        store.write_bytes(value)
    elif kind == "sql":
        _foreign_sqlite(store, value)
    else:
        data = RECORDED.read_bytes()
        store.write_bytes(data[: value % (len(data) + 1)])
    return store


@FUZZ
@given(spec=STORES, command=st.sampled_from(["detect", "explain", "hang-report"]))
def test_corrupt_empty_or_foreign_run_stores(tmp_path, spec, command):
    store = _make_store(tmp_path / "run", spec)
    before = store.read_bytes()
    result = invoke(command, "--run", str(tmp_path / "run"))
    if result.exit_code != 0:
        assert store.read_bytes() == before  # nothing written half-way


@FUZZ
@given(
    content=st.one_of(
        st.binary(max_size=1024), st.text(max_size=600).map(lambda t: t.encode("utf-8", "replace"))
    ),
    columns=st.sampled_from([None, "value", "a,b", "nope", "value,value", "a,,b"]),
)
def test_csv_series(tmp_path, content, columns):
    path = tmp_path / "series.csv"
    path.write_bytes(content)
    args = ["detect", str(path), "-o", str(tmp_path / "out.csv")]
    if columns:
        args += ["--value-columns", columns]
    invoke(*args)


CONFIG_KEYS = [
    "nproc",
    "device",
    "backend",
    "metrics_port",
    "trace",
    "expert_every",
    "run_id",
    "inject",
    "view_url",
]
CONFIG_TABLES = st.dictionaries(
    st.sampled_from(CONFIG_KEYS),
    st.one_of(
        st.integers(-5, 70000),
        st.text(max_size=12),
        st.booleans(),
        st.lists(st.text(max_size=10), max_size=2),
    ),
    min_size=1,
    max_size=4,
)


def _message(result) -> str:
    return result.output.replace("\n", " ")


def _port_taken(result) -> bool:
    """`--check` got to its last check, the ports, and one was taken (by whatever else this
    machine runs): every field before it was accepted, and the message names the flag."""
    return "already in use" in result.output and "--metrics-port" in result.output


@FUZZ
@given(content=st.one_of(st.binary(max_size=600), st.text(max_size=400).map(lambda t: t.encode())))
def test_config_files_that_are_not_toml(tmp_path, content):
    path = tmp_path / "c.toml"
    path.write_bytes(content)
    # --check: everything a run checks, nothing started, so a valid file is exit 0
    result = invoke("run", "--config", str(path), "--check", "--run-dir", str(tmp_path / "runs"))
    assert not (tmp_path / "runs").exists()  # no run directory made
    if result.exit_code == 2 and not _port_taken(result):
        assert str(path) in _message(result), result.output


@FUZZ
@given(table=CONFIG_TABLES)
def test_config_files_with_wrong_values_name_the_field(tmp_path, table):
    path = tmp_path / "c.toml"
    path.write_text("\n".join(f"{k} = {_toml(v)}" for k, v in table.items()))
    result = invoke("run", "--config", str(path), "--check", "--run-dir", str(tmp_path / "runs"))
    assert not (tmp_path / "runs").exists()
    if result.exit_code == 2 and not _port_taken(result):  # it names a field it was given
        assert any(key in _message(result) for key in table), (table, result.output)


def _set_paths() -> list[str]:
    from meshscope.cli.settings import config_fields

    return [path for path, *_ in config_fields()]


@FUZZ
@given(
    settings=st.lists(
        st.tuples(
            st.sampled_from(_set_paths()),
            st.one_of(
                st.integers(-(2**40), 2**40).map(str),
                st.floats(allow_nan=True, allow_infinity=True).map(repr),
                st.sampled_from(["true", "false", '""', "[]", "{}", "[1, 2]", '"x"', "-0"]),
                st.text(max_size=12),
            ),
        ),
        min_size=1,
        max_size=3,
    )
)
def test_any_setting_with_any_value_names_the_field(tmp_path, settings):
    """Every field `meshscope config` lists, given anything on `--set`: a run or exit 2 naming a
    field it was given (the family mix that found tracebacks past the first field checked)."""
    args = [a for path, value in settings for a in ("--set", f"{path}={value}")]
    result = invoke("run", "--check", "--run-dir", str(tmp_path / "runs"), *args)
    if result.exit_code == 2 and not _port_taken(result):
        message = _message(result)
        named = [p.rpartition(".")[2] for p, _ in settings]
        named += [n.replace("_", "-") for n in named]  # as its flag, --slack-webhook-file
        assert any(n in message for n in named) or "--set" in message, (settings, result.output)


def _toml(v) -> str:
    import json

    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, str):  # TOML's escapes: \\uXXXX / \\UXXXXXXXX, never a surrogate pair
        return '"' + "".join(c if c.isprintable() and c not in '"\\' else _escape(c) for c in v) + '"'
    if isinstance(v, list):
        return "[" + ", ".join(map(_toml, v)) + "]"
    return json.dumps(v)


def _escape(c: str) -> str:
    return f"\\u{ord(c):04x}" if ord(c) < 0x10000 else f"\\U{ord(c):08x}"


@FUZZ
@given(
    spec=st.one_of(
        st.text(max_size=60),
        st.builds(
            lambda k, body: f"{k}@{body}",
            st.sampled_from(
                [
                    "kill",
                    "hang",
                    "slow",
                    "nan",
                    "expert_collapse",
                    "collective_mismatch",
                    "memory_leak",
                    "bogus",
                ]
            ),
            st.text(alphabet="step=rank,0123456789.-abcdefxyz", max_size=40),
        ),
    )
)
def test_inject_specs(tmp_path, spec):
    result = invoke("run", "--inject", spec, "--check", "--run-dir", str(tmp_path / "runs"))
    assert not (tmp_path / "runs").exists()
    if result.exit_code == 2 and not _port_taken(result):  # it reached the parser and model check
        assert "inject" in _message(result), result.output


@FUZZ
@given(
    smtp=st.text(max_size=30), nnodes=st.text(max_size=8), secret=st.one_of(st.none(), st.binary(max_size=64))
)
def test_alert_and_elastic_flags(tmp_path, smtp, nnodes, secret):
    args = [
        "run",
        "--check",
        "--run-dir",
        str(tmp_path / "runs"),
        "--smtp",
        smtp,
        "--email-to",
        "ops@example.com",
        "--nnodes",
        nnodes,
    ]
    if secret is not None:
        (tmp_path / "hook").write_bytes(secret)
        args += ["--slack-webhook-file", str(tmp_path / "hook")]
    else:
        args += ["--slack-webhook-file", str(tmp_path / "missing")]
    result = invoke(*args)
    assert not (tmp_path / "runs").exists()
    if result.exit_code == 2 and not _port_taken(result):  # the flag at fault is named
        assert any(w in _message(result) for w in ("smtp", "nnodes", "slack", "webhook")), result.output


@FUZZ
@given(content=st.binary(max_size=1024), name=st.sampled_from(["s.csv", "s.pt", "s"]))
def test_feedback_uploads(tmp_path, content, name):
    run = tmp_path / "run"
    if not run.exists():
        run.mkdir()
        shutil.copy(RECORDED, run / "store.sqlite")
    path = tmp_path / name
    path.write_bytes(content)
    invoke("feedback", "ingest", str(path), "--run", str(run))


@FUZZ
@given(files=st.lists(st.binary(max_size=300), min_size=1, max_size=3))
def test_flight_recorder_dumps(tmp_path, files):
    folder = tmp_path / "fr"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    for i, content in enumerate(files):
        (folder / f"rank{i}").write_bytes(content)
    assert invoke("hang-report", "--flight-recorder", str(folder), "--prefix", "rank").exit_code in (0, 2)


def test_detect_run_is_idempotent(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(RECORDED.parent, run)
    first = invoke("detect", "--run", str(run))
    n = (
        sqlite3.connect(run / "store.sqlite")
        .execute("SELECT count(*) FROM events WHERE kind = 'anomaly'")
        .fetchone()[0]
    )
    invoke("detect", "--run", str(run))
    again = (
        sqlite3.connect(run / "store.sqlite")
        .execute("SELECT count(*) FROM events WHERE kind = 'anomaly'")
        .fetchone()[0]
    )
    assert first.exit_code == 0 and n >= 1 and again == n


def test_several_nodes_without_one_shared_run_id_are_refused_before_anything_starts(tmp_path):
    result = invoke(
        "run",
        "--run-dir",
        str(tmp_path),
        "--nnodes",
        "2",
        "--rdzv-endpoint",
        "127.0.0.1:29400",
        "--steps",
        "2",
    )
    assert result.exit_code == 2 and "--run-id" in result.output, result.output
    assert not any(tmp_path.iterdir()), "nothing is written before the refusal"


@pytest.mark.parametrize(
    ("store", "password_file", "says"),
    [
        ("http://db:5432/x", "", "not a postgresql:// URL"),
        ("postgresql://ms:hunter2@db:5432/x", "", "carries a password"),
        ("postgresql:///x", "", "names no host"),
        ("postgresql://ms@db/x", "/nonexistent/pw", "store_password_file"),
        ("", "/etc/hostname", "names a password for no store"),
    ],
)
def test_a_job_store_that_cannot_work_is_refused_before_anything_starts(tmp_path, store, password_file, says):
    args = ["run", "--run-dir", str(tmp_path), "--steps", "2", "--store", store]
    result = invoke(*args, *(["--store-password-file", password_file] if password_file else []))
    assert result.exit_code == 2 and says in result.output, result.output
    assert "hunter2" not in result.output  # a password given by mistake is never echoed
    assert not any(tmp_path.iterdir()), "nothing is written before the refusal"


def _busy_port() -> tuple[socket.socket, int]:
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    return held, held.getsockname()[1]


@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("value-columns twice", "--value-columns value,value: name each column once"),
        ("linger for ever", "linger_s"),
        ("a batch no memory holds", "train.batch_size"),
        ("hang-watch on a typo", "--run"),
        ("replay a text file", "not a snapshot"),
        ("view on a busy port", "--port"),
    ],
)
def test_the_inputs_that_once_got_through_exit_2_naming_the_field(tmp_path, case, says):
    """Each once ended in a traceback, a hang or a misleading message: now exit 2 before
    anything starts, naming the flag or field."""
    csv = tmp_path / "s.csv"
    csv.write_text("t,value\n0,1\n1,2\n")
    (tmp_path / "x.txt").write_text("hello")
    held, port = _busy_port()
    with held:
        args = {
            "value-columns twice": ["detect", str(csv), "--value-columns", "value,value"],
            "linger for ever": [
                "run",
                "--run-dir",
                str(tmp_path / "r"),
                "--set",
                "linger_s=99999999999999999999",
            ],
            "a batch no memory holds": [
                *("run", "--run-dir", str(tmp_path / "r"), "--set", "train.batch_size=99999999999999999999"),
            ],
            "hang-watch on a typo": ["hang-watch", "--run", str(tmp_path / "no" / "such" / "run")],
            "replay a text file": ["replay", str(tmp_path / "x.txt")],
            "view on a busy port": ["view", "--runs", str(tmp_path), "--port", str(port)],
        }[case]
        result = invoke(*args)
    assert result.exit_code == 2 and says in result.output, result.output[-800:]
    assert "announce" not in result.output and "meshscope view on" not in result.output
    assert not (tmp_path / "r").exists(), "nothing is written before the refusal"

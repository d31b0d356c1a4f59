"""`meshscope stack up` refuses clearly: a missing binary names the package, a busy port names the
part that wanted it; nothing is left running either way."""

import os
import socket
import subprocess
import sys

from fixtures.ports import free_port_range
from fixtures.runs import REPO, meshscope


def stack_up(tmp_path, *extra, env=None):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "meshscope",
            "stack",
            "up",
            "--runs",
            str(tmp_path / "runs"),
            "--home",
            str(tmp_path / "home"),
            *extra,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_missing_binaries_name_what_to_install(tmp_path):
    env = {**os.environ, "PATH": str(tmp_path)}  # nothing on PATH
    port = free_port_range(2)
    out = stack_up(tmp_path, "--prometheus-port", str(port), "--alertmanager-port", str(port + 1), env=env)
    assert out.returncode == 2
    assert "prometheus-alertmanager" in out.stderr or "prometheus" in out.stderr
    assert "apt-get install prometheus prometheus-alertmanager" in out.stderr
    assert not list((tmp_path / "home").glob("*.json"))  # no pid files: nothing started


def test_a_busy_port_names_the_part(tmp_path):
    port = free_port_range(2)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port))
        busy.listen()
        out = stack_up(tmp_path, "--prometheus-port", str(port), "--alertmanager-port", str(port + 1))
    assert out.returncode == 2
    assert f"cannot start prometheus: port {port}" in out.stderr and "--prometheus-port" in out.stderr
    assert not list((tmp_path / "home").glob("*.json"))


def test_status_without_a_stack_says_so(tmp_path):
    out = meshscope("stack", "status", "--home", str(tmp_path / "nothing"), timeout=60)
    assert out.returncode == 1 and "no stack started" in out.stdout

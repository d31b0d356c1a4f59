"""The warm standby: a forked worker behaves, to torchrun, exactly like an exec'd one."""
import os
import subprocess
import sys
import time

import pytest

from collector.store import load_steps
from tests.helpers.runs import REPO
from trainer.config import load_config


def write_config(tmp_path, *inject):
    cfg = load_config(REPO / "tests/data/tiny.toml", {
        "run_id": "z", "runs_root": str(tmp_path), "nproc": 1, "train": {"steps": 5},
        "inject": list(inject), "metrics_port": 29000 + os.getpid() % 1000})
    cfg.run_dir.mkdir(parents=True)
    path = cfg.run_dir / "config.json"
    path.write_text(cfg.model_dump_json())
    return path


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    sock = tmp_path_factory.mktemp("zy") / "z.sock"
    proc = subprocess.Popen([sys.executable, "-m", "trainer.zygote", "--socket", str(sock)],
                            cwd=REPO)
    deadline = time.monotonic() + 60
    while not sock.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    yield sock
    proc.terminate()
    proc.wait(timeout=10)


def spawn(config, sock):
    env = dict(os.environ, MESHSCOPE_ZYGOTE=str(sock), PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "trainer.spawn", "--config", str(config)],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=120)


def test_forked_worker_trains_and_exits_zero(tmp_path, zygote):
    config = write_config(tmp_path)
    done = spawn(config, zygote)
    assert done.returncode == 0, done.stderr
    assert load_steps(config.parent)["step"].tolist() == [0, 1, 2, 3, 4]
    pid = int((config.parent / "pids" / "rank0.pid").read_text())
    assert pid != done.returncode  # the worker was the zygote's child, not the client


def test_a_killed_worker_kills_its_client_with_the_same_signal(tmp_path, zygote):
    done = spawn(write_config(tmp_path, "kill@step=2,rank=0"), zygote)
    assert done.returncode == -9


def test_without_a_zygote_the_client_becomes_a_plain_worker(tmp_path):
    config = write_config(tmp_path)
    done = spawn(config, tmp_path / "missing.sock")
    assert done.returncode == 0, done.stderr
    assert "warm standby unavailable" in done.stderr
    assert len(load_steps(config.parent)) == 5

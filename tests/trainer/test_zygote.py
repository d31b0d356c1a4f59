"""The warm standby: a forked worker behaves, to torchrun, exactly like an exec'd one."""

import os
import subprocess
import sys
import types

import pytest

from fixtures.runs import REPO
from meshscope.collector.store import load_steps
from meshscope.config import load_config


def write_config(tmp_path, *inject):
    cfg = load_config(
        REPO / "fixtures/tiny.toml",
        {
            "run_id": "z",
            "runs_root": str(tmp_path),
            "nproc": 1,
            "train": {"steps": 5},
            "inject": list(inject),
            "metrics_port": 29000 + os.getpid() % 1000,
        },
    )
    cfg.run_dir.mkdir(parents=True)
    path = cfg.run_dir / "config.json"
    path.write_text(cfg.model_dump_json())
    return path


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    sock = tmp_path_factory.mktemp("zy") / "z.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshscope.trainer.zygote", "--socket", str(sock)], cwd=REPO
    )
    # not waited for, as the launcher does not: the first client waits while it warms up
    yield types.SimpleNamespace(sock=sock, pid=proc.pid)
    proc.terminate()
    proc.wait(timeout=10)


def spawn(config, sock, zygote_pid: int | None = None):
    """The client torchrun would exec, run to its end; its pid rides along on the result."""
    env = dict(os.environ, MESHSCOPE_ZYGOTE=str(sock), PYTHONPATH=str(REPO))
    if zygote_pid is not None:
        env["MESHSCOPE_ZYGOTE_PID"] = str(zygote_pid)
    client = subprocess.Popen(
        [sys.executable, "-m", "meshscope.trainer.spawn", "--config", str(config)],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    stdout, stderr = client.communicate(timeout=120)
    return subprocess.CompletedProcess(client.args, client.returncode, stdout, stderr), client.pid


def test_forked_worker_trains_and_exits_zero(tmp_path, zygote):
    config = write_config(tmp_path)
    done, client = spawn(config, zygote.sock, zygote.pid)  # sent while the zygote warms up
    assert done.returncode == 0, done.stderr
    assert "unavailable" not in done.stderr, done.stderr
    assert load_steps(config.parent)["step"].tolist() == [0, 1, 2, 3, 4]
    worker = int((config.parent / "pids" / "rank0.pid").read_text())
    # the rank ran in a process forked by the zygote: neither the client nor the zygote itself
    assert worker not in (client, zygote.pid), (worker, client, zygote.pid)


def test_a_killed_worker_kills_its_client_with_the_same_signal(tmp_path, zygote):
    done, _ = spawn(write_config(tmp_path, "kill@step=2,rank=0"), zygote.sock, zygote.pid)
    assert done.returncode == -9


def test_without_a_zygote_the_client_becomes_a_plain_worker(tmp_path):
    config = write_config(tmp_path)
    done, client = spawn(config, tmp_path / "missing.sock")
    assert done.returncode == 0, done.stderr
    assert "warm standby unavailable" in done.stderr
    assert len(load_steps(config.parent)) == 5
    assert int((config.parent / "pids" / "rank0.pid").read_text()) == client  # it trained itself


def test_a_client_of_a_zygote_that_ended_without_serving_becomes_a_plain_worker(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    config = write_config(tmp_path)
    done, client = spawn(config, tmp_path / "never.sock", gone.pid)
    assert done.returncode == 0, done.stderr
    assert "ended without serving" in done.stderr
    assert int((config.parent / "pids" / "rank0.pid").read_text()) == client


# --- fork safety: the zygote never initialises an accelerator --------------------------------

PRETEND_GPU = """
import sys, torch
from meshscope.trainer.forksafe import AcceleratorTripwire
# What warm-up code sees on a GPU machine: a device is available...
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
# ...and every way to reach it (lazy init and the queries that trigger it) is forbidden.
AcceleratorTripwire(strict=True).install()
def forbidden(name):
    def touch(*a, **k):  # one function per name: torch._dynamo refuses shared objects
        raise RuntimeError(f"warm-up touched the accelerator: torch.cuda.{{name}}")
    return touch
for name in ("current_device", "get_device_properties", "get_device_capability", "set_device",
             "synchronize", "mem_get_info", "memory_allocated", "Stream", "Event"):
    setattr(torch.cuda, name, forbidden(name))
# ...and so is a backward: the autograd engine's first one counts devices in C++ (cuInit),
# which no Python wrapper sees and after which a forked worker's CUDA fails (H200, torch 2.11)
def no_backward(*a, **k):
    raise RuntimeError("warm-up ran a backward: the autograd engine initialises the driver")
torch.autograd.backward = no_backward
import meshscope.trainer.zygote
meshscope.trainer.zygote.warm_up()
{extra}
print("clean")
"""


def run_python(code, **env):
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(REPO), **env),
    )


def test_the_warm_up_never_touches_an_accelerator_even_when_one_is_there():
    done = run_python(PRETEND_GPU.format(extra=""))
    assert done.returncode == 0 and "clean" in done.stdout, done.stderr


def test_the_pretend_gpu_harness_catches_a_warm_up_that_touches_the_device():
    done = run_python(PRETEND_GPU.format(extra="torch.cuda._lazy_init()"))
    assert done.returncode != 0
    assert "AcceleratorTouched" in done.stderr and "torch.cuda._lazy_init" in done.stderr


TOUCHING_ZYGOTE = """
import sys, trainer.zygote as z
plain = z.warm_up
def warm_up_that_touches():
    plain()
    import torch
    try:
        torch.cuda.init()  # CPU build: records the touch, then fails to find CUDA
    except Exception:
        pass
z.warm_up = warm_up_that_touches
sys.argv = ["zygote", "--socket", sys.argv[1]]
z.main()
"""


def test_a_zygote_that_touched_a_device_refuses_to_serve(tmp_path):
    sock = tmp_path / "z.sock"
    done = subprocess.run(
        [sys.executable, "-c", TOUCHING_ZYGOTE, str(sock)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    from meshscope.trainer.zygote import UNSAFE_EXIT

    assert done.returncode == UNSAFE_EXIT
    assert "forking is unsafe" in done.stderr and "torch.cuda.init was called" in done.stderr
    assert not sock.exists()


def test_the_probe_starts_a_device_runtime_in_its_child_and_names_one_that_fails(monkeypatch):
    # a driver initialised below Python marks no bad fork: only starting the runtime tells
    from meshscope.trainer import forksafe

    class PoisonedGpu:
        @staticmethod
        def device_count():
            return 1

        @staticmethod
        def init():
            raise RuntimeError("CUDA error: initialization error")

    class NoDevice(PoisonedGpu):
        @staticmethod
        def device_count():
            return 0

    monkeypatch.setattr(forksafe, "_accelerator_modules", lambda: [("cuda", NoDevice)])
    assert forksafe.probe_fork() is None
    monkeypatch.setattr(forksafe, "_accelerator_modules", lambda: [("cuda", PoisonedGpu)])
    assert "cannot use its accelerator" in forksafe.probe_fork()


def test_fork_hazard_asks_every_runtime(monkeypatch):
    import torch

    from meshscope.trainer import forksafe

    assert forksafe.fork_hazard() is None
    assert forksafe.probe_fork() is None

    class StandInNpu:
        @staticmethod
        def is_initialized():
            return True

    monkeypatch.setattr(torch, "npu", StandInNpu, raising=False)
    assert "torch.npu is initialised" in forksafe.fork_hazard()

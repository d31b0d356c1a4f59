"""The README's own-loop script, run verbatim under torchrun as a new user would run it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import requests

from fixtures.ports import free_port_range
from fixtures.runs import REPO, meshscope
from meshscope.collector.store import load_events, load_steps
from tests.conftest import require_binary

README_STEPS = 2000  # ~2 ms a step here: several of the Monitor's batches (`record_every_s`)


def readme_script() -> str:
    """The first python block under "Your own training loop"."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Your own training loop") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _scrape_once_steps_are_out(port: int, proc: subprocess.Popen) -> str:
    """rank 0's /metrics once some windows of steps are exported (while the loop still runs)."""
    while proc.poll() is None:
        try:
            body = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
        except requests.RequestException:
            body = ""
        found = re.search(r"^meshscope_steps_total (\S+)", body, re.M)
        if found and float(found.group(1)) >= 20:
            return body
        time.sleep(0.1)
    raise AssertionError("the script ended before /metrics showed 20 steps: " + proc.stdout.read()[-3000:])


def test_the_readme_loop_runs_and_meshscope_reads_it(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(readme_script())
    port = free_port_range(2)
    run = tmp_path / "my-run"
    # long enough that /metrics is read while it runs: records come a batch a second
    env = dict(os.environ, RUN_DIR=str(run), METRICS_PORT=str(port), STEPS=str(README_STEPS))
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    body = _scrape_once_steps_are_out(port, proc)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out[-3000:]
    assert "not initialised" not in out, out[-2000:]  # the README's order needs no warning
    # /metrics: clean for promtool, exposed communication within the total
    check = subprocess.run(
        [require_binary("promtool"), "check", "metrics"], input=body, capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    total = float(re.search(r'meshscope_comm_seconds_total\{kind="total"\} (\S+)', body).group(1))
    exposed = float(re.search(r'meshscope_comm_seconds_total\{kind="exposed"\} (\S+)', body).group(1))
    assert 0 <= exposed <= total, (exposed, total)
    assert re.search(r"^meshscope_loss \d", body, re.M), "the loop logs its loss"
    assert "meshscope_grad_norm" not in body  # never logged: absent, not NaN
    # the store: every step of both ranks, and a run that started and ended
    assert load_steps(run).groupby("rank")["step"].max().tolist() == [README_STEPS - 1] * 2
    events = load_events(run)
    start, end = (events[events["kind"] == k] for k in ("run_start", "run_end"))
    assert len(start) == 1 and start.iloc[0]["detail"]["backend"] == "gloo"
    assert len(end) == 1 and end.iloc[0]["detail"]["steps"] == README_STEPS
    # a clean run has no hang, and the summary reads it as finished
    report = meshscope("hang-report", "--run", str(run), "--json")
    assert report.returncode == 0 and '"type": "none"' in report.stdout, report.stdout + report.stderr


def _torchrun(tmp_path, script: str, name: str) -> subprocess.CompletedProcess:
    (tmp_path / f"{name}.py").write_text(script)
    env = dict(os.environ, RUN_DIR=str(tmp_path / name), METRICS_PORT=str(free_port_range(2)), STEPS="20")
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            f"{name}.py",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_a_monitor_built_before_the_process_group_attaches_at_watch(tmp_path):
    script = readme_script().replace('dist.init_process_group("gloo")  #', "#")
    script = script.replace("model = mon.watch(", 'dist.init_process_group("gloo")\nmodel = mon.watch(')
    # each rank says whether it has a control plane in a file of its own (stdout interleaves)
    said = 'open(os.environ["RUN_DIR"] + f".plane{dist.get_rank()}", "w").write(str(mon.control is not None))'
    script = script.replace("mon.close()", f"{said}\nmon.close()")
    done = _torchrun(tmp_path, script, "late")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    planes = [(tmp_path / f"late.plane{r}").read_text() for r in (0, 1)]
    assert planes == ["True", "True"], planes
    assert "not initialised" not in done.stdout + done.stderr
    assert load_steps(tmp_path / "late")["step"].max() == 19


def test_a_job_without_a_process_group_gets_one_warning_per_rank(tmp_path):
    script = readme_script().replace('dist.init_process_group("gloo")  #', "#")
    script = script.replace("mon.watch(DDP(net))", "mon.watch(net)").replace(
        "dist.destroy_process_group()", ""
    )
    done = _torchrun(tmp_path, script, "alone")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    said = done.stdout + done.stderr
    assert said.count("torch.distributed is not initialised in a job of 2 ranks") == 2, said[-2000:]


def test_hang_watch_beside_a_users_job_names_the_stuck_rank(tmp_path):
    # the README loop, with rank 1 stuck in its own code at step 30 while rank 0 waits in DDP
    stuck = '        with s.phase("forward"):\n'
    script = readme_script().replace(
        stuck,
        "        if step == 30 and dist.get_rank() == 1:\n            import time; time.sleep(120)\n" + stuck,
    )
    (tmp_path / "stuck.py").write_text(script)
    run = tmp_path / "stuck"
    env = dict(os.environ, RUN_DIR=str(run), METRICS_PORT=str(free_port_range(2)), STEPS="60")
    job = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "stuck.py"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        watched = meshscope("hang-watch", "--run", str(run), "--hang-after", "2", "--abort", timeout=150)
    finally:
        job.kill()
        job.wait()
    assert watched.returncode == 0, watched.stdout + watched.stderr
    assert "culprit_ranks" in watched.stdout and "[1]" in watched.stdout, watched.stdout
    hangs = load_events(run, kind="hang")
    assert len(hangs) >= 1 and hangs.iloc[0]["detail"]["culprit_ranks"] == [1], hangs

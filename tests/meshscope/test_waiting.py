"""An agent that lost its peers says what it waits for, from its own node's files."""

from __future__ import annotations

from meshscope import launcher, waiting
from meshscope.collector.schema import Event
from meshscope.collector.store import insert_events
from meshscope.config import RunConfig


def _job(tmp_path) -> RunConfig:
    cfg = RunConfig(
        run_id="job", runs_root=tmp_path, elastic={"nnodes": "2", "rdzv_endpoint": "10.0.0.1:29400"}
    )
    (cfg.run_dir / "checkpoints" / "step_00000040").mkdir(parents=True)
    (cfg.run_dir / "checkpoints" / ".step_00000044.partial").mkdir()  # never finished: not one
    hang = {"type": "dead", "culprit_ranks": [2, 3], "why": "node 1 lost"}
    insert_events(cfg.run_dir, [Event(kind="hang", run_id="job", step=57, detail=hang)])
    return cfg


def test_a_node_whose_peers_are_gone_says_where_it_waits_the_fault_and_the_resume_step(tmp_path):
    line = waiting.waiting_line(_job(tmp_path), 34.0, started=True)
    assert "no step for 34 s" in line and "waiting at 10.0.0.1:29400 until 2 node(s) join" in line, line
    assert "ranks 2, 3 dead at step 57" in line and "checkpoint of step 40" in line, line


class _Running:
    returncode = None

    def __init__(self) -> None:
        self.polls = 0

    def poll(self):
        self.polls += 1
        if self.polls > 12:
            self.returncode = 0
        return self.returncode


def test_follow_says_it_again_while_no_step_comes(tmp_path, monkeypatch):
    monkeypatch.setattr(waiting, "SAY_EVERY_S", 0.1)
    said: list[str] = []
    assert launcher.follow(_job(tmp_path), _Running(), lambda *a: None, poll_s=0.05, on_wait=said.append) == 0
    assert len(said) >= 2 and all("waiting at 10.0.0.1:29400" in s for s in said), said


def test_a_node_whose_job_ended_says_torchrun_waits_for_the_others_to_leave(tmp_path):
    cfg = _job(tmp_path)
    insert_events(cfg.run_dir, [Event(kind="run_end", run_id="job", step=59)])
    line = waiting.waiting_line(cfg, 20.0, started=True)
    assert "training ended 20 s ago" in line and "exit barrier" in line, line

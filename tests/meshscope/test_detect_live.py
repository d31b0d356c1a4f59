"""The engine beside a live run: a slowed rank becomes one straggler anomaly, nothing before."""

from fixtures.runs import TINY, start_run
from fixtures.sinks import Sink
from meshscope.collector.store import load_events


def test_live_run_with_a_slow_rank_yields_one_straggler_event(tmp_path):
    # steps of ~40 ms rather than the tiny config's ~10 ms: OS jitter on 2 busy cores is not a fault
    config = tmp_path / "live.toml"
    config.write_text(
        TINY.read_text().replace("d_model = 32", "d_model = 64").replace("batch_size = 8", "batch_size = 16")
    )
    sink = Sink()
    sink.start()
    webhook = tmp_path / "webhook"
    webhook.write_text(f"http://127.0.0.1:{sink.port}/hook")
    proc = start_run(
        tmp_path,
        "live",
        None,
        "--steps",
        "60",
        "--inject",
        "slow@step=40,rank=1,steps=8,factor=3",
        "--slack-webhook-file",
        str(webhook),
        config=config,
    )
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    anomalies = load_events(tmp_path / "live", kind="anomaly")["detail"].tolist()
    assert [(a["type"], a["ranks"]) for a in anomalies] == [("straggler", [1])], anomalies
    a = anomalies[0]
    assert 40 <= a["start_step"] <= 43 and a["end_step"] >= 46  # found within 3 steps
    assert a["evidence"]["ratio"] > 2
    assert "straggler ranks=[1]" in out
    sink.stop()
    assert len(sink.received) == 1 and "straggler in live" in sink.received[0]["text"]

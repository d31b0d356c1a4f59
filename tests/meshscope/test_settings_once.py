"""Every setting is declared once: each room's own model, nested in the run's one config, read
by the TOML, `--set` and `meshscope config`; the Monitor of `meshscope run` gets the run's
`[monitor]` section whole, and configs written before the sections keep working."""

import json
from collections import defaultdict
from pathlib import Path

import pytest
from pydantic import BaseModel

from fixtures.ports import free_port_range
from meshscope.cli.settings import config_fields
from meshscope.collector import DistEnv
from meshscope.collector.monitor_config import MonitorConfig, MonitorSettings
from meshscope.collector.rundir import run_info
from meshscope.config import ConfigError, RunConfig, load_config
from meshscope.trainer.config import MOVED, TrainerConfig
from meshscope.trainer.config import load_config as load_run_sections
from meshscope.trainer.device import Device
from meshscope.trainer.worker import build_monitor

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
# one name, two meanings: each is said here with why it is not one setting declared twice
HOMONYMS = {"mode": {"alerts.mode": "which path carries alerts", "tracer.mode": "what the tracer hooks"}}


def _declared(model: type[BaseModel], prefix: str = "") -> dict[str, list[str]]:
    """Setting name -> the config paths that declare it, over the run's config tree."""
    out: dict[str, list[str]] = defaultdict(list)
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            for inner, paths in _declared(field.annotation, f"{prefix}{name}.").items():
                out[inner] += paths
        else:
            out[name].append(prefix + name)
    return out


def test_no_setting_is_declared_twice():
    twice = {name: paths for name, paths in _declared(RunConfig).items() if len(paths) > 1}
    assert twice == {name: sorted(paths) for name, paths in HOMONYMS.items()}


def test_the_monitor_adds_only_where_it_writes_to_the_run_s_monitor_section():
    own = set(MonitorConfig.model_fields) - set(MonitorSettings.model_fields)
    assert own == {"run_dir", "run_id", "nan_events"}
    assert not own & set(_declared(RunConfig)) - {"run_id"}  # run_id: the run's, handed down


def test_each_section_reaches_the_toml_set_and_meshscope_config(tmp_path):
    paths = {path for path, *_ in config_fields()}
    assert {
        "monitor.memory_every",
        "tracer.max_lag_steps",
        "gradients.every",
        "alerts.outbox.per_minute",
    } <= (paths)
    toml = tmp_path / "c.toml"
    toml.write_text(
        "[monitor]\nmemory_every = 7\n[tracer]\nstats_every = 3\n[alerts.outbox]\nper_minute = 2\n"
    )
    cfg = load_config(toml, {"gradients": {"every": 4}})
    assert (cfg.monitor.memory_every, cfg.tracer.stats_every, cfg.alerts.outbox.per_minute) == (7, 3, 2)
    assert cfg.gradients.every == 4
    for text, field in [
        ("[monitor]\ndrain_interval_s = 0\n", "monitor.drain_interval_s"),
        ("[tracer]\nmode = 'loud'\n", "tracer.mode"),
        ("[alerts.outbox]\nper_minute = 0\n", "alerts.outbox.per_minute"),
        ("[monitor]\nmetrics_host = 'not a host!'\n", "monitor.metrics_host"),
    ]:
        toml.write_text(text)
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            load_config(toml)


def test_the_run_s_monitor_section_reaches_the_monitor_whole(tmp_path):
    port = free_port_range()
    cfg = load_config(
        None,
        {
            "runs_root": str(tmp_path),
            "run_id": "r",
            "monitor": {"metrics_port": port, "memory_every": 7, "flight_capacity": 64, "sync_every": 3},
        },
    )
    assert load_config(None, {"monitor": {"detail_every": 4}}).monitor.detail_every == 4
    cfg.run_dir.mkdir(parents=True)
    env = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1)
    mon = build_monitor(cfg, env, Device("cpu"), None)
    try:
        # the trainer times every step unless told otherwise: its detectors judge phases
        assert cfg.monitor.detail_every is None and mon.config.detail_every == 1
        given = {**cfg.monitor.model_dump(), "detail_every": 1}
        assert {k: getattr(mon.config, k) for k in MonitorSettings.model_fields} == given
        assert (mon.config.run_dir, mon.config.run_id) == (cfg.run_dir, "r")
    finally:
        mon.close()


def test_configs_written_before_the_sections_keep_working(tmp_path):
    recorded = FIXTURES / "stores" / "persistent" / "clean4"
    old = json.loads((recorded / "config.json").read_text())
    assert {"metrics_port", "expert_every", "comm_sample_every"} <= set(old)  # a run recorded flat
    # the trainer's own sections of an older run's config.json, as its worker reads them
    cfg = load_run_sections(recorded / "config.json", model=TrainerConfig, own_sections=True)
    assert (cfg.monitor.metrics_port, cfg.monitor.expert_every) == (old["metrics_port"], old["expert_every"])
    assert run_info(recorded).expert_every == old["expert_every"]
    toml = tmp_path / "old.toml"
    toml.write_text('trace = "stats"\nexpert_every = 3\n[monitor]\ncomm_sample_every = 4\n')
    cfg = load_config(toml, {"metrics_port": 9500})  # an old --set key too
    assert (cfg.tracer.mode, cfg.monitor.expert_every, cfg.monitor.comm_sample_every) == ("stats", 3, 4)
    assert cfg.monitor.metrics_port == 9500
    new = tmp_path / "new"
    new.mkdir()
    (new / "config.json").write_text(cfg.model_dump_json())
    assert run_info(new).expert_every == 3
    assert all(path.split(".")[1] in _declared(RunConfig) for path in MOVED.values())

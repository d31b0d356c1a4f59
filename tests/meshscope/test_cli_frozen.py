"""The CLI is an interface: its commands, flags and defaults are frozen in tests/data/cli.json,
so a change to them is a deliberate edit of that file (`UPDATE_CLI=1 pytest this file`), never
an accident. Config fields reach `meshscope run` through `--set`, read off the models."""

import json
import os
from pathlib import Path

import typer.main
from typer.testing import CliRunner

from meshscope.cli import app, config_fields
from meshscope.config import RunConfig

FROZEN = Path(__file__).resolve().parents[1] / "data" / "cli.json"
runner = CliRunner()


def _describe(command, prefix=""):
    out = {}
    if hasattr(command, "commands"):
        for name, sub in sorted(command.commands.items()):
            out.update(_describe(sub, f"{prefix}{name} ".lstrip()))
        return out
    out[prefix.strip()] = sorted(
        [sorted(p.opts + p.secondary_opts), repr(p.default) if p.default is not None else None]
        for p in command.params
    )
    return out


def test_the_cli_matches_its_frozen_description():
    now = _describe(typer.main.get_command(app))
    if os.environ.get("UPDATE_CLI"):
        FROZEN.write_text(json.dumps(now, indent=1, sort_keys=True) + "\n")
    assert now == json.loads(FROZEN.read_text()), "CLI changed: UPDATE_CLI=1 to accept"


def test_every_config_field_is_listed_and_settable(tmp_path):
    rows = config_fields()
    paths = {path for path, *_ in rows}
    assert {"train.powersgd_rank", "elastic.keep", "elastic.heartbeat_s", "model.d_model"} <= paths
    assert all(description for *_, description in rows)  # every field says what it is for
    from meshscope.cli import apply_set_options
    from meshscope.config import load_config

    cfg = load_config(
        None,
        apply_set_options(
            ["train.powersgd_rank=8", "elastic.keep=5", "elastic.heartbeat_s=0.5", 'run_id="x"'],
            {"train": {"steps": 7}},
        ),
    )
    assert (
        cfg.train.powersgd_rank,
        cfg.elastic.keep,
        cfg.elastic.heartbeat_s,
        cfg.run_id,
        cfg.train.steps,
    ) == (8, 5, 0.5, "x", 7)
    assert isinstance(cfg, RunConfig)


def test_a_bad_setting_names_the_field_and_exits_2(tmp_path):
    for item, message in [
        ("elastic.keep=0", "elastic.keep"),
        ("train.nosuch=1", "nosuch"),
        ("justtext", "PATH=VALUE"),
    ]:
        result = runner.invoke(app, ["run", "--run-dir", str(tmp_path), "--set", item])
        assert result.exit_code == 2 and message in result.output, (item, result.output)
    assert not any(tmp_path.iterdir())  # nothing written


def test_config_lists_fields_and_validates_a_file(tmp_path):
    good = tmp_path / "good.toml"
    good.write_text("[train]\npowersgd_rank = 6\n")
    result = runner.invoke(app, ["config", "--config", str(good), "--json"])
    assert result.exit_code == 0, result.output
    fields = {f["field"]: f for f in map(json.loads, result.output.splitlines())}
    assert fields["train.powersgd_rank"]["value"] == "6" and fields["train.powersgd_rank"]["default"] == "4"
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\npowersgd_rank = 0\n")
    result = runner.invoke(app, ["config", "--config", str(bad)])
    assert result.exit_code == 2 and "train.powersgd_rank" in result.output

"""`meshscope config` and `--set`: every setting read off the config models, said once."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import typer
from rich.table import Table

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib
from meshscope.cli.common import app, console, fail
from meshscope.cli.flags import put
from meshscope.config import ConfigError, RunConfig, load_config, merge_settings


def apply_set_options(settings: list[str], flags: dict[str, Any]) -> dict[str, Any]:
    """`--set PATH=VALUE` pairs under the named flags (a flag wins over --set for one field).
    VALUE is read as a TOML value (8, 0.5, true, "text"); anything else is a string."""
    out: dict[str, Any] = {}
    for item in settings:
        path, sep, raw = item.partition("=")
        if not sep or not path.strip():
            raise typer.BadParameter(f"--set {item!r}: expected PATH=VALUE, e.g. train.steps=100")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        try:
            put(out, path.strip().split("."), value)
        except ValueError as err:
            raise typer.BadParameter(f"--set {item!r}: {err}") from None
    return merge_settings(out, flags)


def config_fields(model: type[Any] = RunConfig, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(path, type, default, description) of every settable field, read off the config models:
    what the TOML and `--set` take."""
    from pydantic import BaseModel

    rows = []
    for name, field in model.model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            rows += config_fields(kind, f"{prefix}{name}.")
            continue
        default = field.get_default(call_default_factory=True)
        if get_origin(kind) is Literal:
            type_name = " | ".join(map(str, get_args(kind)))
        else:
            type_name = getattr(kind, "__name__", None) or str(kind).replace("typing.", "")
        shown = str(default) if isinstance(default, Path) else repr(default)
        rows.append((f"{prefix}{name}", type_name, shown, field.description or ""))
    return rows


@app.command("config")
def config_cmd(
    config: Path | None = typer.Option(
        None, "--config", "-c", help="also validate this TOML and show its values"
    ),
    as_json: bool = typer.Option(False, "--json", help="one JSON object per field"),
    advisor: bool = typer.Option(
        False,
        "--advisor",
        help="the advisor's settings instead (`meshscope advise --set`, or [advisor] in the cluster file)",
    ),
) -> None:
    """Every config field (TOML section.key, or `meshscope run --set section.key=VALUE`)."""
    if advisor:
        from meshscope.advisor.specs import AdvisorConfig

        _print_fields(config_fields(AdvisorConfig), {}, as_json, "meshscope advise settings")
        return
    values: dict[str, Any] = {}
    if config is not None:
        try:
            cfg = load_config(config)
        except ConfigError as err:
            fail(str(err))
        values = {path: repr(_get_path(cfg, path)) for path, *_ in config_fields()}
    _print_fields(config_fields(), values, as_json, "meshscope run configuration")


def _print_fields(
    fields: list[tuple[str, str, str, str]], values: dict[str, Any], as_json: bool, title: str
) -> None:
    """The fields as a table (with their values when a file was given), or JSON lines."""
    if as_json:
        for path, kind, default, description in fields:
            row = {
                "field": path,
                "type": kind,
                "default": default,
                "value": values.get(path),
                "meaning": description,
            }
            print(json.dumps(row))
        return
    table = Table(title=title)
    for column in ("field", "type", "default", *(("value",) if values else ()), "meaning"):
        table.add_column(column)
    for path, kind, default, description in fields:
        table.add_row(path, kind, default, *((values[path],) if values else ()), description)
    console.print(table)


def _get_path(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj

"""Command-line flags generated from the config models: a flag is an alias of one config field,
so its type, default (none: the TOML or the field's default applies) and help are the field's.
`RUN_FLAGS` is the alias table of `meshscope run`; every other field is reachable with `--set`."""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import typer
from pydantic import BaseModel
from pydantic.fields import FieldInfo

# where alerts go: the same flags on `meshscope run` and `meshscope stack up`
ALERT_FLAGS: dict[str, str] = {
    "view-url": "alerts.view_url",
    "slack-webhook-file": "alerts.slack_webhook_file",
    "email-to": "alerts.email_to",
    "smtp": "alerts.smtp",
    "smtp-from": "alerts.smtp_from",
    "smtp-user": "alerts.smtp_user",
    "smtp-password-file": "alerts.smtp_password_file",
    "smtp-tls": "alerts.smtp_tls",
}
# flag -> config path; the short flags users already know
RUN_FLAGS: dict[str, str] = {
    "steps": "train.steps",
    "nproc": "nproc",
    "compression": "train.compression",
    "overlap": "train.overlap",
    "device": "device",
    "backend": "backend",
    "run-dir": "runs_root",
    "run-id": "run_id",
    "metrics-port": "monitor.metrics_port",
    "store": "store",
    "store-password-file": "store_password_file",
    "linger": "linger_s",
    "inject": "inject",
    "trace": "tracer.mode",
    "checkpoint-every": "elastic.checkpoint_every",
    "max-restarts": "elastic.max_restarts",
    "nnodes": "elastic.nnodes",
    "rdzv-endpoint": "elastic.rdzv_endpoint",
    "rdzv-external": "elastic.rdzv_external",
    "alerts": "alerts.mode",
    **ALERT_FLAGS,
    "stack-home": "stack.home",
    "on-hang": "hang.on_hang",
    "hang-after": "hang.min_stall_s",
}


def field_at(model: type[BaseModel], path: str) -> FieldInfo:
    """The pydantic field at a dotted config path (KeyError naming the path otherwise)."""
    *sections, name = path.split(".")
    for section in sections:
        model = model.model_fields[section].annotation
    return model.model_fields[name]


def _flag_type(annotation: Any) -> type:
    """What the command line parses for a field; pydantic then validates the value."""
    if get_origin(annotation) in (Union, types.UnionType):
        annotation = next(a for a in get_args(annotation) if a is not type(None))
    if get_origin(annotation) is Literal:
        return str
    if get_origin(annotation) is list:
        return list[str]
    return annotation if annotation in (int, float, bool, Path) else str


def _choices(info: FieldInfo) -> str:
    """`a | b | c: ` for a Literal field whose description does not list its values already."""
    values = [str(v) for v in get_args(info.annotation)] if get_origin(info.annotation) is Literal else []
    if not values or all(v in (info.description or "") for v in values):
        return ""
    return " | ".join(values) + ": "


def flag_parameters(model: type[BaseModel], flags: dict[str, str]) -> list[inspect.Parameter]:
    """One keyword parameter per flag, each a `typer.Option` defaulting to None (not given)."""
    params = []
    for flag, path in flags.items():
        info = field_at(model, path)
        kind = _flag_type(info.annotation)
        names = [f"--{flag}/--no-{flag}"] if kind is bool else [f"--{flag}"]
        option = typer.Option(None, *names, help=_choices(info) + (info.description or ""))
        params.append(
            inspect.Parameter(
                flag.replace("-", "_"), inspect.Parameter.KEYWORD_ONLY, default=option, annotation=kind | None
            )
        )
    return params


def with_config_flags(model: type[BaseModel], flags: dict[str, str]) -> Callable[[Callable], Callable]:
    """Give a command the flags of `flags` after its own parameters; the command receives them
    as one `overrides` dict nested like the config (only the flags that were given)."""

    def wrap(command: Callable) -> Callable:
        own = [p for p in inspect.signature(command).parameters.values() if p.name != "overrides"]
        generated = flag_parameters(model, flags)
        paths = {flag.replace("-", "_"): path for flag, path in flags.items()}

        def run(**values: Any) -> Any:
            given = {paths[k]: values.pop(k) for k in list(values) if k in paths}
            return command(**values, overrides=nest({p: v for p, v in given.items() if v not in (None, [])}))

        run.__name__, run.__doc__ = command.__name__, command.__doc__
        run.__signature__ = inspect.Signature(own + generated)
        run.__annotations__ = {p.name: p.annotation for p in own + generated}
        return run

    return wrap


def put(out: dict[str, Any], path: list[str], value: Any) -> None:
    """Put `value` at `path` in nested dicts, creating sections; ValueError if one is a value."""
    node = out
    for part in path[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"{part} is not a section")
    node[path[-1]] = value


def nest(values: dict[str, Any]) -> dict[str, Any]:
    """{"train.steps": 5} -> {"train": {"steps": 5}}."""
    out: dict[str, Any] = {}
    for dotted, value in values.items():
        put(out, dotted.split("."), value)
    return out

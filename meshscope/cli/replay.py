"""`meshscope replay`: re-run a snapshot's module on the CPU."""

from __future__ import annotations

from pathlib import Path

import typer

from meshscope.cli.common import app, console, fail
from meshscope.trainer.config import ConfigError, load_config


@app.command()
def replay(
    snapshot: Path = typer.Argument(..., help="a snapshot (.json or .safetensors) a run wrote"),
    config: Path | None = typer.Option(
        None, "--config", "-c", help="the run's config (default: config.json of the run the snapshot is in)"
    ),
) -> None:
    """Re-run a snapshot's module on the CPU; exit 0 when the non-finite value comes back."""
    from meshscope.tracer.replay import replay as replay_module
    from meshscope.tracer.snapshot import SnapshotError, load_snapshot
    from meshscope.trainer.model import MoELM

    if snapshot.suffix not in (".json", ".safetensors"):
        fail(f"{snapshot}: not a snapshot (a run writes them as .json with .safetensors beside)")
    try:
        snap = load_snapshot(snapshot)
        cfg = load_config(config or _run_config_of(snapshot), own_sections=True)
        try:
            module = MoELM(cfg.model).get_submodule(snap.meta.module)
        except AttributeError:
            raise SnapshotError(f"{snapshot}: the run's model has no module {snap.meta.module!r}") from None
        result = replay_module(snap, module)
    except (SnapshotError, ConfigError) as err:
        fail(str(err))
    console.print(
        f"{snap.meta.module} ({snap.meta.module_class}), {snap.meta.where}, step "
        f"{snap.meta.step}, rank {snap.meta.rank}: {result.message}"
    )
    if result.nonfinite:
        console.print("non-finite: " + ", ".join(result.nonfinite))
    raise typer.Exit(0 if result.reproduced else 1)


def _run_config_of(snapshot: Path) -> Path:
    """`runs/<id>/snapshots/<name>.json` -> `runs/<id>/config.json`."""
    path = Path(snapshot).resolve().parent.parent / "config.json"
    if not path.exists():
        raise ConfigError(f"{snapshot}: no run config at {path}; give --config")
    return path

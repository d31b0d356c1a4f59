"""torchrun's worker entry for `meshscope run`: the reference trainer with the tensor tracer.

trainer/ does not import tracer/ (each package owns one job); this is where they meet, as the
CLI is for the launcher.
"""

from __future__ import annotations

import time

STARTED_AT = time.time()  # before the heavy imports: recovery accounting counts them

from typing import Any  # noqa: E402

import meshscope.trainer.worker  # noqa: E402
from meshscope.collector import DistEnv, Monitor  # noqa: E402
from meshscope.config import RunConfig, load_config  # noqa: E402
from meshscope.tracer.gradients import GradientInspector  # noqa: E402
from meshscope.tracer.trace import TensorTracer  # noqa: E402


def make_tracer(
    cfg: RunConfig, env: DistEnv, mon: Monitor, model: Any
) -> tuple[TensorTracer | None, GradientInspector | None]:
    """The tensor tracer on this rank's model and, on rank 0, the gradient inspector
    (gradients are all-reduced: every rank would say the same), reporting through the Monitor."""
    if cfg.tracer.mode == "off":
        return None, None

    def report(kind: str, step: int, detail: dict) -> None:
        if kind == "nan":
            mon.metrics.faults.labels(kind="nonfinite").inc()
        mon.event(kind, severity="critical" if kind == "nan" else "info", step=step, detail=detail)

    def export(module: str, grad_norm: float, update_ratio: float) -> None:
        mon.metrics.layer_grad_norm.labels(module=module).set(grad_norm)
        mon.metrics.layer_update_ratio.labels(module=module).set(update_ratio)

    mon.config.nan_events = False  # the tracer reports non-finite steps, with their module
    tracer = TensorTracer(
        model,
        cfg.tracer,
        rank=env.rank,
        snapshot_dir=cfg.run_dir / "snapshots",
        report=report,
        stats_sink=mon.store.add_tensor_stats,
    )
    inspector = None
    if env.rank == 0:
        inspector = GradientInspector(model, cfg.gradients, sink=mon.store.add_grad_stats, export=export)
    return tracer, inspector


def main(argv: list[str] | None = None) -> None:
    """Run one rank of the reference trainer with the tracer (torchrun or the zygote calls)."""
    args = meshscope.trainer.worker.parse_args(argv)
    meshscope.trainer.worker.run_worker(
        load_config(args.config), DistEnv.from_environ(), make_tracer=make_tracer
    )


if __name__ == "__main__":
    meshscope.trainer.worker.STARTED_AT = STARTED_AT  # a plain start: this process began here
    main()

"""Grafana boards as code (grafana-foundation-sdk), written to dashboards/grafana/*.json.

    .venv/bin/python -m dashboards.boards      # regenerate the committed JSON

Four boards: Training, Experts, Faults and anomalies, Debug; variables `run` and `layer`.
Every query is listed by `board_queries()`, which the e2e test runs against a real Prometheus
that scraped a real run: a panel that returns nothing fails the build.
"""

from __future__ import annotations

import json
from pathlib import Path

from grafana_foundation_sdk.builders import bargauge, dashboard, heatmap, prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import HeatmapCellLayout
from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh

from meshscope.collector.timeaccount import PRODUCTIVE
from meshscope.detectors.thresholds import Thresholds

OUT = Path(__file__).parent / "grafana" / "dashboards"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
RUN = 'run="$run"'


def _q(expr: str, legend: str = "", ref: str = "A") -> prometheus.Dataquery:
    return prometheus.Dataquery().expr(expr).legend_format(legend or "__auto").ref_id(ref)


def _ts(title: str, unit: str, *queries: prometheus.Dataquery, w: int = 12, desc: str = ""):
    panel = timeseries.Panel().title(title).unit(unit).datasource(DATASOURCE).height(8).span(w)
    if desc:
        panel = panel.description(desc)
    for q in queries:
        panel = panel.with_target(q)
    return panel


def _stat(title: str, unit: str, query: prometheus.Dataquery, w: int = 6):
    return stat.Panel().title(title).unit(unit).datasource(DATASOURCE).height(4).span(w).with_target(query)


def _base(uid: str, title: str, *, layer: bool = False) -> dashboard.Dashboard:
    board = (
        dashboard.Dashboard(title)
        .uid(uid)
        .tags(["meshscope"])
        .refresh("10s")
        .time("now-30m", "now")
        .timezone("browser")
        .with_variable(dashboard.DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
        .with_variable(
            dashboard.QueryVariable("run")
            .label("Run")
            .datasource(DATASOURCE)
            .query("label_values(meshscope_steps_total, run)")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        )
    )
    if layer:
        board = board.with_variable(
            dashboard.QueryVariable("layer")
            .label("Layer")
            .datasource(DATASOURCE)
            .query(f"label_values(meshscope_expert_load_ratio{{{RUN}}}, layer)")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .multi(True)
            .include_all(True)
        )
    return board.annotation(
        dashboard.AnnotationQuery()
        .name("Anomalies")
        .datasource(DATASOURCE)
        .enable(True)
        .icon_color("red")
        .expr(_opened("meshscope_anomalies_total{" + RUN + "}", "1m"))
    )


def _opened(counter: str, window: str) -> str:
    """PromQL for "this counter rose within `window`", per type, that also holds for a series
    first scraped above 0 (the detector's endpoint found after its first anomaly): changes()
    alone needs to see the rise, as the alert rule's `unless ... offset` branch knows."""
    return f"sum by (type) ((changes({counter}[{window}]) > 0) or ({counter} > 0 unless {counter} offset {window})) > 0"


def training() -> dashboard.Dashboard:
    """The Training board: progress, step time, tokens/s, communication, memory."""
    return (
        _base("meshscope-training", "meshscope / Training")
        .with_row(dashboard.Row("Progress"))
        .with_panel(_stat("Tokens/s", "short", _q(f"run:meshscope_tokens:rate1m{{{RUN}}}")))
        .with_panel(_stat("Steps", "short", _q(f"max(meshscope_steps_total{{{RUN}}})")))
        .with_panel(_stat("Exposed comm", "percentunit", _q(f"run:meshscope_comm_ratio:avg{{{RUN}}}")))
        .with_panel(
            _stat("Compression (raw / wire)", "x", _q(f"run:meshscope_compression:ratio_1m{{{RUN}}}"))
        )
        .with_panel(
            _ts(
                "Step time p50 / p99 per rank",
                "s",
                _q(f"run_rank:meshscope_step_duration_seconds:p50_1m{{{RUN}}}", "p50 rank {{rank}}"),
                _q(f"run_rank:meshscope_step_duration_seconds:p99_1m{{{RUN}}}", "p99 rank {{rank}}", "B"),
            )
        )
        .with_panel(
            _ts(
                "Step phases (rank)",
                "s",
                _q(f"meshscope_step_phase_seconds{{{RUN}}}", "{{phase}} rank {{rank}}"),
            )
        )
        .with_panel(_ts("Tokens/s", "short", _q(f"run:meshscope_tokens:rate1m{{{RUN}}}", "tokens/s")))
        .with_panel(
            _ts(
                "Exposed communication ratio per rank",
                "percentunit",
                _q(f"meshscope_comm_ratio{{{RUN}}}", "rank {{rank}}"),
            )
        )
        .with_panel(
            _ts(
                "Gradient bytes per second (raw vs wire)",
                "Bps",
                _q(
                    f"sum by (kind) (rate(meshscope_comm_bytes_total{{{RUN}}}[$__rate_interval]))", "{{kind}}"
                ),
            )
        )
        .with_panel(
            _ts(
                "Memory per rank",
                "bytes",
                _q(f'meshscope_memory_bytes{{{RUN},kind="rss"}}', "rss rank {{rank}}"),
                _q(f'meshscope_memory_bytes{{{RUN},kind="allocated"}}', "allocated rank {{rank}}", "B"),
            )
        )
        .with_panel(
            _ts(
                "Loss and gradient norm",
                "short",
                _q(f"avg(meshscope_loss{{{RUN}}})", "loss"),
                _q(f"avg(meshscope_grad_norm{{{RUN}}})", "grad norm", "B"),
            )
        )
    )


def experts() -> dashboard.Dashboard:
    """The Experts board: layer x expert load heatmap, imbalance, top experts."""
    sel = f'{RUN},layer=~"$layer"'
    load_heatmap = (
        heatmap.Panel()
        .title("Expert load over time (layer × expert; 1 = fair share)")
        .datasource(DATASOURCE)
        .height(10)
        .span(24)
        .calculate(False)
        .rows_frame(heatmap.RowsHeatmapOptions().layout(HeatmapCellLayout.UNKNOWN))
        .with_target(
            _q(f"max by (layer, expert) (meshscope_expert_load_ratio{{{sel}}})", "L{{layer}} E{{expert}}")
        )
    )
    top = (
        bargauge.Panel()
        .title("Top experts by share of their layer (last minute)")
        .datasource(DATASOURCE)
        .height(8)
        .span(12)
        .unit("percentunit")
        .with_target(
            _q(
                f"topk(8, run_layer_expert:meshscope_expert_load:share_1m{{{sel}}})", "L{{layer}} E{{expert}}"
            ).instant()
        )
    )
    return (
        _base("meshscope-experts", "meshscope / Experts", layer=True)
        .with_panel(load_heatmap)
        .with_panel(
            _ts(
                "Imbalance per layer (max / mean)",
                "x",
                _q(f"run_layer:meshscope_expert_imbalance:ratio{{{sel}}}", "layer {{layer}}"),
            )
        )
        .with_panel(top)
        .with_panel(
            _ts(
                "Tokens routed per expert",
                "short",
                _q(
                    f"sum by (layer, expert) (rate(meshscope_expert_tokens_total{{{sel}}}[$__rate_interval]))",
                    "L{{layer}} E{{expert}}",
                ),
                w=24,
            )
        )
    )


_ETTR = (
    f'sum(meshscope_time_seconds_total{{{RUN},bucket=~"{"|".join(PRODUCTIVE)}"}}) '
    f"/ sum(meshscope_time_seconds_total{{{RUN}}})"
)


def faults() -> dashboard.Dashboard:
    """The Faults board: restarts, recovery, dead ranks, hangs, anomalies, and where the time went."""
    return (
        _base("meshscope-faults", "meshscope / Faults and anomalies")
        .with_panel(_stat("Restarts", "short", _q(f"max(meshscope_restarts_total{{{RUN}}})")))
        .with_panel(_stat("Last recovery", "s", _q(f"max(meshscope_recovery_seconds{{{RUN}}})")))
        .with_panel(_stat("Ranks up", "short", _q(f'sum(up{{job="meshscope",{RUN}}})')))
        .with_panel(_stat("Anomalies opened", "short", _q(f"sum(meshscope_anomalies_total{{{RUN}}})")))
        .with_panel(_stat("ETTR (productive / wall)", "percentunit", _q(_ETTR)))
        .with_panel(
            _ts(
                "Where the time went (s, by bucket)",
                "s",
                _q(f"sum by (bucket) (meshscope_time_seconds_total{{{RUN}}})", "{{bucket}}"),
                desc="The job's wall time cut into goodput (compute, gradient and expert communication) "
                "and badput buckets that add up to it; the mean over ranks, from the run's store.",
            )
        )
        .with_panel(
            _ts(
                "Anomaly score per detector",
                "short",
                _q(f"meshscope_anomaly_score{{{RUN}}}", "{{detector}}"),
                desc=f"Straggler: slowest rank's compute / median (alarm at {Thresholds().straggler_ratio:g}). "
                "IsolationForest: -score (alarm at 0.8).",
            )
        )
        .with_panel(
            _ts(
                "Anomalies opened by type",
                "short",
                _q(
                    f"sum by (type) (increase(meshscope_anomalies_total{{{RUN}}}[$__rate_interval]))",
                    "{{type}}",
                ),
            )
        )
        .with_panel(
            _ts(
                "Faults by kind",
                "short",
                _q(
                    f"sum by (kind) (increase(meshscope_faults_total{{{RUN}}}[$__rate_interval]))", "{{kind}}"
                ),
            )
        )
        .with_panel(
            _ts(
                "Restarts and recovery time",
                "s",
                _q(f"max(meshscope_recovery_seconds{{{RUN}}})", "recovery s"),
                _q(f"max(meshscope_restarts_total{{{RUN}}})", "restarts", "B"),
            )
        )
    )


def _debug_panels() -> list:
    """The Debug board's panels, top to bottom."""
    return [
        _ts(
            "Steps per minute per rank (0 = hung)",
            "short",
            _q(f"increase(meshscope_steps_total{{{RUN}}}[1m])", "rank {{rank}}"),
            desc="A rank at 0 while up is stuck: in a collective if its peers are also at 0.",
        ),
        _ts(
            "Heartbeat age per peer",
            "s",
            _q(f"max by (peer) (meshscope_heartbeat_age_seconds{{{RUN}}})", "peer {{peer}}"),
        ),
        _ts(
            "Non-finite losses",
            "short",
            _q(
                f'increase(meshscope_faults_total{{{RUN},kind="nonfinite"}}[$__rate_interval])',
                "rank {{rank}}",
            ),
        ),
        _ts(
            "Hangs and dead ranks",
            "short",
            _q(
                f'increase(meshscope_faults_total{{{RUN},kind=~"hang|dead_rank"}}[$__rate_interval])',
                "{{kind}} rank {{rank}}",
            ),
        ),
        _ts(
            "Compute per rank vs the median",
            "x",
            _q(f"run_rank:meshscope_compute_vs_median:ratio{{{RUN}}}", "rank {{rank}}"),
        ),
        _ts(
            "Slowest step (max over ranks)",
            "s",
            _q(f"max(run_rank:meshscope_step_duration_seconds:p99_1m{{{RUN}}})", "p99"),
        ),
        _ts(
            "Gradient norm per layer",
            "short",
            _q(f"max by (module) (meshscope_layer_grad_norm{{{RUN}}})", "{{module}}"),
            desc="Sampled steps, before clipping. A layer 100x above its usual "
            "norm is a gradient_exploding anomaly, 1000x below "
            "gradient_vanishing (events in the run store).",
        ),
        _ts(
            "Update / weight ratio per layer",
            "short",
            _q(f"max by (module) (meshscope_layer_update_ratio{{{RUN}}})", "{{module}}"),
            desc="Norm of the optimizer's update over the weights' norm; around "
            "1e-3 is healthy, far below: the layer has stopped learning.",
        ),
    ]


def debug() -> dashboard.Dashboard:
    """The Debug board: anomaly scores, non-finite values, gradients per layer."""
    board = _base("meshscope-debug", "meshscope / Debug")
    for panel in _debug_panels():
        board = board.with_panel(panel)
    return board


BOARDS = {"training": training, "experts": experts, "faults": faults, "debug": debug}


def build_all() -> dict[str, dict]:
    """Board name -> Grafana dashboard JSON (a plain dict)."""
    return {
        name: json.loads(JSONEncoder(sort_keys=True).encode(make().build())) for name, make in BOARDS.items()
    }


def render(board: dict) -> str:
    """A board as the committed JSON text."""
    return json.dumps(board, indent=2, sort_keys=True) + "\n"


def board_queries(board: dict) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and annotation of a board."""
    out = [
        (f"annotation {a['name']}", a["expr"])
        for a in board.get("annotations", {}).get("list", [])
        if a.get("expr")
    ]
    for panel in board.get("panels", []):
        for target in panel.get("targets", []):
            out.append((f"panel {panel.get('title')!r} {target.get('refId')}", target["expr"]))
    out += [
        (f"variable {v['name']}", v["query"] if isinstance(v["query"], str) else v["query"]["query"])
        for v in board.get("templating", {}).get("list", [])
        if v.get("type") == "query"
    ]
    return out


def write_all(folder: Path = OUT) -> list[Path]:
    """Write every board's JSON into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, board in build_all().items():
        path = folder / f"{name}.json"
        path.write_text(render(board))
        paths.append(path)
    return paths


if __name__ == "__main__":
    for p in write_all():
        print(p)

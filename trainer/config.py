"""Typed configuration of a training run: TOML file, then flags, validated once.

A bad value raises `ConfigError` whose message names the field (e.g. `train.steps`).
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from meshscope.collector.exporter import split_host_port
from meshscope.collector.monitor_config import MonitorSettings
from meshscope.collector.storedb import StoreTarget, StoreTargetError, check_url, job_schema

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

Compression = Literal["none", "fp16", "powersgd", "onebit", "onebit_adam"]
DeviceKind = Literal["auto", "cpu", "cuda", "npu", "sim"]
BackendKind = Literal["auto", "gloo", "nccl", "hccl", "simnccl", "simhccl"]


_Model = TypeVar("_Model", bound=BaseModel)


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the field."""


class _Strict(BaseModel):
    """Every config section refuses unknown keys and re-validates on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Strict):
    """The MoE transformer language model."""

    vocab_size: int = Field(128, gt=1, le=1 << 24, description="tokens in the vocabulary")
    seq_len: int = Field(32, gt=1, le=1 << 20, description="tokens per sequence")
    layers: int = Field(2, gt=0, le=1024, description="transformer blocks, each with an MoE feed-forward")
    d_model: int = Field(64, gt=0, le=1 << 16, description="hidden size")
    heads: int = Field(4, gt=0, le=1024, description="attention heads; must divide d_model")
    experts: int = Field(4, gt=0, le=4096, description="experts per MoE layer")
    top_k: int = Field(2, gt=0, le=64, description="experts each token is routed to")
    capacity_factor: float = Field(1.25, gt=0, description="expert capacity = factor x fair share")
    ffn_mult: int = Field(2, gt=0, le=64, description="expert hidden size = ffn_mult x d_model")
    aux_loss_coef: float = Field(0.01, ge=0, description="weight of the load-balancing loss")
    router_skew: float = Field(
        0.0,
        ge=0,
        le=20,
        description="logit added to expert 0 in every "
        "router: a router that prefers one expert, for experiments",
    )
    z_loss_coef: float = Field(0.001, ge=0, description="weight of the router z-loss")

    @model_validator(mode="after")
    def _shapes(self) -> ModelConfig:
        if self.d_model % self.heads:
            raise ValueError(f"model.heads: {self.heads} does not divide d_model={self.d_model}")
        if self.top_k > self.experts:
            raise ValueError(f"model.top_k: {self.top_k} exceeds experts={self.experts}")
        return self


class TrainConfig(_Strict):
    """The optimisation and its communication."""

    steps: int = Field(50, gt=0, le=10**9, description="optimizer steps")
    batch_size: int = Field(8, gt=0, le=1 << 20, description="sequences per rank per step")
    lr: float = Field(3e-3, gt=0, description="AdamW learning rate")
    seed: int = Field(0, ge=0, le=2**63 - 1, description="seed of model init and data")
    compression: Compression = Field("none", description="gradient compression hook")
    powersgd_rank: int = Field(4, gt=0, le=1024, description="matrix approximation rank of PowerSGD")
    compression_warmup: int = Field(
        0,
        ge=0,
        le=10**9,
        description="steps of plain all-reduce before powersgd/onebit compress; for onebit_adam "
        "the full-precision Adam warm-up that learns the variance (0: a tenth of steps)",
    )
    overlap: bool = Field(True, description="bucketed all-reduce overlapping backward")
    bucket_cap_mb: float = Field(1.0, gt=0, le=65536, description="DDP bucket size when overlapping")
    grad_clip: float = Field(1.0, gt=0, description="max global gradient norm")
    hierarchical: bool = Field(
        False,
        description="two-level all-reduce: reduce-scatter inside each node, all-reduce of each "
        "shard across nodes, all-gather inside; compression none|fp16 then applies to the "
        "inter-node hop only",
    )

    @model_validator(mode="after")
    def _hierarchy(self) -> TrainConfig:
        if self.hierarchical and self.compression not in ("none", "fp16"):
            raise ValueError(
                f"hierarchical: compresses the inter-node hop with none or fp16, not {self.compression}"
            )
        return self


class ParallelConfig(_Strict):
    """How the model is laid over the ranks, beyond data parallelism."""

    ep: int = Field(
        1,
        gt=0,
        description="expert parallelism: each MoE layer's experts sharded over groups of ep ranks "
        "inside a node (exchanged by all-to-all); must divide nproc and model.experts",
    )
    dispatch: Literal["capacity", "dropless"] = Field(
        "capacity",
        description="under expert parallelism: capacity (static slot tables, even all-to-all "
        "splits, no host read; tokens over capacity are dropped) or dropless (every token, "
        "uneven splits read on the host once per layer, as Megatron's all-to-all dispatcher)",
    )
    replace_threshold: float = Field(
        0.0,
        ge=0,
        description="live expert re-placement: when a rank's experts carry this many times the "
        "mean per-rank load, move experts to balance it (0 = never; e.g. 1.3)",
    )
    replace_cooldown: int = Field(
        50, gt=0, le=10**9, description="steps between two re-placements of a layer"
    )

    @model_validator(mode="after")
    def _dropless_needs_experts_apart(self) -> ParallelConfig:
        if self.dispatch == "dropless" and self.ep == 1:
            raise ValueError("dispatch: dropless exchanges tokens between expert shards; set ep > 1 too")
        if self.replace_threshold and self.ep == 1:
            raise ValueError("replace_threshold: re-placement moves experts between ranks; set ep > 1 too")
        if 0 < self.replace_threshold <= 1:
            raise ValueError(
                f"replace_threshold: {self.replace_threshold} is a max/mean ratio, above 1 (or 0: off)"
            )
        return self


class ElasticConfig(_Strict):
    """Surviving failures: checkpoints, restarts, heartbeats, membership."""

    checkpoint_every: int = Field(0, ge=0, le=10**9, description="checkpoint every N steps (0 = never)")
    keep: int = Field(3, gt=0, le=10_000, description="checkpoints kept")
    async_checkpoint: bool = Field(True, description="write checkpoints in the background")
    settle_checkpoint_s: float = Field(
        10.0,
        ge=0,
        le=3600,
        description="a worker failing with a background checkpoint in flight waits this long "
        "for it to become visible, so the restart does not lose those steps",
    )
    max_restarts: int = Field(0, ge=0, le=10_000, description="torchrun restarts after a failure")
    heartbeat_s: float = Field(1.0, gt=0, le=3600, description="heartbeat interval")
    nnodes: str = Field("1", pattern=r"^\d+(:\d+)?$", description="torchrun --nnodes, MIN[:MAX]")
    rdzv_endpoint: str = Field("", description="c10d rendezvous host:port for several agents")
    rdzv_id: str = Field("", description="rendezvous id shared by the agents (default: run id)")
    last_call_s: float = Field(
        3.0, gt=0, le=3600, description="after MIN agents joined, wait this long for more (rendezvous)"
    )
    warm_standby: bool = Field(
        True, description="fork workers from a pre-imported zygote: restarts skip ~4 s of imports"
    )
    rdzv_external: bool = Field(
        False,
        description="the rendezvous store is hosted elsewhere (`meshscope rendezvous`), "
        "so the job outlives any one agent",
    )

    @field_validator("rdzv_endpoint")
    @classmethod
    def _endpoint(cls, value: str) -> str:
        if value and split_host_port(value) is None:
            raise ValueError(f"{value!r}: expected HOST:PORT with a port 1-65535")
        return value

    @field_validator("nnodes")
    @classmethod
    def _node_range(cls, value: str) -> str:
        low, _, high = value.partition(":")
        if int(low) < 1 or (high and int(high) < int(low)):
            raise ValueError(f"{value!r} needs 1 <= MIN <= MAX")
        return value


# Faults that only a device with a stream can have, and the devices that can inject them.
DEVICE_ONLY_FAULTS = {"stream_hang": ("sim",)}


class TrainerConfig(_Strict):
    """Everything the reference trainer needs; `meshscope.config.RunConfig` adds the sections
    of what runs beside it (alerts, hang watchdog, detection)."""

    run_id: str = Field("", description="defaults to a timestamp")
    runs_root: Path = Field(Path("runs"), description="runs are created under this folder")
    device: DeviceKind = Field(
        "auto",
        description="auto = npu, else cuda, else cpu; sim = a simulated accelerator on the CPU "
        "(NCCL/HCCL semantics: asynchronous stream, events, enqueue-time futures)",
    )
    backend: BackendKind = Field(
        "auto",
        description="collective backend: auto = the device's (hccl, nccl, gloo); "
        "gloo lets several ranks share one accelerator",
    )
    nproc: int = Field(4, gt=0, le=1024, description="worker processes on this node")
    store: str = Field(
        "",
        description="where the ranks write: empty = SQLite in the run directory (one node); "
        "postgresql://user@host:port/db = one job store every node writes (a schema per job)",
    )
    store_password_file: str = Field(
        "", description="file holding the job store's password (never put it in the URL)"
    )
    control_every: int = Field(
        10,
        gt=0,
        le=10**6,
        description="read approved changes (router bias, aux-loss coefficient, capacity) every N steps",
    )
    linger_s: float = Field(
        0.0, ge=0, le=86_400, description="keep /metrics up this long after the last step"
    )
    audit_syncs: bool = Field(
        False,
        description="count every host read of a tensor value in the steps by call site "
        "(<run>/sync_audit/rank<R>.json): unmarked ones are syncs nobody owns",
    )
    inject: list[str] = Field(
        default_factory=list, description="faults to inject: KIND@step=S,rank=R[,steps=N][,k=v]"
    )
    monitor: MonitorSettings = Field(default_factory=MonitorSettings)
    model: ModelConfig = Field(default_factory=ModelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    elastic: ElasticConfig = Field(default_factory=ElasticConfig)

    @model_validator(mode="after")
    def _ports(self) -> TrainerConfig:
        port = self.monitor.metrics_port
        if port is None:  # the launcher's targets.json and the sidecar's scrapes need the ranks' ports
            raise ValueError("monitor.metrics_port: the trainer's ranks serve /metrics; give a base port")
        if port + self.nproc - 1 > 65535:  # rank r serves on base + r
            raise ValueError(
                f"monitor.metrics_port: {port} + {self.nproc} ranks runs past port 65535 "
                "(fewer nproc, or a lower --metrics-port)"
            )
        return self

    @model_validator(mode="after")
    def _expert_parallel(self) -> TrainerConfig:
        ep = self.parallel.ep
        if ep > 1 and self.train.compression == "onebit_adam":
            raise ValueError(
                "train.compression: onebit_adam averages every momentum over all ranks; with "
                "parallel.ep > 1 the experts' are not replicated there (not supported yet)"
            )
        if ep > 1 and self.nproc % ep:  # EP groups stay inside a node: any node count then fits
            raise ValueError(f"parallel.ep: {ep} does not divide nproc {self.nproc} (the ranks of a node)")
        if self.model.experts % ep:
            raise ValueError(f"parallel.ep: {ep} does not divide model.experts {self.model.experts}")
        return self

    @model_validator(mode="after")
    def _injections(self) -> TrainerConfig:
        from meshscope.trainer.inject import (
            InjectionError,
            check_against_model,
            check_expert_holders,
            parse_injection,
        )

        injections = []
        for spec in self.inject:
            try:
                injection = parse_injection(spec)
            except InjectionError as err:
                raise ValueError(f"inject: {err}") from None
            if injection.kind in DEVICE_ONLY_FAULTS and self.device not in DEVICE_ONLY_FAULTS[injection.kind]:
                raise ValueError(
                    f"inject: {spec!r} needs --device {' or '.join(DEVICE_ONLY_FAULTS[injection.kind])} "
                    f"(a device stream to stop), not {self.device}"
                )
            injections.append(injection)
        if injections:  # against the model itself: a wrong path fails here, not in the workers
            import torch

            from meshscope.trainer.model import MoELM

            with torch.device("meta"):  # the shapes alone: no memory, no initialisation cost
                model = MoELM(self.model)
            world = self.nproc * int(self.elastic.nnodes.rpartition(":")[2])
            try:
                check_against_model(injections, model, world)
                check_expert_holders(injections, self.model.experts, self.parallel.ep)
            except InjectionError as err:
                raise ValueError(f"inject: {err}") from None
        return self

    @field_validator("store_password_file")
    @classmethod
    def _password_file(cls, value: str) -> str:
        """An absolute path to a file this process can read: the workers start elsewhere (and
        a relative path printed on one node means nothing on another)."""
        if not value:
            return value
        path = Path(value).expanduser().resolve()
        try:
            path.read_bytes()
        except OSError as err:
            raise ValueError(f"{value} is not a readable file ({err.strerror})") from None
        return str(path)

    @model_validator(mode="after")
    def _job_store(self) -> TrainerConfig:
        if self.store:
            try:
                check_url(self.store)
            except StoreTargetError as err:
                raise ValueError(f"store: {err}") from None
        if self.store_password_file:
            if not self.store:
                raise ValueError("store_password_file: names a password for no store (set store too)")
        return self

    @property
    def store_target(self) -> StoreTarget:
        """The database this run's ranks write (SQLite in the run directory, or the job store)."""
        if not self.store:
            return StoreTarget()
        return StoreTarget(self.store, job_schema(self.run_id), self.store_password_file)

    @property
    def job_id(self) -> str:
        """The job's one id, shared by its agents: it scopes every key meshscope puts in a store."""
        return self.elastic.rdzv_id or self.run_id

    @property
    def multi_node(self) -> bool:
        """Agents on several machines meet through a rendezvous (not one standalone agent)."""
        return self.elastic.nnodes != "1" or bool(self.elastic.rdzv_endpoint)

    @property
    def run_dir(self) -> Path:
        """This run's directory: `runs_root/run_id`."""
        return self.runs_root / self.run_id


def _field_path(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc if not str(p).startswith("function-after"))


def _raise_config_error(err: ValidationError, source: str) -> None:
    first = err.errors()[0]
    msg = first["msg"].removeprefix("Value error, ")
    field = _field_path(first["loc"])
    raise ConfigError(f"{source}: {field + ': ' if field else ''}{msg}") from None


def merge_settings(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`base` with `over` laid on top, section by section (nested dicts merge, values replace)."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_settings(out[key], value)
        else:
            out[key] = value
    return out


# Keys that moved (into a section, or to another), read where they are now: configs written before
# (a recorded run's config.json, an older TOML) keep working. Old key -> its path now.
MOVED = {
    "metrics_port": "monitor.metrics_port",
    "metrics_host": "monitor.metrics_host",
    "metrics_labels": "monitor.metrics_labels",
    "expert_every": "monitor.expert_every",
    "comm_sample_every": "monitor.comm_sample_every",
    "trace": "tracer.mode",
    "alerts.stack_home": "stack.home",
}


def moved_into_sections(data: dict[str, Any]) -> dict[str, Any]:
    """`data` with each old key of `MOVED` put at its path now (a value already at the new
    path wins)."""
    out = copy.deepcopy(data)  # the caller's dict stays as it was
    for old, new in MOVED.items():
        *where, name = old.split(".")
        holder = _section(out, where)
        if holder is None or name not in holder:
            continue
        value = holder.pop(name)
        *into, key = new.split(".")
        target = out
        for part in into:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                break
        else:
            target.setdefault(key, value)
    return out


def _section(data: dict[str, Any], path: list[str]) -> dict[str, Any] | None:
    """The nested dict at `path` of `data` (None when there is none)."""
    for part in path:
        data = data.get(part)
        if not isinstance(data, dict):
            return None
    return data


def load_config(
    path: Path | None = None,
    overrides: dict[str, Any] | None = None,
    model: type[_Model] | None = None,
    own_sections: bool = False,
) -> _Model:
    """Read a TOML (or JSON) file, apply flag overrides, validate as `model` (default
    `TrainerConfig`); ConfigError names the field. `own_sections`: keep only the model's own
    keys of a run's full config.json (the trainer ignores the sidecar's sections)."""
    model = model or TrainerConfig
    data: dict[str, Any] = {}
    source = "flags"
    if path is not None:
        source = str(path)
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as err:
            raise ConfigError(f"{path}: cannot read config ({err.strerror})") from None
        except UnicodeDecodeError as err:
            raise ConfigError(
                f"{path}: not UTF-8 text (byte {err.object[err.start]:#04x} at offset {err.start})"
            ) from None
        try:
            data = json.loads(text) if str(path).endswith(".json") else tomllib.loads(text)
        except (tomllib.TOMLDecodeError, json.JSONDecodeError) as err:
            raise ConfigError(f"{path}: not valid TOML/JSON: {err}") from None
    try:
        data = merge_settings(moved_into_sections(data), moved_into_sections(overrides or {}))
        if own_sections:
            data = {k: v for k, v in data.items() if k in model.model_fields}
        return model.model_validate(data)
    except ValidationError as err:
        _raise_config_error(err, source)
        raise  # unreachable

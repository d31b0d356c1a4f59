"""What the advisor is asked about, validated: the model (`--model M.toml`), the cluster
(`--cluster C.toml`) and the search's own settings. Each loader names the field it rejects, so
`meshscope advise` exits 2 with it before any search starts."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

GIB = 1024**3


class SpecError(ValueError):
    """A model, cluster or advisor file (or --set) that cannot be used; the text names the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(_Strict):
    """A transformer LM, dense or MoE, as far as its cost depends on it."""

    name: str = Field("model", description="shown in the output")
    layers: int = Field(..., gt=0, description="transformer blocks")
    hidden: int = Field(..., gt=0, description="hidden size h")
    heads: int = Field(..., gt=0, description="attention heads a")
    kv_heads: int = Field(0, ge=0, description="key/value heads (0 = heads; fewer: grouped-query)")
    ffn_hidden: int = Field(0, ge=0, description="dense feed-forward hidden size (0 = 4 x hidden)")
    ffn_matrices: Literal[2, 3] = Field(2, description="2: GELU MLP, 3: SwiGLU")
    vocab: int = Field(..., gt=1, description="vocabulary size")
    seq_len: int = Field(..., gt=1, description="tokens per sequence s")
    global_batch: int = Field(..., gt=0, description="sequences per optimizer step, all devices")
    tied_embeddings: bool = Field(True, description="output head shares the embedding")
    experts: int = Field(0, ge=0, description="routed experts per MoE layer (0 = dense model)")
    top_k: int = Field(1, gt=0, description="experts each token is routed to")
    moe_ffn_hidden: int = Field(0, ge=0, description="expert hidden size (0 = ffn_hidden)")
    shared_experts: int = Field(0, ge=0, description="always-on experts per MoE layer")
    dense_layers: int = Field(0, ge=0, description="leading blocks with a dense feed-forward")
    capacity_factor: float = Field(1.0, gt=0, description="expert slots per fair share (1 = dropless)")
    dispatch: Literal["capacity", "dropless"] = Field(
        "capacity",
        description="capacity: tokens over an expert's slots are dropped; dropless: every token is "
        "computed, grouped per expert (priced by the dropless_compute_scale factor)",
    )
    expert_skew: float = Field(1.0, ge=1.0, description="max/mean tokens per expert (1 = balanced)")
    precision: Literal["bf16", "fp32"] = Field("bf16", description="bf16: mixed precision, fp32: all fp32")

    @model_validator(mode="after")
    def _shapes(self) -> ModelSpec:
        if self.hidden % self.heads:
            raise ValueError(f"heads ({self.heads}) must divide hidden ({self.hidden})")
        if self.kv_heads and self.heads % self.kv_heads:
            raise ValueError(f"kv_heads ({self.kv_heads}) must divide heads ({self.heads})")
        if self.experts and self.top_k > self.experts:
            raise ValueError(f"top_k ({self.top_k}) exceeds experts ({self.experts})")
        if self.dense_layers > self.layers:
            raise ValueError(f"dense_layers ({self.dense_layers}) exceeds layers ({self.layers})")
        return self

    @property
    def ffn(self) -> int:
        """The dense feed-forward's hidden size."""
        return self.ffn_hidden or 4 * self.hidden

    @property
    def expert_ffn(self) -> int:
        """One expert's hidden size."""
        return self.moe_ffn_hidden or self.ffn

    @property
    def moe_layers(self) -> int:
        """Blocks whose feed-forward is a mixture of experts."""
        return self.layers - self.dense_layers if self.experts else 0


class Link(_Strict):
    """One level of the interconnect, per device: what one device can send at once."""

    name: str = Field(..., description="e.g. HCCS, NVLink, PCIe, RoCE, IB, loopback")
    bandwidth_gbs: float = Field(..., gt=0, description="GB/s per device, one direction")
    latency_us: float = Field(5.0, ge=0, description="per message step")


class DeviceSpec(_Strict):
    """One accelerator (or CPU rank): its peak and its memory."""

    name: str = Field(..., description="e.g. Ascend 910B, H100 SXM")
    peak_tflops: float = Field(..., gt=0, description="dense matmul peak at the model's precision")
    memory_gib: float = Field(..., gt=0, description="device memory")
    memory_bandwidth_gbs: float = Field(1000.0, gt=0, description="what the optimizer step streams through")
    reserved_gib: float = Field(1.0, ge=0, description="framework, workspace and fragmentation")


class ClusterSpec(_Strict):
    """Nodes of identical devices: one link inside a node, one between nodes."""

    name: str = Field("cluster", description="shown in the output")
    backend: str = Field("nccl", description="hccl, nccl or gloo: which calibrations apply")
    nodes: int = Field(..., gt=0, description="nodes")
    devices_per_node: int = Field(..., gt=0, description="devices (ranks) per node")
    device: DeviceSpec
    intra: Link = Field(..., description="inside a node, or inside a device group (HCCS, NVLink, loopback)")
    inter: Link = Field(..., description="between nodes (RoCE, IB); per device")
    devices_per_group: int = Field(
        0, ge=0, description="devices joined by the intra link when a node has several groups (0 = all)"
    )
    pcie: Link | None = Field(
        None, description="between a node's device groups (PCIe), with devices_per_group"
    )

    @model_validator(mode="after")
    def _groups(self) -> ClusterSpec:
        if self.devices_per_group:
            if self.devices_per_node % self.devices_per_group:
                group, node = self.devices_per_group, self.devices_per_node
                raise ValueError(f"devices_per_group ({group}) must divide devices_per_node ({node})")
            if self.pcie is None and self.devices_per_group < self.devices_per_node:
                raise ValueError("devices_per_group needs a [cluster.pcie] link between the groups")
        return self

    @property
    def devices(self) -> int:
        """All devices of the cluster."""
        return self.nodes * self.devices_per_node


Goal = Literal["throughput", "memory"]


class AdvisorConfig(_Strict):
    """The search's own settings (`--set`, `meshscope advise --help`)."""

    goal: Goal = Field("throughput", description="rank by step time, or by peak memory per device")
    max_comm_ratio: float = Field(
        0.25, gt=0, le=1, description="exposed communication / step time above which a layout is excluded"
    )
    memory_headroom: float = Field(
        0.9, gt=0, le=1, description="share of device memory a layout may plan to use"
    )
    max_tp: int = Field(8, gt=0, description="largest tensor-parallel group (kept inside a node)")
    max_cp: int = Field(8, gt=0, description="largest context-parallel group")
    micro_batches: tuple[int, ...] = Field((1, 2, 4, 8), description="micro-batch sizes tried")
    top: int = Field(10, gt=0, description="layouts printed")


_Spec = TypeVar("_Spec", bound=BaseModel)


def _fields(err: ValidationError) -> str:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"] if not str(p).startswith("function-after"))
    return f"{where + ': ' if where else ''}{first['msg'].removeprefix('Value error, ')}"


def validate(kind: type[_Spec], data: dict[str, Any], source: str) -> _Spec:
    """`data` as a `kind`, or SpecError naming `source` and the field."""
    try:
        return kind.model_validate(data)
    except ValidationError as err:
        raise SpecError(f"{source}: {_fields(err)}") from None


def read_toml(path: Path) -> dict[str, Any]:
    """A TOML file's table, or SpecError saying why it cannot be read."""
    try:
        return tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as err:
        raise SpecError(f"{path}: cannot read ({err.strerror})") from None
    except UnicodeDecodeError:
        raise SpecError(f"{path}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as err:
        raise SpecError(f"{path}: not valid TOML: {err}") from None


EXAMPLES = Path(__file__).resolve().parent / "examples"


def examples(section: str) -> dict[str, Path]:
    """The bundled example files whose table is `section` ("model" or "cluster"), by name."""
    return {p.stem: p for p in sorted(EXAMPLES.glob("*.toml")) if section in read_toml(p)}


def _resolve(path: Path | str, section: str) -> Path:
    """A file path as given, or the name of a bundled example (`h100`, `moe-128e`)."""
    path = Path(path)
    if path.exists() or path.suffix:
        return path
    return examples(section).get(str(path), path)


def load_model(path: Path | str) -> ModelSpec:
    """A model file (its fields at the top level or under [model]) or a bundled model's name."""
    path = _resolve(path, "model")
    data = read_toml(path)
    return validate(ModelSpec, data.get("model", data), str(path))


def load_settings(cluster_path: Path | str, overrides: dict[str, Any]) -> AdvisorConfig:
    """The search's settings: the cluster file's [advisor] table, then `overrides` (--set)."""
    path = _resolve(cluster_path, "cluster")
    table = read_toml(path).get("advisor", {})
    merged = {**(table if isinstance(table, dict) else {}), **overrides}
    return validate(AdvisorConfig, merged, f"{path} (advisor table) / --set" if table else "--set")


def load_cluster(path: Path | str) -> ClusterSpec:
    """A cluster file (its fields at the top level or under [cluster]) or a bundled cluster's name."""
    path = _resolve(path, "cluster")
    data = read_toml(path)
    return validate(
        ClusterSpec, data.get("cluster", {k: v for k, v in data.items() if k != "advisor"}), str(path)
    )

"""Snapshots: one module's tensors at the moment something went wrong, loadable without pickle.

A snapshot is two files side by side: `<name>.safetensors` (inputs, outputs, the module's own
parameters, gradients, the CPU RNG state) and `<name>.json` (module path and class, forward or
backward, which tensor went non-finite, step, rank, and how the module was called). safetensors
holds raw tensors only: loading one runs no code, and a malformed or hostile file is refused
with a `SnapshotError` that says what is wrong.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

FORMAT = "meshscope-snapshot/1"
MAX_BYTES = 2 << 30  # a snapshot is one module's tensors: larger files are refused
_NAME = re.compile(r"^(input|output|param|grad_input|grad_output)\.[A-Za-z0-9_.]+$|^rng\.cpu$")


class SnapshotError(ValueError):
    """A snapshot that cannot be used; the message says which file and why."""


class ArgSpec(BaseModel):
    """One positional argument of the module call: a stored tensor or a plain JSON value."""

    model_config = ConfigDict(extra="forbid")
    tensor: str | None = Field(None, description="name of the tensor in the safetensors file")
    value: bool | int | float | str | None = Field(None, description="a non-tensor argument")


class SnapshotMeta(BaseModel):
    """The JSON half of a snapshot."""

    model_config = ConfigDict(extra="forbid")
    format: Literal["meshscope-snapshot/1"]
    module: str = Field(description="dotted path of the module in the model")
    module_class: str
    where: Literal["forward", "backward"]
    tensor: Literal["input", "output", "parameter", "gradient"]
    step: int
    rank: int
    args: list[ArgSpec]
    note: str = ""


@dataclass
class Snapshot:
    """A loaded snapshot: its metadata and tensors (all on the CPU)."""

    meta: SnapshotMeta
    tensors: dict[str, torch.Tensor]
    path: Path

    def group(self, prefix: str) -> list[torch.Tensor]:
        """input/output/grad_* tensors in their original order."""
        items = [
            (int(k.split(".", 1)[1]), v)
            for k, v in self.tensors.items()
            if k.startswith(prefix + ".") and k.split(".", 1)[1].isdigit()
        ]
        return [v for _, v in sorted(items)]

    def params(self) -> dict[str, torch.Tensor]:
        """The module's parameters, by name."""
        return {k.split(".", 1)[1]: v for k, v in self.tensors.items() if k.startswith("param.")}


def _tensors(values: Any) -> list[torch.Tensor]:
    if isinstance(values, torch.Tensor):
        return [values]
    if isinstance(values, (list, tuple)):
        return [v for v in values if isinstance(v, torch.Tensor)]
    return []


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True).contiguous()


def write_snapshot(
    folder: Path,
    *,
    module_path: str,
    module: torch.nn.Module,
    where: str,
    tensor: str,
    step: int,
    rank: int,
    args: tuple,
    outputs: Any,
    grad_input: Any = None,
    grad_output: Any = None,
    note: str = "",
) -> Path:
    """Write a snapshot; returns the path of its JSON half."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    name = f"step{step}-rank{rank}-{module_path or 'model'}-{where}"
    tensors: dict[str, torch.Tensor] = {"rng.cpu": torch.get_rng_state()}
    specs = []
    for i, arg in enumerate(args):
        if isinstance(arg, torch.Tensor):
            tensors[f"input.{i}"] = _cpu(arg)
            specs.append(ArgSpec(tensor=f"input.{i}"))
        elif arg is None or isinstance(arg, (bool, int, float, str)):
            specs.append(ArgSpec(value=arg))
        else:
            specs.append(ArgSpec(value=None))
            note += f" (argument {i} of type {type(arg).__name__} not stored)"
    for i, t in enumerate(_tensors(outputs)):
        tensors[f"output.{i}"] = _cpu(t)
    for pname, p in module.named_parameters(recurse=True):
        tensors[f"param.{pname}"] = _cpu(p)
    for prefix, values in (("grad_input", grad_input), ("grad_output", grad_output)):
        for i, t in enumerate(values or ()):
            if isinstance(t, torch.Tensor):
                tensors[f"{prefix}.{i}"] = _cpu(t)
    meta = SnapshotMeta(
        format=FORMAT,
        module=module_path,
        module_class=f"{type(module).__module__}.{type(module).__qualname__}",
        where=where,
        tensor=tensor,
        step=step,
        rank=rank,
        args=specs,
        note=note.strip(),
    )
    tmp = folder / f"{name}.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": FORMAT})
    tmp.replace(folder / f"{name}.safetensors")
    (folder / f"{name}.json").write_text(meta.model_dump_json(indent=2))
    return folder / f"{name}.json"


def load_snapshot(path: Path) -> Snapshot:
    """Load and check a snapshot (either half's path); SnapshotError when it cannot be used."""
    path = Path(path)
    meta_path = path.with_suffix(".json")
    data_path = path.with_suffix(".safetensors")
    try:
        raw = meta_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise SnapshotError(f"{meta_path}: cannot read the snapshot's metadata ({err})") from None
    try:
        meta = SnapshotMeta.model_validate_json(raw)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise SnapshotError(
            f"{meta_path}: not a meshscope snapshot ({where + ': ' if where else ''}{first['msg']})"
        ) from None
    try:
        size = data_path.stat().st_size
    except OSError as err:
        raise SnapshotError(f"{data_path}: missing ({err.strerror})") from None
    if size > MAX_BYTES:
        raise SnapshotError(f"{data_path}: {size} bytes, more than a snapshot may hold")
    try:
        tensors = load_file(str(data_path), device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise SnapshotError(f"{data_path}: not a valid safetensors file ({err})") from None
    bad = sorted(k for k in tensors if not _NAME.match(k))
    if bad:
        raise SnapshotError(f"{data_path}: unexpected tensors {bad[:5]}")
    for spec in meta.args:
        if spec.tensor is not None and spec.tensor not in tensors:
            raise SnapshotError(f"{meta_path}: argument tensor {spec.tensor!r} is not in {data_path.name}")
    return Snapshot(meta, tensors, meta_path)


def snapshot_args(snap: Snapshot) -> list[Any]:
    """The module call's positional arguments, rebuilt from the snapshot."""
    return [snap.tensors[s.tensor] if s.tensor is not None else s.value for s in snap.meta.args]

"""How the flight log describes a `torch.distributed` call: where each function keeps its
tensors, group and peer, the split sizes of an all-to-all, and the user's line that called it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch


def arg_of(args: tuple, kwargs: dict, index: int, name: str) -> Any:
    """A call's argument by keyword, else by position (None when not given)."""
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else None


def tensors_of(value: Any) -> list[torch.Tensor]:
    """The tensors in an argument (one, or a list of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for t in value if isinstance(t, torch.Tensor)]
    return []


@dataclass(frozen=True)
class Op:
    """Where a torch.distributed function keeps its tensors, group and peer."""

    tensors: tuple[tuple[int, str], ...]
    group: tuple[int, str]
    peer: tuple[int, str] | None = None
    p2p: bool = False
    splits: bool = False


OPS: dict[str, Op] = {
    "all_reduce": Op(((0, "tensor"),), (2, "group")),
    "broadcast": Op(((0, "tensor"),), (2, "group"), peer=(1, "src")),
    "reduce": Op(((0, "tensor"),), (3, "group"), peer=(1, "dst")),
    "all_gather": Op(((1, "tensor"),), (2, "group")),
    "all_gather_into_tensor": Op(((1, "input_tensor"),), (2, "group")),
    "reduce_scatter": Op(((1, "input_list"),), (3, "group")),
    "reduce_scatter_tensor": Op(((1, "input"),), (3, "group")),
    "all_to_all": Op(((1, "input_tensor_list"),), (2, "group")),
    "all_to_all_single": Op(((1, "input"),), (4, "group"), splits=True),
    "gather": Op(((0, "tensor"),), (3, "group"), peer=(2, "dst")),
    "scatter": Op(((0, "tensor"),), (3, "group"), peer=(2, "src")),
    "barrier": Op((), (0, "group")),
    "send": Op(((0, "tensor"),), (2, "group"), peer=(1, "dst"), p2p=True),
    "recv": Op(((0, "tensor"),), (2, "group"), peer=(1, "src"), p2p=True),
    "isend": Op(((0, "tensor"),), (2, "group"), peer=(1, "dst"), p2p=True),
    "irecv": Op(((0, "tensor"),), (2, "group"), peer=(1, "src"), p2p=True),
    # the names torch 2.13 prefers (FSDP2 calls them); the older ones above call these inside
    # distributed_c10d, which is not wrapped, so a call is recorded once
    "all_gather_single": Op(((1, "input_tensor"),), (2, "group")),
    "reduce_scatter_single": Op(((1, "input"),), (3, "group")),
}
# One op, one name in the log, whichever function was called (the Flight Recorder's reader
# maps its own names to the same ones: `watchdog.flight_recorder`).
RECORDED_AS = {
    "all_gather_single": "all_gather_into_tensor",
    "reduce_scatter_single": "reduce_scatter_tensor",
}


def split_sizes(args: tuple, kwargs: dict) -> str:
    """An all-to-all's split sizes, `in=... out=...` ("even" where not given)."""
    out_sizes = arg_of(args, kwargs, 2, "output_split_sizes")
    in_sizes = arg_of(args, kwargs, 3, "input_split_sizes")
    if out_sizes is None and in_sizes is None:
        return ""
    fmt = lambda s: "even" if s is None else ",".join(str(int(x)) for x in s)  # noqa: E731
    return f"in={fmt(in_sizes)} out={fmt(out_sizes)}"


_TORCH_DIR = os.path.dirname(torch.__file__)
# the wrappers' frames, by the end of their path: a .pyc compiled elsewhere (an installed
# copy, a zygote's) names its file by another prefix
_OURS = (os.path.join("collector", "flightops.py"), os.path.join("collector", "flightlog.py"))


def call_site(frame: Any, callers: int = 2) -> str:
    """The line that asked for the collective (the first frame outside torch and the flight log)
    and, after " < ", the lines that called it (`callers` of them, file:line): a helper that
    issues every collective of a kind (an expert exchange, a framework's `_reduce`) is one line,
    and only its callers tell a dispatch from a combine."""
    frame = _outside(frame)
    if frame is None:
        return "?"
    path = frame.f_code.co_filename
    site = f"{'/'.join(path.rsplit('/', 2)[-2:])}:{frame.f_lineno} {frame.f_code.co_name}"
    for _ in range(callers):
        frame = _outside(frame.f_back)
        if frame is None:
            break
        site += f" < {os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
    return site


def _outside(frame: Any) -> Any:
    """The frame itself or its first caller outside torch and the flight log's wrappers."""
    while frame is not None and (
        frame.f_code.co_filename.startswith(_TORCH_DIR) or frame.f_code.co_filename.endswith(_OURS)
    ):
        frame = frame.f_back
    return frame

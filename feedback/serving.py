"""Serving-side expert load in: SGLang expert-distribution dumps, vLLM EPLB load, or CSV
(layer, expert, tokens[, latency_ms]). Anything else is a `FeedbackError` naming the input;
pickles are refused."""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

MAX_UPLOAD_BYTES = 256 * 2**20


class FeedbackError(ValueError):
    """An input the loop cannot use; the message says what is wrong and what is expected."""


@dataclass
class ServingLoad:
    """Tokens (and optionally latency) per layer and logical expert, as serving measured them."""

    tokens: np.ndarray  # [layers, experts]
    latency_ms: np.ndarray | None  # [layers, experts] or None
    source: str


def read_serving_load(data: bytes, name: str) -> ServingLoad:
    """Parse an upload by its content (a zip/pickle .pt or CSV text); FeedbackError when it is
    not one of the formats the loop reads."""
    if len(data) > MAX_UPLOAD_BYTES:
        raise FeedbackError(
            f"{name}: {len(data) / 2**20:.0f} MiB is over the {MAX_UPLOAD_BYTES // 2**20} MiB limit"
        )
    if not data:
        raise FeedbackError(f"{name}: the file is empty")
    if data[:2] == b"PK" or data[:1] == b"\x80" or name.endswith((".pt", ".pth")):
        return _read_pt(data, name)
    return _read_csv(data, name)


def _read_pt(data: bytes, name: str) -> ServingLoad:
    import torch

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # protocol notes on foreign pickles
            obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises many kinds for foreign or hostile files
        raise FeedbackError(
            f"{name}: not a tensor file that can be read safely: only tensors "
            f"and plain containers are accepted, never code "
            f"({type(err).__name__})"
        ) from None
    if isinstance(obj, dict) and "logical_count" in obj:
        counts, source = _as_array(obj["logical_count"], name, "logical_count"), "sglang"
    elif isinstance(obj, dict) and "expert_load_window" in obj:
        counts, source = _as_array(obj["expert_load_window"], name, "expert_load_window"), "vllm"
        mapping = obj.get("physical_to_logical_map")
        if mapping is not None:
            counts = _logical(counts, _as_array(mapping, name, "physical_to_logical_map"), name)
    elif isinstance(obj, torch.Tensor):
        counts, source = _as_array(obj, name, "tensor"), "tensor"
    else:
        keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise FeedbackError(
            f"{name}: expected SGLang's `logical_count` or vLLM's `expert_load_window`, found {keys}"
        )
    if counts.ndim == 2:
        counts = counts[None]
    if counts.ndim != 3:
        raise FeedbackError(f"{name}: expected [steps, layers, experts], got shape {list(counts.shape)}")
    return _checked(counts.sum(axis=0), None, f"{source}:{name}")


def _as_array(value: Any, name: str, key: str) -> np.ndarray:
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().to(torch.float64).numpy()
    try:
        return np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise FeedbackError(f"{name}: `{key}` is not numeric") from None


def _logical(window: np.ndarray, mapping: np.ndarray, name: str) -> np.ndarray:
    """Physical-expert loads summed onto logical experts (vLLM replicates hot experts)."""
    if window.ndim != 3 or mapping.ndim != 2 or mapping.shape != window.shape[1:]:
        raise FeedbackError(
            f"{name}: physical_to_logical_map {list(mapping.shape)} does not "
            f"match expert_load_window {list(window.shape)}"
        )
    experts = int(mapping.max()) + 1
    out = np.zeros((window.shape[0], window.shape[1], experts))
    for layer in range(window.shape[1]):
        for phys, logical in enumerate(mapping[layer].astype(int)):
            if logical >= 0:
                out[:, layer, logical] += window[:, layer, phys]
    return out


def _read_csv(data: bytes, name: str) -> ServingLoad:
    try:
        df = pd.read_csv(io.BytesIO(data))
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as err:
        raise FeedbackError(f"{name}: not a CSV ({str(err).splitlines()[0][:200]})") from None
    df.columns = [str(c).strip().lower() for c in df.columns]
    missing = {"layer", "expert", "tokens"} - set(df.columns)
    if missing:
        raise FeedbackError(
            f"{name}: CSV needs columns layer, expert, tokens[, latency_ms]; "
            f"missing {', '.join(sorted(missing))} (found {list(df.columns)})"
        )
    if df.empty:
        raise FeedbackError(f"{name}: no rows after the header (one per layer and expert)")
    for col in ("layer", "expert", "tokens", "latency_ms"):
        if col in df.columns:
            bad = pd.to_numeric(df[col], errors="coerce").isna()
            if bad.any():
                row = int(bad.idxmax()) + 2  # 1-based, after the header
                raise FeedbackError(f"{name}: row {row}: {col} {df[col][bad].iloc[0]!r} is not a number")
            df[col] = pd.to_numeric(df[col])
    if (
        (df[["layer", "expert"]] < 0).any().any()
        or (df["layer"] % 1 != 0).any()
        or (df["expert"] % 1 != 0).any()
    ):
        raise FeedbackError(f"{name}: layer and expert must be whole numbers >= 0")
    layers, experts = int(df["layer"].max()) + 1, int(df["expert"].max()) + 1
    if layers * experts > 1_000_000:
        raise FeedbackError(f"{name}: {layers} layers x {experts} experts is too large")
    tokens = np.zeros((layers, experts))
    np.add.at(tokens, (df["layer"].astype(int), df["expert"].astype(int)), df["tokens"])
    latency = None
    if "latency_ms" in df.columns:
        latency = np.full((layers, experts), np.nan)
        latency[df["layer"].astype(int), df["expert"].astype(int)] = df["latency_ms"]
    return _checked(tokens, latency, f"csv:{name}")


def _checked(tokens: np.ndarray, latency: np.ndarray | None, source: str) -> ServingLoad:
    if not np.isfinite(tokens).all() or (tokens < 0).any():
        raise FeedbackError(f"{source}: token counts must be finite and >= 0")
    if tokens.sum() <= 0:
        raise FeedbackError(f"{source}: no tokens at all")
    return ServingLoad(tokens, latency, source)

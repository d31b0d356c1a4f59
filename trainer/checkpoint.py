"""Checkpoints that lose nothing: torch.distributed.checkpoint, visible only when complete.

Layout: `<run>/checkpoints/step_00000040/` holds DCP's files (model and optimizer, saved once
for the replicated DDP state), `local_rank<r>.pt` per rank (RNG, compression error feedback), and
`manifest.json` (step, world size, sha256 of every file). A checkpoint is written under
`.step_N.partial/` and renamed by its leader after every rank finished and the manifest is on
disk, so a kill at any moment leaves either the old set or the new one. Loading verifies the
checksums; a bad checkpoint is refused with the reason and the previous one is used.

Across nodes the folder may or may not be one (a shared file system, or each node's own disk);
the ranks find out at start (`_probe_shared`). Shared: one checkpoint for the job, as on one
node. Not shared: each node saves the whole replicated state into its own folder (DCP over the
node's ranks, the node's first rank renaming), and at resume every node says which checkpoints
it holds intact: the job resumes at the newest step every node has, and nodes that share none
refuse to train with the reason (a hang or a silent split would be worse).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import shutil
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

log = logging.getLogger("meshscope.checkpoint")
MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint is incomplete or corrupt; the message says which and why."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def verify(path: Path) -> dict[str, Any]:
    """The manifest of a complete, intact checkpoint; CheckpointError otherwise."""
    manifest_path = path / MANIFEST
    if not manifest_path.exists():
        raise CheckpointError(f"checkpoint {path.name}: no {MANIFEST} (incomplete write)")
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"checkpoint {path.name}: unreadable manifest ({err})") from None
    for name, digest in manifest["files"].items():
        f = path / name
        if not f.exists():
            raise CheckpointError(f"checkpoint {path.name}: {name} is missing")
        if _sha256(f) != digest:
            raise CheckpointError(f"checkpoint {path.name}: {name} fails its checksum (corrupt)")
    return manifest


class MetadataOnly(pickle.Unpickler):
    """Unpickles DCP's `.metadata` (which `FileSystemReader` reads with plain `pickle.load`)
    and nothing else: DCP's own classes, tensor sizes, dtypes and layouts, paths. Anything
    else in the file, a function to call above all, is refused before it runs."""

    PLAIN = {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "Path"),
    }

    def find_class(self, module: str, name: str) -> Any:
        found = super().find_class(module, name) if "." not in name else None
        dcp_class = module.startswith("torch.distributed.checkpoint.") and isinstance(found, type)
        dtype = module == "torch" and isinstance(found, torch.dtype)
        if found is None or not (dcp_class or dtype or (module, name) in self.PLAIN):
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")
        return found


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader whose metadata cannot run code (`MetadataOnly`); the tensors it
    reads are raw bytes, and its byte items go through `torch.load(weights_only=True)`."""

    def __init__(self, path: Path) -> None:
        super().__init__(str(path))
        self._path = Path(path)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        """The checkpoint's metadata, unpickled with `MetadataOnly` (else as DCP's own)."""
        try:
            with open(self._path / ".metadata", "rb") as f:
                metadata = MetadataOnly(f).load()
        except pickle.UnpicklingError as err:
            raise CheckpointError(f"{self._path}/.metadata: {err}; refusing to load it") from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


@dataclass
class Restored:
    """The checkpoint a run resumed from: its step, folder and world size."""

    step: int
    path: Path
    world_size: int


class CheckpointManager:
    """Save every N steps (asynchronously on a process group of its own), keep the last K."""

    def __init__(
        self,
        root: Path,
        *,
        rank: int,
        world_size: int,
        keep: int = 3,
        async_save: bool = True,
        node: int = 0,
    ) -> None:
        self.root = Path(root)
        self.rank, self.world_size, self.keep = rank, world_size, keep
        self.async_save = async_save and dist.is_initialized()
        self.root.mkdir(parents=True, exist_ok=True)
        # Checkpoint collectives run on their own group: they may overlap training's.
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        # who writes one copy of the state together, and who renames it (the job, or this node)
        self.save_group, self.leader = self.group, rank == 0
        if self.group is not None and world_size > 1:
            self._split_by_node(node)
        self._pending: threading.Thread | None = None
        self.sharded: Any = None  # experts.ShardedExperts under expert parallelism

    def _split_by_node(self, node: int) -> None:
        """On nodes that do not share the folder, each node saves and loads a copy of its own."""
        seen = self._probe_shared()
        where: list[Any] = [None] * self.world_size
        dist.all_gather_object(where, (node, seen), group=self.group)
        nodes = sorted({n for n, _ in where})
        if len(nodes) == 1 or all(s for _, s in where):
            return
        for n in nodes:  # every rank creates every group, in one order
            ranks = [r for r, (m, _) in enumerate(where) if m == n]
            group = dist.new_group(ranks=ranks, backend="gloo")
            if n == node:
                self.save_group, self.leader = group, self.rank == ranks[0]
        log.info("checkpoint folders are per node (%d nodes, no shared file system)", len(nodes))

    def _probe_shared(self) -> bool:
        """Whether this rank sees a file rank 0 just wrote into the checkpoint folder."""
        token: list[Any] = [uuid.uuid4().hex if self.rank == 0 else None]
        dist.broadcast_object_list(token, src=0, group=self.group)
        probe = self.root / f".probe-{token[0]}"
        if self.rank == 0:
            probe.touch()
        self._barrier()
        seen = probe.exists()
        self._barrier()
        if self.rank == 0:
            probe.unlink()
        return seen

    # --- saving -------------------------------------------------------------------------
    def save(
        self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, local: dict[str, Any]
    ) -> None:
        """Checkpoint the state after `step` steps. Returns once the state is staged."""
        self.wait()
        partial = self.root / f".step_{step:08d}.partial"
        if self.leader and partial.exists():
            shutil.rmtree(partial)
        self._barrier(self.save_group)
        partial.mkdir(parents=True, exist_ok=True)
        state = self._state(model, optimizer)
        torch.save(local, partial / f"local_rank{self.rank}.pt")
        if self.async_save:
            future = dcp.async_save(state, checkpoint_id=str(partial), process_group=self.save_group)
            self._pending = threading.Thread(
                target=self._finish, args=(step, partial, future), name="meshscope-ckpt", daemon=True
            )
            self._pending.start()
        else:
            dcp.save(state, checkpoint_id=str(partial), process_group=self.save_group)
            self._finish(step, partial, None)

    def _state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """What DCP saves and loads: model and optimizer, sharded experts as DTensors."""
        model_sd, optim_sd = get_state_dict(model, optimizer)
        if self.sharded is not None:
            return self.sharded.wrap(model_sd, optim_sd)
        return {"model": model_sd, "optim": optim_sd}

    def _finish(self, step: int, partial: Path, future: Any) -> None:
        if future is not None:
            future.result()
        self._barrier(self.save_group)  # every rank's files of this copy are written
        if self.leader:
            files = {p.name: _sha256(p) for p in sorted(partial.iterdir()) if p.is_file()}
            manifest = {"step": step, "world_size": self.world_size, "files": files}
            (partial / MANIFEST).write_text(json.dumps(manifest, indent=2))
            for p in partial.iterdir():
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
            final = self.root / f"step_{step:08d}"
            if final.exists():
                shutil.rmtree(final)
            os.rename(partial, final)  # the moment the checkpoint becomes visible
            _fsync_dir(self.root)
            self._prune()
        self._barrier()  # every copy is visible before anyone counts on it

    def wait(self, timeout: float | None = None) -> bool:
        """Block until an asynchronous save has become visible (or `timeout` passed: a save
        whose peers died never will); whether none is left in flight."""
        if self._pending is not None:
            self._pending.join(timeout)
            if self._pending.is_alive():
                return False
            self._pending = None
        return True

    def _prune(self) -> None:
        for old in self.checkpoints()[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def _barrier(self, group: Any = None) -> None:
        if self.group is not None:
            dist.barrier(group=group or self.group)

    # --- loading ------------------------------------------------------------------------
    def checkpoints(self) -> list[Path]:
        """The finished checkpoint folders, oldest first."""
        return sorted(p for p in self.root.glob("step_*") if p.is_dir())

    def valid(self) -> tuple[dict[int, Path], list[str]]:
        """This folder's intact checkpoints by step, and the reasons the others were refused."""
        found, refused = {}, []
        for path in reversed(self.checkpoints()):
            try:
                found[int(verify(path)["step"])] = path
            except CheckpointError as err:
                log.warning("%s; falling back to the previous checkpoint", err)
                refused.append(str(err))
        return found, refused

    def agreed(self) -> tuple[Path | None, list[str]]:
        """The checkpoint to resume from: the newest step intact in every rank's folder (one
        folder on one node or a shared file system; each node's own otherwise)."""
        found, refused = self.valid()
        if self.group is None or self.world_size == 1:
            return (found[max(found)] if found else None), refused
        held: list[Any] = [None] * self.world_size
        dist.all_gather_object(held, sorted(found), group=self.group)
        common = set(held[0]).intersection(*map(set, held[1:]))
        if not common:
            if any(held):
                raise CheckpointError(
                    "the nodes hold no checkpoint in common, so they cannot resume at one step "
                    f"(steps per rank: {dict(enumerate(held))}); refusing to train. Give every node "
                    "the same checkpoints (a shared folder) or start the run afresh"
                )
            return None, refused
        step = max(common)
        refused += [f"checkpoint step_{s:08d}: not on every node" for s in found if s > step]
        return found[step], refused

    def restore(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[Restored | None, list[str]]:
        """Load the agreed checkpoint into model and optimizer.

        Returns (what was restored or None, reasons newer checkpoints were refused)."""
        path, refused = self.agreed()
        if path is None:
            return None, refused
        manifest = verify(path)
        saved = SafeReader(path).read_metadata().state_dict_metadata  # a crafted file: refused here
        if self.sharded is not None and not any(key.endswith(".slot_expert") for key in saved):
            raise CheckpointError(
                f"checkpoint {path.name} was written without expert parallelism (no expert placement); "
                "resume it with parallel.ep=1, or start the run afresh in another run directory"
            )
        state = self._state(model, optimizer)
        dcp.load(state, storage_reader=SafeReader(path), process_group=self.save_group)
        if self.sharded is not None:
            state = self.sharded.unwrap(state)
        else:  # every expert here: undo a re-placement the checkpoint's sharded run had made
            _in_expert_order(path, state, self.save_group)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        return Restored(step=manifest["step"], path=path, world_size=manifest["world_size"]), refused

    def local_state(self, restored: Restored) -> dict[str, Any] | None:
        """This rank's local state, when the checkpoint was written at the same world size."""
        f = restored.path / f"local_rank{self.rank}.pt"
        if restored.world_size != self.world_size or not f.exists():
            return None
        try:  # tensors and plain values only: a crafted file must not run code at resume
            return torch.load(f, weights_only=True)
        except pickle.UnpicklingError as err:
            raise CheckpointError(
                f"{f} holds more than tensors and plain values; refusing to load it "
                f"({str(err).splitlines()[0]})"
            ) from None


def _in_expert_order(path: Path, state: dict[str, Any], group: Any) -> None:
    """A checkpoint of expert-parallel layers holds each layer's experts in slot order (its
    `slot_expert` placement, identity until a live re-placement). Loaded by a run that holds every
    expert in expert order, the stacked expert weights and their moments are put back in order."""
    saved = SafeReader(path).read_metadata().state_dict_metadata
    for key in (k for k in saved if k.startswith("model.") and k.endswith(".slot_expert")):
        layer = key.removeprefix("model.").removesuffix(".slot_expert")
        slots = {"model": {f"{layer}.slot_expert": torch.empty(saved[key].size, dtype=torch.int64)}}
        dcp.load(slots, storage_reader=SafeReader(path), process_group=group)
        where = torch.argsort(slots["model"][f"{layer}.slot_expert"])  # expert -> its slot
        for name, value in state["model"].items():
            if name.startswith(f"{layer}.experts."):
                value.copy_(value[where])
                for moment in state["optim"].get("state", {}).get(name, {}).values():
                    if isinstance(moment, torch.Tensor) and moment.shape == value.shape:
                        moment.copy_(moment[where])

"""The tensor tracer: the first module whose outputs (or gradients) went non-finite, and stats.

Modes (`--trace`):

- `off`: nothing.
- `nonfinite` (default): no hooks in the step. The step's loss and gradient norm, which the loop
  computes anyway, go into one small device tensor read back without blocking
  (`collector.readback`: at once on the host, a step later on an accelerator). When either is
  non-finite the tracer *localises*: it restores the step's RNG state and re-runs the step on
  this rank's bare module (forward with hooks on every module, backward with
  `torch.autograd.grad`, so DDP sees no gradients and no collective is issued), then reads
  the hooked tensors on the host (a sync point, only after a finding). The fused optimizer
  skipped the bad update, so the re-run sees the step's weights (on an accelerator the flags
  land a step later, after the next update: a fault that was transient may then be gone, and
  the finding says so). The re-run's forward counts its MoE tokens a second time.
  Under expert parallelism no re-run is possible (it would need every EP peer): a rank looks
  at its own weights, then at what its experts and its own layers sent and received at each
  exchange (`tracer.exchanges`, sums per exchange read with the loss).
- `stats`: hooks on every `stats_every`-th step only: per-module absmax, norm, mean, std and
  non-finite count of each output, reduced on the device, into the run store (`tensor_stats`).
- `full`: hooks on every step: stats every step, and findings judged from the step itself
  (no re-run).

A finding is the first module in execution order whose inputs are finite and whose output is
not (forward; its own parameters are checked too), else the first module in backward order
whose output gradient is finite and whose input gradient is not. It becomes a `nan` event
(detail: `module`, `experts` (inside stacked experts: which slices), `where`, `tensor`, `class`,
`note`, `snapshot`) and, for the first
`max_snapshots`, a snapshot (`tracer.snapshot`) that `meshscope replay` re-runs on the CPU."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from meshscope.collector.readback import Readback
from meshscope.tracer.config import TracerConfig
from meshscope.tracer.exchanges import ARRIVED_NOTE, OWN_LAYERS_NOTE, ExchangeWatch, fed_by_peers, made_here
from meshscope.tracer.findings import (
    Finding,
    Report,
    _device_rng,
    _finite,
    _floats,
    _Ready,
    _set_rng,
    _Span,
    _Step,
    first_nonfinite_weights,
    held_experts,
    nonfinite_experts,
    output_stats,
)
from meshscope.tracer.snapshot import write_snapshot


class TensorTracer:
    """Hooks one model; call `step_begin(step)` before its forward and `step_end()` after the
    optimizer (see the module doc)."""

    def __init__(
        self,
        model: torch.nn.Module,
        config: TracerConfig | None = None,
        *,
        rank: int = 0,
        snapshot_dir: Path | None = None,
        report: Report = lambda kind, step, detail: None,
        stats_sink: Callable[[list[dict[str, Any]]], None] | None = None,
    ) -> None:
        self.config = config or TracerConfig()
        self.rank, self.snapshot_dir, self.report = rank, snapshot_dir, report
        self.stats_sink = stats_sink
        self.model = model
        self.names = [name for name, _ in model.named_modules()]
        self.modules = [m for _, m in model.named_modules()]
        self.findings: list[Finding] = []
        self._handles: list[Any] = []
        self._step = -1
        self._forward: list[tuple[int, tuple, Any]] = []
        self._backward: list[tuple[int, Any, Any]] = []
        self._pending: list[_Step] = []
        self._reported: dict[tuple[str, str, str], int] = {}
        self._snapshots = 0
        self._rng: tuple[torch.Tensor, Any] | None = None
        self._flags: list[tuple[int, Readback, Callable[[], torch.Tensor] | None, Any, bool, Any]] = []
        self._lag_note = ""  # while a late re-run is judged: what its findings must say
        self.no_rerun = "no re-run given to localise it"  # why, when a step brings none
        if self.config.mode == "full":
            self._attach()
        # under expert parallelism, where no re-run can localise: what this rank's experts
        # took in and gave out at each exchange (`tracer.exchanges`)
        watched = self.config.exchanges and self.config.mode in ("nonfinite", "stats")
        self._exchanges = ExchangeWatch.install(model) if watched else None
        self._fed_by_peers = fed_by_peers(model)

    # --- hooks ----------------------------------------------------------------------------
    def _attach(self) -> None:
        if self._handles:
            return
        # A module whose inputs need no gradient (an embedding) still gets its hook called,
        # with its output gradient only: expected here, not worth a warning per step.
        warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients")
        for index, module in enumerate(self.modules):
            self._handles.append(module.register_forward_hook(self._forward_hook(index)))
            computes = not list(module.children()) or any(True for _ in module.parameters(recurse=False))
            if computes:
                self._handles.append(module.register_full_backward_hook(self._backward_hook(index)))

    def _forward_hook(self, index: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
            self._forward.append((index, args, output))

        return hook

    def _backward_hook(self, index: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, grad_input: Any, grad_output: Any) -> None:
            self._backward.append((index, grad_input, grad_output))

        return hook

    def _detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def close(self) -> None:
        """Judge what is pending (waits for the device) and remove the hooks."""
        for pending in self._pending:
            if pending.readback is not None:
                pending.readback.wait()
            self._judge(pending)
        self._pending = []
        for step, flags, *rest in self._flags:
            flags.wait()
            self._check_flags(step, flags, *rest)
        self._flags = []
        self._detach()

    # --- the step -------------------------------------------------------------------------
    def step_begin(self, step: int) -> None:
        """A step starts (before its forward)."""
        self._step = step
        self._forward, self._backward = [], []
        if self._exchanges is not None:
            self._exchanges.clear()
        if self.config.mode == "off":
            return
        if self.config.mode != "full":  # what a localising re-run restores
            self._rng = (torch.get_rng_state(), _device_rng(self.model))
        if self._wants_stats():
            self._attach()

    def step_end(
        self,
        loss: torch.Tensor | None = None,
        grad_norm: torch.Tensor | None = None,
        rerun: Callable[[], torch.Tensor] | None = None,
    ) -> None:
        """The step ended (after the optimizer): check it (see the module doc). `loss` and
        `grad_norm` are the step's own tensors (read without blocking); `rerun()` recomputes
        this step's loss from its batch on the bare module (no DDP, no collective)."""
        if self.config.mode == "off":
            return
        if self.config.mode != "full":
            if self._handles:  # a sampled stats step
                self._stats()
                self._detach()
            self._forward, self._backward = [], []
            # the loss first: a rank whose own loss is finite but whose (all-reduced) gradient
            # norm is not only saw a peer's NaN, unless its own backward made it
            flags = [t.detach().float().reshape(()) for t in (loss, grad_norm) if isinstance(t, torch.Tensor)]
            marks, exchanged = self._exchanges.take() if self._exchanges is not None else ([], None)
            if flags:
                values = torch.stack(flags)
                if exchanged is not None:
                    values = torch.cat([values, exchanged])
                seen = (len(flags), marks)  # where the exchanges' flags start, and what they were
                has_loss = isinstance(loss, torch.Tensor)
                self._flags.append((self._step, Readback(values), rerun, self._rng, has_loss, seen))
            while self._flags and self._flags[0][1].ready():
                self._check_flags(*self._flags.pop(0))
            # never drop an unjudged flag: past the window, wait for the device
            while len(self._flags) > self.config.max_lag_steps:
                step, flags, *rest = self._flags.pop(0)
                flags.wait()  # sync point: the device lags more than max_lag_steps
                self._check_flags(step, flags, *rest)
            return
        tensors, spans = self._collect()
        readback = None
        if tensors:
            norms = torch._foreach_norm(tensors, float("inf"))
            readback = Readback(torch.stack([n.float().reshape(()) for n in norms]))
        self._pending.append(_Step(self._step, spans, readback, self._forward, self._backward))
        self._stats()
        self._forward, self._backward = [], []
        while self._pending and (self._pending[0].readback is None or self._pending[0].readback.ready()):
            self._judge(self._pending.pop(0))
        del self._pending[:-1]  # at most one step waits (its tensors stay referenced)

    def _collect(self) -> tuple[list[torch.Tensor], list[_Span]]:
        """Every hooked tensor of the step, and which module and phase each belongs to."""
        tensors: list[torch.Tensor] = []
        spans: list[_Span] = []
        for index, _args, output in self._forward:
            outs = _floats(output)
            spans.append(_Span("forward", index, (len(tensors), len(tensors) + len(outs))))
            tensors += outs
        for index, grad_input, grad_output in self._backward:
            gout, gin = _floats(grad_output), _floats(grad_input)
            start = len(tensors)
            spans.append(
                _Span(
                    "backward",
                    index,
                    (start, start + len(gout)),
                    (start + len(gout), start + len(gout) + len(gin)),
                )
            )
            tensors += gout + gin
        return tensors, spans

    def _wants_stats(self) -> bool:
        if self.config.mode == "full":
            return True
        return self.config.mode == "stats" and self._step % self.config.stats_every == 0

    def _check_flags(
        self, step: int, flags: Readback, rerun: Any, rng: Any, has_loss: bool = False, seen: Any = (None, [])
    ) -> None:
        values = flags.value().tolist()  # host tensor: the landed copy
        at, marks = seen  # the exchanges' sums follow the loss and the gradient norm
        if all(math.isfinite(v) for v in values[:at]):
            return
        own_loss_bad = has_loss and not math.isfinite(values[0])
        if rerun is None:  # own weights, then exchanges (backward ones count with a finite loss)
            found = self._in_own_weights(step) or self._in_exchanges(
                step, marks, values[at:], has_loss and not own_loss_bad
            )
            self._emit(found or self._unlocalised(step, f"loss or gradient norm non-finite; {self.no_rerun}"))
            return
        self._localise(step, rerun, rng, report_transient=own_loss_bad or not has_loss)

    def _localise(
        self, step: int, rerun: Callable[[], torch.Tensor], rng: Any, report_transient: bool = True
    ) -> None:
        """Re-run the step with hooks on the bare module and judge it on the host. A device
        that lagged means the re-run comes steps later, on later weights: the finding says so."""
        attached = bool(self._handles)
        self._attach()
        saved = (torch.get_rng_state(), _device_rng(self.model))
        if rng is not None:
            _set_rng(self.model, rng)
        self._forward, self._backward = [], []
        lag = max(0, self._step - step)
        late = f" (judged {lag} step{'s' if lag != 1 else ''} late, on the weights of step {self._step})"
        before = len(self.findings)
        try:
            loss = rerun()
            params = [p for p in self.model.parameters() if p.requires_grad]
            if loss.requires_grad:  # not .backward(): no .grad, so DDP's hooks stay quiet
                torch.autograd.grad(loss, params, allow_unused=True)
            self._lag_note = late if lag else ""
            self._judge_now(step)
            if len(self.findings) == before and report_transient:
                why = (
                    "finite when the step was re-run on this rank: a transient fault"
                    if not lag
                    else f"finite when re-run{late}: not localised, the weights have moved on"
                )
                self._emit(self._unlocalised(step, f"non-finite loss, but {why}"))
        except Exception as err:  # noqa: BLE001  (the fault is reported whatever the re-run does)
            if len(self.findings) == before:
                self._emit(
                    self._unlocalised(step, f"non-finite step; the re-run failed ({err}): not localised")
                )
        finally:
            self._lag_note = ""
            _set_rng(self.model, saved)
            self._forward, self._backward = [], []
            if not attached:
                self._detach()

    def _in_own_weights(self, step: int) -> Finding | None:
        """Without a re-run (expert parallelism): the first module whose own weights on this
        rank are non-finite, as an expert's holder finds it without its peers; else None."""
        index = first_nonfinite_weights(self.modules)
        if index is None:
            return None
        module = self.modules[index]
        lag = max(0, self._step - step)
        seen = f"found in this rank's own weights{f' {lag} steps later' if lag else ''}, without a re-run"
        finding = Finding(self.names[index], "forward", "parameter", step, self.rank, _class_of(module), seen)
        params = list(module.parameters(recurse=False))
        finding.experts = held_experts(self.model, self.names[index], nonfinite_experts(module, params))
        return finding

    def _in_exchanges(
        self, step: int, marks: list[Any], sums: list[float], loss_finite: bool
    ) -> Finding | None:
        """Without a re-run (expert parallelism): what this rank's exchanges show it made
        (`tracer.exchanges.made_here`): its experts, or its own layers; else None."""
        made = made_here(marks, sums, loss_finite)
        if made is None:
            return None
        experts, where = made.experts, made.phase
        name = self.names[self.modules.index(experts)]
        if made.local is None:  # this rank's own layers sent it: named at the layer that carried it
            name = name.rpartition(".")[0] or name
            module: torch.nn.Module = self.model.get_submodule(name)
            tensor, note = "input", OWN_LAYERS_NOTE
        else:
            module, tensor = experts, "output" if where == "forward" else "gradient"
            note = "seen at its expert-parallel exchanges: finite in, non-finite out on this rank"
        finding = Finding(name, where, tensor, step, self.rank, _class_of(module), note)
        if made.local is not None:
            finding.experts = held_experts(self.model, name, made.local)
        last = self._reported.get((finding.module, where, tensor))
        if last is not None and step - last < self.config.repeat_after:
            finding.note = "repeat"  # the same place again: said once per `repeat_after` steps
        return finding

    def _unlocalised(self, step: int, note: str) -> Finding:
        """A finding that names no module: the fault is reported, and why it is not placed."""
        return Finding("", "forward", "output", step, self.rank, "", note=note)

    def _judge_now(self, step: int) -> None:
        """Judge the hooked tensors of a re-run on the host."""
        tensors, spans = self._collect()
        values = (
            [
                float(v)
                for v in torch.stack([n.float() for n in torch._foreach_norm(tensors, float("inf"))]).tolist()
            ]
            if tensors
            else []
        )  # sync point: localising
        self._judge(_Step(step, spans, _Ready(values), self._forward, self._backward))

    # --- judging --------------------------------------------------------------------------
    def _judge(self, pending: _Step) -> None:
        if pending.readback is None:
            return
        values = pending.readback.value().tolist()

        def bad(span: tuple[int, int]) -> bool:
            return any(not math.isfinite(v) for v in values[span[0] : span[1]])

        finding = None
        forward = [s for s in pending.spans if s.where == "forward"]
        for order, span in enumerate(forward):
            if bad(span.first):
                index, args, output = pending.forward[order]
                finding = self._forward_finding(pending.step, index, args, output)
                break
        if finding is None:
            calls = {index: (args, output) for index, args, output in pending.forward}
            backward = [s for s in pending.spans if s.where == "backward"]
            for order, span in enumerate(backward):
                if bad(span.second) and not bad(span.first):
                    index, gin, gout = pending.backward[order]
                    args, output = calls.get(index, ((), None))
                    finding = self._make(
                        pending.step,
                        index,
                        "backward",
                        "gradient",
                        args=args,
                        output=output,
                        grad_input=gin,
                        grad_output=gout,
                    )
                    break
                if bad(span.first) and order == 0:
                    index, gin, gout = pending.backward[order]
                    args, output = calls.get(index, ((), None))
                    finding = self._make(
                        pending.step,
                        index,
                        "backward",
                        "gradient",
                        args=args,
                        output=output,
                        grad_input=gin,
                        grad_output=gout,
                        note="the gradient reaching the model's last module was already "
                        "non-finite: the loss or code after the model",
                    )
                    break
        if finding is not None:
            self._emit(finding)

    def _forward_finding(self, step: int, index: int, args: tuple, output: Any) -> Finding:
        module = self.modules[index]
        if not _finite(list(module.parameters(recurse=False))):
            return self._make(step, index, "forward", "parameter", args=args, output=output)
        if not _finite(list(args)):
            if id(module) in self._fed_by_peers:  # it came through the exchange: not this rank's
                return self._unlocalised(step, ARRIVED_NOTE)
            return self._make(
                step,
                index,
                "forward",
                "input",
                args=args,
                output=output,
                note="its input was already non-finite while every module before "
                "it gave finite outputs: code outside modules (in its "
                "parent's forward) or the data made it",
            )
        return self._make(step, index, "forward", "output", args=args, output=output)

    def _make(
        self,
        step: int,
        index: int,
        where: str,
        tensor: str,
        *,
        args: tuple,
        output: Any,
        grad_input: Any = None,
        grad_output: Any = None,
        note: str = "",
    ) -> Finding:
        module = self.modules[index]
        note = (note + self._lag_note).strip()
        finding = Finding(
            self.names[index],
            where,
            tensor,
            step,
            self.rank,
            _class_of(module),
            note,
        )
        bad = {"parameter": list(module.parameters(recurse=False)), "input": args, "output": output}
        finding.experts = nonfinite_experts(module, grad_input if where == "backward" else bad[tensor])
        key = (finding.module, where, tensor)
        last = self._reported.get(key)
        if last is not None and step - last < self.config.repeat_after:
            finding.note = "repeat"
            return finding
        limit = self.config.max_snapshots
        if self.snapshot_dir is not None and self._snapshots < limit:
            self._snapshots += 1
            finding.snapshot = str(
                write_snapshot(
                    self.snapshot_dir,
                    module_path=finding.module,
                    module=module,
                    where=where,
                    tensor=tensor,
                    step=step,
                    rank=self.rank,
                    args=tuple(args),
                    outputs=output,
                    grad_input=grad_input,
                    grad_output=grad_output,
                    note=note,
                )
            )
        return finding

    def _emit(self, finding: Finding) -> None:
        if finding.note == "repeat":
            return
        self._reported[(finding.module, finding.where, finding.tensor)] = finding.step
        self.findings.append(finding)
        self.report("nan", finding.step, finding.detail())
        if finding.snapshot:
            self.report(
                "snapshot",
                finding.step,
                {"module": finding.module, "path": finding.snapshot, "where": finding.where},
            )

    # --- stats ----------------------------------------------------------------------------
    def _stats(self) -> None:
        """Per-module output statistics, reduced on the device and read at once (sampled
        steps only; `stats` and `full` accept this cost)."""
        rows = output_stats(self._forward, self.names, self._step, self.rank)
        if rows and self.stats_sink is not None:
            self.stats_sink(rows)


def _class_of(module: torch.nn.Module) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"

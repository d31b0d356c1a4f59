"""Fault injection for demos, tests and scoring detectors: `KIND@step=S,rank=R[,steps=N][,k=v]`.

Kinds: kill, hang (seconds=), slow (factor=), comm_delay (ms=), nan (module=PATH,
where=forward|backward: one module's parameter turns Inf in forward, or its input gradient
NaN in backward; PATH.INDEX names one expert inside stacked experts, its slice alone; without
module= the loss turns NaN), expert_collapse (layer=, expert=,
logit=: 20 collapses routing onto the expert, a few units make it hog, negative starves it),
memory_leak (mb_per_step=), skip_collective (of=gradients: the rank skips its gradient
all-reduces of that step, as a rank taking a wrong branch would; of=experts: its first expert
all-to-all of that step, and pairs its next one with its peers' skipped one),
collective_mismatch (what=shape|op|dtype|split: the rank's first gradient collective of that
step disagrees with its peers'; `split` makes every rank exchange tokens with
all_to_all_single, the rank with wrong split sizes),
stream_hang (the rank's device stream stops: every kernel from then on, its collectives
included, never finishes, while its host runs on: a stuck transport or device; `--device sim`
only, the one device whose stream can be stopped on purpose). An expert
collapse acts on every rank (the router is replicated, so a real collapse does too); its `rank`
only says which rank reports it. Every injection writes an `injected` event when it starts
(the ground truth detectors are scored against) and fires once per run, also across restarts.
"""

from __future__ import annotations

import collections
import os
import signal
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from meshscope.collector.moe import experts_on, stacked_experts
from meshscope.trainer import sim

KINDS = {
    "kill": {"during": "step"},
    "hang": {"seconds": 3600.0},
    "slow": {"factor": 3.0},
    "comm_delay": {"ms": 50.0},
    "nan": {"module": "", "where": "forward"},
    "expert_collapse": {"layer": 0.0, "expert": 0.0, "logit": 20.0},
    "memory_leak": {"mb_per_step": 16.0},
    "skip_collective": {"of": "gradients"},
    "collective_mismatch": {"what": "shape"},
    "stream_hang": {},
}
# Parameters that take a word, not a number, and the words they take; free text.
CHOICES = {
    "what": ("shape", "op", "dtype", "split"),
    "where": ("forward", "backward"),
    "of": ("gradients", "experts"),
    "during": ("step", "move"),
}
TEXT = {"module"}


class InjectionError(ValueError):
    """A malformed --inject spec; the message quotes it."""


@dataclass(frozen=True)
class Injection:
    """One fault to inject: its kind, step, rank and parameters (parsed from `--inject`)."""

    kind: str
    step: int
    rank: int
    steps: int = 1
    params: dict[str, float | str] = field(default_factory=dict)

    def active(self, step: int, rank: int) -> bool:
        """Whether it acts on `rank` at `step`."""
        return rank == self.rank and self.step <= step < self.step + self.steps

    @property
    def key(self) -> str:
        """Its identity in the fired set (kind@step/rank)."""
        return f"{self.kind}@{self.step}/{self.rank}"

    def param(self, name: str) -> Any:
        """A parameter, or its kind's default."""
        return self.params.get(name, KINDS[self.kind][name])


def parse_injection(spec: str) -> Injection:
    """`slow@step=20,rank=1,steps=10,factor=3` -> Injection."""
    kind, sep, rest = spec.partition("@")
    if not sep or kind not in KINDS:
        raise InjectionError(
            f"--inject {spec!r}: expected KIND@step=S,rank=R[,...] with KIND one of {', '.join(KINDS)}"
        )
    fields: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if key in TEXT:
            fields[key] = value
            continue
        if key in CHOICES:
            if value not in CHOICES[key]:
                raise InjectionError(
                    f"--inject {spec!r}: {key}= takes one of {', '.join(CHOICES[key])}, not {value!r}"
                )
            fields[key] = value
            continue
        try:
            fields[key] = float(value)
        except ValueError:
            raise InjectionError(f"--inject {spec!r}: {item!r} is not key=number") from None
        if not eq:
            raise InjectionError(f"--inject {spec!r}: {item!r} is not key=number")
    for required in ("step", "rank"):
        if required not in fields:
            raise InjectionError(f"--inject {spec!r}: {required}= is required")
    unknown = set(fields) - {"step", "rank", "steps"} - set(KINDS[kind])
    if unknown:
        raise InjectionError(
            f"--inject {spec!r}: unknown parameter(s) {sorted(unknown)} for "
            f"{kind} (allowed: steps, {', '.join(KINDS[kind]) or 'none'})"
        )
    steps = int(fields.pop("steps", 1))
    if steps < 1 or fields["step"] < 0 or fields["rank"] < 0:
        raise InjectionError(f"--inject {spec!r}: step, rank must be >= 0 and steps >= 1")
    step, rank = int(fields.pop("step")), int(fields.pop("rank"))
    return Injection(kind, step, rank, steps, fields)


def resolve_target(model: torch.nn.Module, path: str) -> tuple[torch.nn.Module, int | None]:
    """The module `path` names, and the expert index when it ends in one inside stacked experts
    (`blocks.1.moe.experts.2`); InjectionError naming what exists when it names nothing."""
    try:
        return model.get_submodule(path), None
    except AttributeError:
        pass
    parent, _, last = path.rpartition(".")
    if parent and last.isdigit():
        try:
            module = model.get_submodule(parent)
        except AttributeError:
            module = None
        owner = model.get_submodule(parent.rpartition(".")[0]) if module is not None else None
        mesh = getattr(owner, "expert_mesh", None)  # expert parallelism: this rank holds a slice
        if mesh is not None:  # the placement in force (a live re-placement moves experts)
            held = experts_on(owner.slot_expert.tolist(), mesh.ep, mesh.ep_rank)  # sync point: injection only
            if int(last) not in held:
                raise InjectionError(
                    f"--inject nan: expert {last} of {parent!r} is not held by this rank (it holds {held})"
                )
            return module, held.index(int(last))
        count = stacked_experts(module) if module is not None else None
        if count is not None:
            if int(last) < count:
                return module, int(last)
            raise InjectionError(f"--inject nan: {parent!r} holds experts 0..{count - 1}, not {last}")
    names = [n for n, _ in model.named_modules() if n]
    near = [n for n in names if n.startswith(parent)] if parent else []
    raise InjectionError(
        f"--inject nan: no module {path!r} in the model (e.g. {', '.join((near or names)[:8])}; "
        "an expert inside stacked experts: PATH.INDEX)"
    )


def check_expert_holders(injections: Iterable[Injection], experts: int, ep: int) -> None:
    """Under expert parallelism an expert lives on the ranks r with r % ep == its EP rank: an
    injection into one expert must name such a rank."""
    per = experts // ep
    for inj in injections:
        path = inj.param("module") if inj.kind == "nan" else ""
        last = str(path).rpartition(".")[2]
        if ep > 1 and ".experts." in f"{path}" and last.isdigit() and inj.rank % ep != int(last) // per:
            holder = int(last) // per
            raise InjectionError(
                f"--inject {inj.kind}: expert {last} is held by the ranks r with r % {ep} == {holder} "
                f"(parallel.ep={ep}), not rank {inj.rank}"
            )


def check_against_model(injections: Iterable[Injection], model: torch.nn.Module, world: int) -> None:
    """Refuse, before anything starts, an injection this model or job cannot have: a module
    or expert it lacks, a layer or expert out of range, a rank the job will never have."""
    layers = list(getattr(model, "moe_layers", lambda: [])())
    for inj in injections:
        if inj.rank >= world:
            raise InjectionError(
                f"--inject {inj.kind}: rank={inj.rank}, but the job has at most {world} ranks"
            )
        if inj.kind == "nan" and inj.param("module"):
            resolve_target(model, inj.param("module"))
        if inj.kind == "expert_collapse":
            layer, expert = int(inj.param("layer")), int(inj.param("expert"))
            if not 0 <= layer < len(layers):
                raise InjectionError(f"--inject expert_collapse: layer={layer}, the model has {len(layers)}")
            if not 0 <= expert < len(layers[layer].experts):
                count = len(layers[layer].experts)
                raise InjectionError(f"--inject expert_collapse: expert={expert}, layer {layer} has {count}")


class Injector:
    """Applies the injections for one rank at the loop's hook points.

    `report(kind, step, detail)` writes the `injected` event; `already_fired` holds keys fired
    by earlier attempts (read from the store), so a resumed run is not killed again.
    """

    def __init__(
        self,
        injections: Iterable[Injection],
        rank: int,
        report: Callable[[Injection, int], None],
        already_fired: set[str] | None = None,
        flush: Callable[[], None] = lambda: None,
    ) -> None:
        injections = list(injections)
        self.mine = [i for i in injections if i.rank == rank]
        # The router is replicated: a collapse happens on every rank at once (reported by one).
        self.collapses = [i for i in injections if i.kind == "expert_collapse"]
        # A token exchange with wrong splits needs every rank in the exchange.
        self.exchanges = [
            i for i in injections if i.kind == "collective_mismatch" and i.param("what") == "split"
        ]
        self._broken_step = -1
        self._skipped_exchange = -1  # the step whose expert all-to-all a skip left out
        self.rank = rank
        self._report, self._flush = report, flush
        self._fired = set(already_fired or ())
        self._fired_before = frozenset(self._fired)  # by earlier attempts, on any rank
        self._poisoned: list[tuple[torch.Tensor, int, float]] = []  # (param, index, value)
        self._leak: list[torch.Tensor] = []
        self._step = -1
        self._normal_steps: collections.deque[float] = collections.deque(maxlen=9)

    def _starting(self, step: int) -> list[Injection]:
        out = []
        for inj in self.mine:
            if inj.kind == "kill" and inj.param("during") == "move":
                continue  # fires inside a re-placement (`_kill_mid_move`)
            if inj.active(step, self.rank) and inj.key not in self._fired:
                self._fired.add(inj.key)
                self._report(inj, step)
                out.append(inj)
        return out

    def _kill_mid_move(self) -> None:
        """`kill@step=S,during=move`: die inside the first expert re-placement after step S
        begins, its transfer done and its agreement not yet reached."""
        for inj in self.mine:
            if inj.kind == "kill" and inj.param("during") == "move" and self._step >= inj.step:
                if inj.key not in self._fired:
                    self._fired.add(inj.key)
                    self._report(inj, self._step)
                    self._flush()  # the ground truth must survive the kill
                    os.kill(os.getpid(), signal.SIGKILL)

    def _active(self, kind: str, step: int) -> Injection | None:
        """The injection of `kind` acting now: started by this attempt (a resumed run replays
        its steps without the fault that made it restart)."""
        return next(
            (
                i
                for i in self.mine
                if i.kind == kind
                and i.active(step, self.rank)
                and i.key in self._fired
                and i.key not in self._fired_before
            ),
            None,
        )

    def before_step(self, step: int, model: torch.nn.Module) -> None:
        """Start injections; kill and hang act here, the rest shape the step."""
        self._step = step
        for inj in self._starting(step):
            if inj.kind == "kill" and inj.param("during") == "step":
                self._flush()  # the ground truth must survive the kill
                os.kill(os.getpid(), signal.SIGKILL)
            if inj.kind == "hang":
                time.sleep(inj.param("seconds"))
            if inj.kind == "stream_hang":
                self._flush()  # the ground truth must reach the store before the stream stops
                sim.stream().hang()
            if inj.kind in ("skip_collective", "collective_mismatch"):
                # a broken exchange can make gloo end the process at once (std::terminate): the
                # fired mark must be stored, or the restart replays the fault and fails again
                self._flush()
        self._route(step, model)
        self._poison_parameter(step, model)
        leak = self._active("memory_leak", step)
        if leak is not None:  # on the model's device: a GPU leak shows in allocated memory
            device = next(model.parameters()).device
            self._leak.append(torch.ones(int(leak.param("mb_per_step") * (1 << 20) // 4), device=device))

    def replay(self, step: int, model: torch.nn.Module) -> None:
        """Act as at `step` again until the next `before_step`: a tracer re-running a step the
        device finished late meets the faults that step had, not today's."""
        self._step = step
        self._poison_parameter(step, model)

    def _route(self, step: int, model: torch.nn.Module) -> None:
        collapse = next((i for i in self.collapses if i.step <= step < i.step + i.steps), None)
        for layer, moe in enumerate(getattr(model, "moe_layers", lambda: [])()):
            if collapse is not None and layer == int(collapse.param("layer")):
                # logit=20 (the default): every token's first choice is `expert` (a collapse);
                # a few units: it hogs; negative: it starves
                experts = moe.router.experts  # every expert, also where this rank holds a few
                bias = torch.zeros(experts, device=moe.router.gate.weight.device)
                bias[int(collapse.param("expert")) % experts] = collapse.param("logit")
                moe.router.logit_bias = bias
            else:
                moe.router.logit_bias = None

    def poison_loss(self, loss: torch.Tensor, step: int) -> torch.Tensor:
        """The loss, NaN while a loss `nan` injection is active."""
        nan = self._active("nan", step)
        return loss * float("nan") if nan is not None and not nan.param("module") else loss

    def arm(self, model: torch.nn.Module) -> None:
        """Hooks for module-level NaN injections (InjectionError when the module is unknown),
        and wrong splits in the expert dispatch itself where it has uneven ones."""
        meshes = [getattr(layer, "expert_mesh", None) for layer in getattr(model, "moe_layers", list)()]
        skips_experts = any(i.kind == "skip_collective" and i.param("of") == "experts" for i in self.mine)
        for mesh in meshes:
            if mesh is not None and mesh.dropless and self.exchanges:
                mesh.miscount = self.miscount
            if mesh is not None and skips_experts:
                mesh.skip = self.skip_exchange
            if mesh is not None and any(i.kind == "kill" and i.param("during") == "move" for i in self.mine):
                mesh.mid_move = self._kill_mid_move
        for inj in self.mine:
            path = inj.param("module") if inj.kind == "nan" else ""
            if not path:
                continue
            module, expert = resolve_target(model, path)
            if inj.param("where") == "backward":
                module.register_full_backward_hook(self._poison_gradient(inj, expert), prepend=True)
            elif not any(True for _ in module.parameters()):
                module.register_forward_hook(self._poison_output(inj))

    def _poison_gradient(self, inj: Injection, expert: int | None) -> Callable[..., Any]:
        def poisoned(g: Any) -> Any:
            if not isinstance(g, torch.Tensor):
                return g
            if expert is None:
                return g * float("nan")
            g = g.clone()  # only the rows of one expert's slots: what flows out of that expert
            g[expert] = float("nan")
            return g

        def hook(module: torch.nn.Module, grad_input: Any, grad_output: Any) -> Any:
            if self._active("nan", self._step) is not inj:
                return None
            return tuple(poisoned(g) for g in grad_input)

        return hook

    def _poison_output(self, inj: Injection) -> Callable[..., Any]:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> Any:
            if self._active("nan", self._step) is not inj or not isinstance(output, torch.Tensor):
                return None
            return output * float("nan")

        return hook

    def _poison_parameter(self, step: int, model: torch.nn.Module) -> None:
        """A weight turns Inf for one step (as after a bad update), then is put back."""
        with torch.no_grad():
            for param, index, value in self._poisoned:
                param.view(-1)[index] = value
            self._poisoned = []
            inj = self._active("nan", step)
            if inj is None or not inj.param("module") or inj.param("where") != "forward":
                return
            module, expert = resolve_target(model, inj.param("module"))
            params = list(module.parameters())
            if params:
                # one expert's first weight inside stacked experts, else the module's first
                index = 0 if expert is None else expert * params[0][0].numel()
                flat = params[0].view(-1)
                self._poisoned.append((params[0], index, float(flat[index])))  # sync point: injection only
                flat[index] = float("inf")

    def slow_down(self, step: int) -> None:
        """A slow rank: its compute takes `factor` times as long as its normal step (the median
        of recent uninjected steps, so one noisy step does not set the slow-down).
        Called inside the forward phase, so it looks like slow compute, not slow comm."""
        slow = self._active("slow", step)
        if slow is not None and self._normal_steps:
            time.sleep(statistics.median(self._normal_steps) * (slow.param("factor") - 1))

    def step_took(self, step: int, seconds: float) -> None:
        """Remember a normal step's time (slow injections scale it)."""
        if not any(i.active(step, self.rank) for i in self.mine):
            self._normal_steps.append(seconds)

    def comm_delay_s(self) -> float:
        """The delay an active comm_delay adds to each collective."""
        delay = self._active("comm_delay", self._step)
        return delay.param("ms") / 1000 if delay is not None else 0.0

    @property
    def touches_collectives(self) -> bool:
        """Whether the gradient hook must be wrapped by `collective_fault_hook`."""
        return bool(self.exchanges) or any(
            (i.kind == "skip_collective" and i.param("of") == "gradients") or i.kind == "collective_mismatch"
            for i in self.mine
        )

    def miscount(self, send: list[int]) -> list[int]:
        """Dropless expert dispatch's split sizes under collective_mismatch(what=split): the
        step's first dispatch takes the fault (the gradient hook then leaves it), and the
        culprit sends one row meant for one rank to the next, its total right, so only the
        ranks in the exchange can notice, as a router that miscounts would."""
        step = self._step
        active = next(
            (i for i in self.exchanges if i.active(step, i.rank) and i.key not in self._fired_before), None
        )
        if active is None or self._broken_step == step:
            return send
        self._broken_step = step
        if active.rank != self.rank:
            return send
        out = list(send)
        src = max(range(len(out)), key=out.__getitem__)
        out[src] -= 1
        out[(src + 1) % len(out)] += 1
        return out

    def skip_exchange(self) -> bool:
        """Whether this expert all-to-all is the one a skip_collective(of=experts) skips: the
        step's first, once."""
        skip = self._active("skip_collective", self._step)
        if skip is None or skip.param("of") != "experts" or self._skipped_exchange == self._step:
            return False
        self._skipped_exchange = self._step
        return True

    def collective_fault(self) -> tuple[str, Injection] | None:
        """What this bucket's collective must do wrong: ("skip" | shape | op | dtype | split)."""
        step = self._step
        skip = self._active("skip_collective", step)
        if skip is not None and skip.param("of") == "gradients":
            return "skip", skip
        if self._broken_step == step:
            return None  # one wrong collective per step: after it the group is broken anyway
        exchange = next(
            (i for i in self.exchanges if i.active(step, i.rank) and i.key not in self._fired_before), None
        )
        mismatch = self._active("collective_mismatch", step) or exchange
        if mismatch is None:
            return None
        self._broken_step = step
        return str(mismatch.param("what")), mismatch

"""meshscope inside a Hugging Face `Trainer` (and so Accelerate's DDP): one callback.

    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.add_callback(MeshscopeCallback(trainer, run_dir="runs/hf"))
    trainer.train()

Each optimizer step is a Monitor step: `forward` (the first micro-batch's forward), `backward`
(the rest, up to the optimizer), `optimizer`; its tokens are the `input_ids` the model was
given and its loss the mean of the model's own `loss` outputs, kept on the device. Given the
Trainer, the callback watches the model Accelerate wrapped (DDP), so gradient communication is
timed as in the Monitor SDK; without it, only the bare model is watched. The Monitor is built
when training begins (the Trainer has made the process group by then) and closed when it ends.
`transformers` is imported only by this module.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import TrainerCallback

from meshscope.collector.monitor import Monitor
from meshscope.collector.scope import OpenStep, batch_tokens


class MeshscopeCallback(TrainerCallback):
    """The Monitor SDK on a Trainer's hooks (module doc); `monitor_kwargs` go to
    `Monitor.from_env` (run_dir, metrics_port, ...) unless a `monitor` is given."""

    def __init__(self, trainer: Any = None, *, monitor: Monitor | None = None, **monitor_kwargs: Any) -> None:
        if monitor is None and "run_dir" not in monitor_kwargs:
            raise TypeError("MeshscopeCallback needs a monitor or a run_dir")
        self.trainer, self.monitor, self._kwargs = trainer, monitor, monitor_kwargs
        self._step: OpenStep | None = None
        self._losses: list[torch.Tensor] = []
        self._tokens = 0
        self._hooks: list[Any] = []

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        """Build the Monitor and watch the model the Trainer runs."""
        if self.monitor is None:
            self.monitor = Monitor.from_env(**self._kwargs)
        wrapped = getattr(self.trainer, "model_wrapped", None) if self.trainer is not None else None
        self.monitor.watch(wrapped if wrapped is not None else model)
        bare = model if model is not None else getattr(self.trainer, "model", None)
        self._hooks = [
            bare.register_forward_pre_hook(self._inputs, with_kwargs=True),
            bare.register_forward_hook(self._outputs),
        ]

    def _inputs(self, module: Any, args: tuple, kwargs: dict) -> None:
        if self._step is not None:
            self._tokens += batch_tokens(kwargs.get("input_ids", args[0] if args else kwargs))

    def _outputs(self, module: Any, args: tuple, output: Any) -> None:
        if self._step is None:
            return
        if not self._losses and "backward" not in self._step.scope.phases:
            self._step.phase("backward")  # the first forward is over
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if isinstance(loss, torch.Tensor):
            self._losses.append(loss.detach())

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """An optimizer step starts (its first micro-batch)."""
        self._step = OpenStep(self.monitor, step=state.global_step)
        self._step.phase("forward")
        self._losses, self._tokens = [], 0

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Backward (and clipping) is over: the optimizer runs."""
        if self._step is not None:
            self._step.phase("optimizer")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The optimizer step is over: the Monitor records it."""
        if self._step is None:
            return
        if self._losses:
            self._step.scope.log(loss=torch.stack(self._losses).mean())
        self._step.end(tokens=self._tokens)
        self._step = None

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Training is over: the run's end is written and the hooks come off."""
        for hook in self._hooks:
            hook.remove()
        if self.monitor is not None:
            self.monitor.close()

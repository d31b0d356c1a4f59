"""meshscope inside PyTorch Lightning: one callback.

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp",
                        callbacks=[MeshscopeCallback(run_dir="runs/lightning")])
    trainer.fit(model, data)

Each training batch is a Monitor step: `forward` (training_step), `backward`, `optimizer` (from
`on_before_optimizer_step` to the batch's end; a batch that only accumulates has none); its
loss is the one `training_step` returned, kept on the device, and its tokens are read from the
batch's shapes (`collector.scope.batch_tokens`). The model watched is the one the strategy runs
(DDP's wrapper under `strategy="ddp"`), so gradient communication is timed as in the Monitor
SDK. The Monitor is built when training starts (the strategy has made the process group) and
closed when it ends; an exception is recorded for the hang watchdog first. Lightning is
imported only by this module: `lightning.pytorch`, else the older `pytorch_lightning`.
"""

from __future__ import annotations

from typing import Any

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the standalone package of older installs
    from pytorch_lightning.callbacks import Callback

from meshscope.collector.monitor import Monitor
from meshscope.collector.scope import OpenStep, batch_tokens


class MeshscopeCallback(Callback):
    """The Monitor SDK on Lightning's hooks (module doc); `monitor_kwargs` go to
    `Monitor.from_env` (run_dir, metrics_port, ...) unless a `monitor` is given."""

    def __init__(self, *, monitor: Monitor | None = None, **monitor_kwargs: Any) -> None:
        if monitor is None and "run_dir" not in monitor_kwargs:
            raise TypeError("MeshscopeCallback needs a monitor or a run_dir")
        self.monitor, self._kwargs = monitor, monitor_kwargs
        self._step: OpenStep | None = None
        self._tokens = 0

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Build the Monitor and watch the model the strategy runs."""
        if self.monitor is None:
            self.monitor = Monitor.from_env(**self._kwargs)
        self.monitor.watch(trainer.strategy.model or pl_module)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        """A batch starts: its step, and the forward phase."""
        self._step = OpenStep(self.monitor)
        self._step.phase("forward")
        self._tokens = batch_tokens(batch)

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        """training_step returned: backward runs."""
        if self._step is not None:
            self._step.phase("backward")

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        """The gradients are ready: the optimizer runs."""
        if self._step is not None:
            self._step.phase("optimizer")

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """The batch is over: the Monitor records it with its loss."""
        if self._step is None:
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if loss is not None:
            self._step.scope.log(loss=loss)
        self._step.end(tokens=self._tokens)
        self._step = None

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """Say why this rank is going down (a culprit, not a victim, to the hang watchdog)."""
        if self.monitor is not None:
            self.monitor.fail(exception)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """Training is over: the run's end is written."""
        if self.monitor is not None:
            self.monitor.close()

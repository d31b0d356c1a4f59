"""The measurement SDK and the data contract of meshscope.

A user adds three lines to a torchrun loop::

    mon = Monitor.from_env(run_dir="runs/my-run")
    model = mon.watch(ddp_model)
    with mon.step(tokens=n) as s:
        ...
        s.log(loss=loss)

Nothing in this package imports another meshscope package.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

# Lazy (PEP 562): the store, the figures and the version are read by commands that never train
# (advise, explain, the view); importing the Monitor eagerly would load torch for each of them.
_HOME = {
    "DistEnv": "env",
    "DeviceProbe": "probe",
    "Event": "schema",
    "HostProbe": "probe",
    "Monitor": "monitor",
    "MonitorConfig": "monitor_config",
    "StepRecord": "schema",
}
__all__ = ["DistEnv", "DeviceProbe", "Event", "HostProbe", "Monitor", "MonitorConfig", "StepRecord"]

if TYPE_CHECKING:
    from meshscope.collector.env import DistEnv
    from meshscope.collector.monitor import Monitor
    from meshscope.collector.monitor_config import MonitorConfig
    from meshscope.collector.probe import DeviceProbe, HostProbe
    from meshscope.collector.schema import Event, StepRecord


def __getattr__(name: str) -> Any:
    """The SDK's names, imported on first use."""
    if name not in _HOME:
        raise AttributeError(f"module 'meshscope.collector' has no attribute {name!r}")
    return getattr(import_module(f"meshscope.collector.{_HOME[name]}"), name)

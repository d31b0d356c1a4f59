"""The measurement SDK and the data contract of meshscope.

A user adds three lines to a torchrun loop::

    mon = Monitor.from_env(run_dir="runs/my-run")
    model = mon.watch(ddp_model)
    with mon.step(tokens=n) as s:
        ...
        s.log(loss=loss)

Nothing in this package imports another meshscope package.
"""

from meshscope.collector.env import DistEnv
from meshscope.collector.monitor import Monitor
from meshscope.collector.monitor_config import MonitorConfig
from meshscope.collector.probe import DeviceProbe, HostProbe
from meshscope.collector.schema import Event, StepRecord

__all__ = ["DistEnv", "DeviceProbe", "Event", "HostProbe", "Monitor", "MonitorConfig", "StepRecord"]

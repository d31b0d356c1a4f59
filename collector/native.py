"""The Monitor's compiled part (`collector/csrc/`: untimed host steps, the forward watch and
the flight log's fixed records in C), configured once; None where no C compiler built it, and
then every step takes the Python path."""

from __future__ import annotations

from typing import Any

import torch

from meshscope.collector.flightread import HEADER_SIZE, RECORD, RECORD_HEAD, WRITTEN_OFFSET
from meshscope.collector.moe import WORK_ATTRIBUTE

fast: Any
try:
    from meshscope.collector import _fast as fast
except ImportError:  # built without a C compiler (setup.py marks the extension optional)
    fast = None
else:
    queue = torch.autograd.Variable._execution_engine.queue_callback  # the autograd engine's
    layout = (HEADER_SIZE, RECORD.size, RECORD_HEAD.size, WRITTEN_OFFSET)  # the flight log's
    fast.configure(torch.Tensor, torch.is_grad_enabled, queue, WORK_ATTRIBUTE, *layout)

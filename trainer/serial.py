"""Run a DDP comm hook's work one bucket at a time on a dedicated thread.

Hooks that issue collectives from completion callbacks (torch's PowerSGD) or in several
phases (our 1-bit) can deadlock on gloo: callbacks run on the process group's few worker
threads, block them while waiting for their next collective, and buckets interleave in
different orders on different ranks. One thread per hook, taking buckets in the order DDP
launches them (the same on every rank), makes the order identical everywhere while backward
keeps computing the next buckets.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

Work = Callable[[Any, "dist.GradBucket"], torch.Tensor]


def serial_hook(work: Work, name: str = "comm") -> Callable[..., torch.futures.Future]:
    """A DDP comm hook that runs `work(state, bucket) -> reduced tensor` on one thread."""
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"meshscope-{name}")

    def hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()

        def run() -> None:
            try:
                fut.set_result(work(state, bucket))
            except Exception as err:  # surfaces in DDP's wait instead of hanging the step
                fut.set_exception(err)

        executor.submit(run)
        return fut

    hook.__name__ = f"serial_{name}"
    hook.__annotations__ = {
        "state": object,
        "bucket": dist.GradBucket,
        "return": torch.futures.Future[torch.Tensor],
    }
    return hook


def wait_for(hook: Callable[[Any, dist.GradBucket], torch.futures.Future]) -> Work:
    """Adapt a future-returning hook into blocking work for `serial_hook`."""
    return lambda state, bucket: hook(state, bucket).wait()

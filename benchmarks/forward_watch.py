"""What watching a module's forward costs a call: a forward hook against the Monitor's wrapper
(`collector.comm.after_forward`) and against nothing, each call after a burst of compute (as a
training step calls the model: its caches cold), alternating, medians of many calls.

Any forward hook sends every call of the module through nn.Module's slow path; the wrapper is
one Python frame around `forward`. The module does nothing itself, so the figure is the
dispatch alone.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/forward_watch.py [--calls 3000]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _common import machine

from meshscope.collector.comm import after_forward


class Identity(torch.nn.Module):
    """A module whose forward does nothing: what remains is the call's dispatch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _noted(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
    """The watch's body, empty: the figure is the dispatch, not the work."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=3000)
    args = ap.parse_args()
    torch.set_num_threads(1)
    hooked, wrapped, bare = Identity(), Identity(), Identity()
    hooked.register_forward_hook(_noted)
    after_forward(wrapped, _noted)
    a, b, x = torch.randn(256, 256), torch.randn(256, 256), torch.zeros(1)
    times: dict[str, list[float]] = {"forward hook": [], "wrapper": [], "none": []}
    modules = dict(zip(times, (hooked, wrapped, bare), strict=True))
    for i in range(args.calls):
        for name in list(times)[i % 3 :] + list(times)[: i % 3]:
            for _ in range(20):  # the step's compute between two calls
                a @ b
            start = time.perf_counter_ns()
            modules[name](x)
            times[name].append(time.perf_counter_ns() - start)
    print(f"# {machine()}; {args.calls} calls each, alternating, after 20 matmuls of 256x256")
    for name, ns in times.items():
        median, mean = statistics.median(ns) / 1e3, statistics.fmean(ns) / 1e3
        print(f"{name:>13}: median {median:6.1f} us, mean {mean:6.1f} us")


if __name__ == "__main__":
    main()

"""Which step of the warm standby's warm-up leaves a forked child unable to start CUDA, for a
lent GPU: after each step a throw-away child starts the runtime. `python3 benchmarks/fork_probe.py`."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def child_can_init() -> str:
    pid = os.fork()
    if pid == 0:
        import torch

        try:
            torch._C._cuda_init()
            os._exit(0)
        except Exception as err:  # noqa: BLE001
            print(f"    child: {type(err).__name__}: {str(err).splitlines()[0]}", flush=True)
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    return "ok" if os.WEXITSTATUS(status) == 0 else "POISONED"


def main() -> None:
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import torch

    print("import torch:", child_can_init(), flush=True)
    import meshscope.trainer.worker  # noqa: F401

    print("import worker:", child_can_init(), "is_initialized", torch.cuda.is_initialized(), flush=True)
    layer = torch.nn.Linear(4, 4)
    print("Linear:", child_can_init(), flush=True)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-3, fused=True)
    print("AdamW(fused=True):", child_can_init(), flush=True)
    layer(torch.ones(1, 4)).sum().backward()
    print("forward+backward:", child_can_init(), flush=True)
    opt.step()
    print("opt.step():", child_can_init(), "is_initialized", torch.cuda.is_initialized(), flush=True)


if __name__ == "__main__":
    main()

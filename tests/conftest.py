import os
import shutil

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def require_binary(name: str) -> str:
    """Path of a server binary. Missing under CI is a failure (make test installs it), never a skip."""
    path = shutil.which(name)
    if path:
        return path
    if os.environ.get("CI") == "true":
        pytest.fail(f"{name} is not installed; `make test` installs it via scripts/install-system-deps.sh")
    pytest.skip(f"{name} not installed (run `make test` to install it)")

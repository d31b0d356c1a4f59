import os
import shutil

from fixtures.servers import missing

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def require_binary(name: str) -> str:
    """Path of a server binary. Missing under `make test` or CI is a failure (make test installs
    it), never a skip."""
    path = shutil.which(name)
    if path:
        return path
    missing(f"{name} is not installed")

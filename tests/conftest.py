import os
import shutil

from hypothesis import settings

from fixtures.servers import missing

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

# Property tests draw the same examples on every run, so `make test` passes or fails the same
# way twice; `HYPOTHESIS_PROFILE=explore` draws fresh ones, to hunt for new counterexamples.
settings.register_profile("ci", derandomize=True, database=None)
settings.register_profile("explore", database=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def require_binary(name: str) -> str:
    """Path of a server binary. Missing under `make test` or CI is a failure (make test installs
    it), never a skip."""
    path = shutil.which(name)
    if path:
        return path
    missing(f"{name} is not installed")

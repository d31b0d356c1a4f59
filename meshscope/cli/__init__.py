"""The `meshscope` command line, one module per command group: parse, build, run, close.

The commands register on one Typer app as their modules are imported; the work lives in the rooms.
"""

import contextlib
import logging
import os
import sys
import threading

from meshscope.cli import advise, boards, detect, explain, feedback, hang, replay, run, settings, stack, view  # noqa: F401
from meshscope.cli.common import app
from meshscope.cli.settings import apply_set_options, config_fields

__all__ = ["app", "apply_set_options", "config_fields", "main"]
CPP_LOG_QUIETED = "MESHSCOPE_QUIETED_TORCH_CPP_LOG"  # set beside it: the workers get the user's level


def _quiet_cpp_logs() -> None:
    """This process's TCPStore clients meet stores that come and go (another node's agent, a
    rendezvous not up yet): torch logs each with dozens of C++ frames, for what meshscope
    handles and says in one line. Its warnings stay off here unless the user set the level;
    the launcher gives the workers the user's environment back."""
    if "TORCH_CPP_LOG_LEVEL" not in os.environ:
        os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
        os.environ[CPP_LOG_QUIETED] = "1"


def main() -> None:
    """The `meshscope` command: the app, then a prompt exit. Unwinding torch, pandas and
    scikit-learn at interpreter exit costs over a second per command and saves nothing: every
    store and file is closed by the command itself, and threads still working are waited for."""
    _quiet_cpp_logs()
    try:
        app()
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        if isinstance(done.code, str):
            print(done.code, file=sys.stderr)
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a reader that went away
            stream.flush()
    os._exit(code)

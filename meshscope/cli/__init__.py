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


def main() -> None:
    """The `meshscope` command: the app, then a prompt exit. Unwinding torch, pandas and
    scikit-learn at interpreter exit costs over a second per command and saves nothing: every
    store and file is closed by the command itself, and threads still working are waited for."""
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

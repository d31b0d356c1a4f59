"""The `meshscope` command line, one module per command group: parse, build, run, close.

The commands register on one Typer app as their modules are imported; the work lives in the rooms.
"""

from meshscope.cli import boards, detect, explain, feedback, hang, replay, run, settings, stack, view  # noqa: F401
from meshscope.cli.common import app
from meshscope.cli.settings import apply_set_options, config_fields

__all__ = ["app", "apply_set_options", "config_fields"]

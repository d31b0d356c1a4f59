"""The composition root: the CLI and the launcher that wire the packages together."""
__version__ = "0.1.0"

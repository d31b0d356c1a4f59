"""The composition root: the CLI and the launcher that wire the packages together."""

from meshscope.collector.version import VERSION as __version__  # noqa: F401  (one source)

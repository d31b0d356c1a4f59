"""meshscope's version, said once: the package metadata, `meshscope_run_info` and the CLI read it."""

VERSION = "0.1.0"

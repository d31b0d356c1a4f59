"""meshscope: observability and debugging for distributed (MoE) training.

One import name; each room is a folder at the repository root, installed as `meshscope.<room>`
(setuptools `package-dir`). This folder is the composition root: the CLI, the run config, the
sidecar and the launcher that wire the rooms together."""

from pathlib import Path as _Path

# A source checkout run without installing (PYTHONPATH=<checkout>): the rooms are this folder's
# siblings, so look for submodules there too, as the installed package-dir mapping would.
_ROOT = _Path(__file__).resolve().parent.parent
if (_ROOT / "collector" / "__init__.py").is_file() and str(_ROOT) not in __path__:
    __path__.append(str(_ROOT))

from meshscope.collector.version import VERSION as __version__  # noqa: E402, F401  (one source)

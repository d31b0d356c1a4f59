"""meshscope: observability and debugging for distributed (MoE) training.

One import name; each room is a folder at the repository root, installed as `meshscope.<room>`
(setuptools `package-dir`). This folder is the composition root: the CLI, the run config, the
sidecar and the launcher that wire the rooms together."""

import importlib.abc as _abc
import importlib.util as _util
import sys as _sys
from pathlib import Path as _Path

_ROOT = _Path(__file__).resolve().parent.parent


def _checkout_rooms() -> dict[str, _Path]:
    """In a source checkout: `meshscope.<room>` -> its folder, for exactly the rooms pyproject
    installs (the one list of them); {} for an installed wheel (the rooms are inside)."""
    pyproject = _ROOT / "pyproject.toml"
    if not (_ROOT / "collector" / "__init__.py").is_file() or not pyproject.is_file():
        return {}
    import tomllib

    mapping = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-dir"]
    return {name: _ROOT / folder for name, folder in mapping.items() if name.startswith("meshscope.")}


class _CheckoutRooms(_abc.MetaPathFinder):
    """Finds the rooms beside the `meshscope` folder that was imported, as an install maps
    them: the same tree's rooms, whichever checkout (an uninstalled one, or a second one while
    another is installed); nothing else of the checkout (its tests, fixtures, benchmarks)
    becomes importable as `meshscope.<folder>`."""

    def __init__(self, rooms: dict[str, _Path]) -> None:
        self.rooms = rooms

    def find_spec(self, name: str, path: object = None, target: object = None) -> object:
        """The room's package spec, or None for anything else."""
        folder = self.rooms.get(name)
        if folder is None:
            return None
        return _util.spec_from_file_location(
            name, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )


if not any(isinstance(f, _CheckoutRooms) for f in _sys.meta_path) and (_rooms := _checkout_rooms()):
    _sys.meta_path.insert(0, _CheckoutRooms(_rooms))

from meshscope.collector.version import VERSION as __version__  # noqa: E402, F401  (one source)

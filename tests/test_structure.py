"""House rules, checked: no module over 500 lines and no function over 60 in the rooms, and a
docstring on every public module, class and function (what it is for)."""

import ast
import importlib
import inspect
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
# the rooms, read from the one list that says what installs (pyproject's packages), and the
# composition root
PACKAGES = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
ROOMS = sorted({name.split(".")[1] for name in PACKAGES if name.count(".") == 1} - {"cli"}) + ["meshscope"]
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 500, 60


def sources() -> list[Path]:
    """Every Python file of the rooms."""
    return sorted(p for room in ROOMS for p in (REPO / room).rglob("*.py"))


def _public(name: str) -> bool:
    return not name.startswith("_")


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    parts = parts[1:] if parts[0] == "meshscope" else parts
    name = ".".join(("meshscope", *parts))
    return name.removesuffix(".__init__")


def missing_docstrings(path: Path) -> list[str]:
    """Public names defined in `path` without a docstring. A method may inherit its docstring
    from the base class or protocol it implements (`inspect.getdoc`); a Streamlit page and an
    entry point are scripts and need only their module docstring."""
    tree = ast.parse(path.read_text())
    out = [] if ast.get_docstring(tree) else ["<module>"]
    if "screens" in path.parts or path.name in ("__main__.py", "app.py"):
        return out
    module = importlib.import_module(_module_name(path))
    # a class's own docstring, as written: `inspect.getdoc` would take the signature
    # `@dataclass` generates, or a base class's text, for one
    written = {node.name: ast.get_docstring(node) for node in tree.body if isinstance(node, ast.ClassDef)}
    for name, obj in vars(module).items():
        if not _public(name) or getattr(obj, "__module__", None) != module.__name__:
            continue
        if not (inspect.isfunction(obj) or inspect.isclass(obj)):
            continue
        if not (written.get(name) if inspect.isclass(obj) and name in written else inspect.getdoc(obj)):
            out.append(name)
        if inspect.isclass(obj):
            for attr, member in vars(obj).items():
                member = getattr(member, "__func__", member)
                if isinstance(member, property):
                    member = member.fget
                if _public(attr) and inspect.isfunction(member) and not inspect.getdoc(getattr(obj, attr)):
                    out.append(f"{name}.{attr}")
    return out


def test_no_module_is_too_long():
    long = {
        str(p.relative_to(REPO)): n
        for p in sources()
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"split these (>{MAX_MODULE_LINES} lines): {long}"


def test_no_function_is_too_long():
    long = {}
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(REPO)}:{node.name}"] = n
    assert not long, f"split these (>{MAX_FUNCTION_LINES} lines): {long}"


@pytest.mark.parametrize("room", ROOMS)
def test_every_public_name_says_why_it_exists(room):
    missing = {
        str(p.relative_to(REPO)): names
        for p in (REPO / room).rglob("*.py")
        if (names := missing_docstrings(p))
    }
    assert not missing, missing

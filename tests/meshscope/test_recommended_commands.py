"""Every `meshscope ...` command that a message, a page or the README recommends exists, with
the options it names."""

from __future__ import annotations

import re
import shlex

import pytest
import typer.main

from fixtures.runs import REPO
from meshscope.cli import app

ROOMS = (
    "alerts",
    "collector",
    "dashboards",
    "detectors",
    "explain",
    "feedback",
    "meshscope",
    "tracer",
    "trainer",
    "view",
    "watchdog",
)
QUOTED = re.compile(r"`(meshscope [^`]+)`")


def _recommendations() -> list[tuple[str, str]]:
    found = []
    sources = [p for room in ROOMS for p in (REPO / room).rglob("*.py")] + [REPO / "README.md"]
    for path in sources:
        text = path.read_text()
        if path.suffix == ".py":  # f-strings split over lines: join adjacent literals first
            text = re.sub(r'"\s*\n\s*f?"', "", text)
        for command in QUOTED.findall(text):
            found.append((f"{path.relative_to(REPO)}", re.sub(r"\{[^}]*\}", "X", command)))
    return found


def _check(command: str) -> None:
    words = shlex.split(command.replace("...", "").replace("…", ""))[1:]
    alternatives = next((w for w in words if "|" in w and not w.startswith("-")), None)
    if alternatives:  # `meshscope stack up|down|status`: each of them
        for choice in alternatives.split("|"):
            _check(command.replace(alternatives, choice, 1))
        return
    cmd = typer.main.get_command(app)
    while hasattr(cmd, "list_commands") and words and not words[0].startswith("-"):
        sub = cmd.get_command(typer.Context(cmd), words[0])
        assert sub is not None, f"no command {words[0]!r} in {command!r}"
        cmd, words = sub, words[1:]
    names = {opt for param in cmd.params for opt in (*param.opts, *param.secondary_opts)}
    for word in words:
        if word.startswith("--"):
            assert word.split("=")[0] in names, f"{command!r}: {cmd.name} has no {word.split('=')[0]}"


RECOMMENDED = _recommendations()


def test_the_sources_recommend_commands_at_all():
    assert len(RECOMMENDED) > 20  # the scan finds them: a broken regex would pass everything


@pytest.mark.parametrize("where,command", RECOMMENDED, ids=[f"{w}:{c}"[:80] for w, c in RECOMMENDED])
def test_a_recommended_command_exists(where, command):
    _check(command)

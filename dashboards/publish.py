"""Upload the generated boards to a running Grafana through its HTTP API (grafana-client).

The token is read from a file and handed to grafana-client only: never printed, never logged.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from grafana_client import GrafanaApi
from grafana_client.client import GrafanaClientError

from meshscope.dashboards.boards import build_all

FOLDER_UID, FOLDER_TITLE = "meshscope", "meshscope"


class PublishError(RuntimeError):
    """Grafana refused or could not be reached; the message says which board and why."""


@dataclass
class Published:
    """A board that reached Grafana: what to link to."""

    name: str
    uid: str
    url: str
    version: int | None


def read_token(path: Path) -> str:
    """A Grafana token from its file; PublishError naming the file otherwise."""
    try:
        token = Path(path).read_text().strip()
    except OSError as err:
        raise PublishError(f"--token-file: cannot read {path}: {err.strerror}") from err
    if not token:
        raise PublishError(f"--token-file: {path} is empty")
    return token


def publish(url: str, token: str, *, timeout_s: float = 10.0) -> list[Published]:
    """Create the `meshscope` folder if missing, then upsert every board into it."""
    api = GrafanaApi.from_url(url, credential=token, timeout=timeout_s)
    try:
        try:
            api.folder.get_folder(FOLDER_UID)
        except GrafanaClientError as err:
            if err.status_code != 404:
                raise
            api.folder.create_folder(FOLDER_TITLE, uid=FOLDER_UID)
        out = []
        for name, board in build_all().items():
            answer = api.dashboard.update_dashboard(
                {
                    "dashboard": {**board, "id": None},
                    "folderUid": FOLDER_UID,
                    "overwrite": True,
                    "message": "meshscope dashboards publish",
                }
            )
            out.append(
                Published(
                    name,
                    answer.get("uid", board["uid"]),
                    url.rstrip("/") + answer.get("url", ""),
                    answer.get("version"),
                )
            )
        return out
    except GrafanaClientError as err:
        said = err.response.get("message") if isinstance(err.response, dict) else None
        raise PublishError(
            f"Grafana at {url} answered {err.status_code}: {err.message}" + (f" ({said})" if said else "")
        ) from err
    except Exception as err:  # connection refused, timeouts: one clear line, not a traceback
        raise PublishError(f"Grafana at {url} could not be reached: {type(err).__name__}: {err}") from err

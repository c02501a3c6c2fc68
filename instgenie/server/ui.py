"""The web editor (instgenie/ui/: index.html, editor.js, editor.css) at `/` and `/ui/...`.

Static files shipped as package data: no build step, nothing fetched at run time. The page's
Content-Security-Policy allows only this origin (`default-src 'self'`; images also from `blob:`
and `data:` URLs the page makes itself), so the browser itself refuses any request to another
host. The page uses only the public native API, through relative URLs.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from starlette.staticfiles import StaticFiles

UI_DIR = Path(__file__).resolve().parents[1] / "ui"

CSP = (
    "default-src 'self'; img-src 'self' blob: data:; script-src 'self'; style-src 'self'; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


class _Assets(StaticFiles):
    """The page's files with the page's headers: no-cache (an upgrade never mixes an old module
    with a new page), nosniff, and the CSP on whatever is opened directly."""

    async def get_response(self, path: str, scope):  # noqa: ANN001, ANN201 - starlette's
        response = await super().get_response(path, scope)
        response.headers.update(HEADERS)
        return response


def mount_ui(app: FastAPI) -> None:
    """Serve the editor: the page at `/`, its module and style sheet under `/ui/`."""

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def editor_page() -> FileResponse:
        return FileResponse(UI_DIR / "index.html", media_type="text/html", headers=HEADERS)

    app.mount("/ui", _Assets(directory=UI_DIR), name="ui")

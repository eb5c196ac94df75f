"""The chat page of ``lmforge serve``: ``GET /`` answers a single-page chat UI over the server's own
``/v1`` API.

The page is plain HTML, CSS and JavaScript shipped in ``lmforge/serve/static`` (no build step, no
framework, no external URL: it works offline). Only the files named in ``ASSETS`` are served, by
name, so no request path can reach another file. The Content-Security-Policy lets the page load
nothing but its own files and talk to nothing but this server; model text is only ever put in the
page as text (never as HTML), and the policy would block an injected script anyway.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

STATIC = Path(__file__).with_name("static")
PAGE = "index.html"
ASSETS = {"chat.css": "text/css; charset=utf-8", "chat.js": "text/javascript; charset=utf-8"}
HEADERS = {
    "Cache-Control": "no-cache",  # revalidate: an upgraded lmforge serves its new page at once
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "Referrer-Policy": "no-referrer",
}


def add_chat_page(app: FastAPI) -> None:
    """``GET /`` (the page) and ``GET /static/NAME`` (its script and style sheet). The files are read
    once, here: a package installed without them fails when the server starts, not in a browser."""
    files = {name: (STATIC / name).read_bytes() for name in (PAGE, *ASSETS)}

    @app.get("/", include_in_schema=False)
    async def chat_page():
        return Response(files[PAGE], media_type="text/html; charset=utf-8", headers=HEADERS)

    @app.get("/static/{name}", include_in_schema=False)
    async def chat_asset(name: str):
        if name not in ASSETS:
            raise StarletteHTTPException(404)
        return Response(files[name], media_type=ASSETS[name], headers=HEADERS)

"""The pages and their files, read from the package with importlib.resources (no CDN, no build step),
and the headers they go out with."""
from __future__ import annotations

from functools import lru_cache
from importlib import resources

from inferd.web.style import theme_css

# Scripts and styles from this origin only, no inline script or style: model output that slipped
# into the DOM as markup could still not run. No framing (clickjacking of the stop button).
CSP = ("default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; form-action 'none'; "
       "frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
           "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}
PAGES = {"/": "chat.html", "/dashboard": "dashboard.html"}
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8"}


def is_public(path: str) -> bool:
    """The pages and their files carry no data: they load without the API key."""
    return path in PAGES or path.startswith("/static/")


@lru_cache(maxsize=None)
def asset(name: str) -> tuple[bytes, str] | None:
    """A page file's bytes and content type, or None if there is no such file. Only plain names of
    the package's own files: no paths."""
    if name == "theme.css":  # the role colours shared with the bench's reports (inferd.web.style)
        return theme_css().encode(), TYPES[".css"]
    ext = name[name.rfind("."):] if "." in name else ""
    if "/" in name or "\\" in name or name.startswith(".") or ext not in TYPES:
        return None
    f = resources.files("inferd.web") / "static" / name
    return (f.read_bytes(), TYPES[ext]) if f.is_file() else None

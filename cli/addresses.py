"""Where the parts of a local system answer, as the commands print and reach them."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

_ANY_ADDRESS = ("0.0.0.0", "::", "")
LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}


def api_base_url(host: str, port: int) -> str:
    """The URL a client on this machine uses for an API listening on `host`:`port`."""
    if host in _ANY_ADDRESS:
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


def redacted(url: str) -> str:
    """The URL without its password (for printing)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}{port}"))

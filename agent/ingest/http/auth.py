"""Who may change topics: the management token, and refusing cross-site requests.

Topic management is closed by default. A call that changes something (POST, PUT, DELETE
under ``/topics``) needs ``Authorization: Bearer <token>``; with no token configured
anywhere, such calls are refused outright. Reading (``GET /topics``) stays open to clients
on loopback; others need the token for it too.

The token comes from, in order: ``http.management_token``; the first line of
``http.management_token_file``; the systemd credential ``management-token`` (the packaged
unit loads /etc/ferry/management.token, which the package creates at install, readable by
root and the ``ferry-admin`` group only). ``ferry topics ...`` reads the same file.

A web page in an operator's browser can send a POST without a preflight (no Content-Type);
a token stops it only if the browser does not hold one, so every mutating call is also
refused when the browser says it comes from another site: ``Sec-Fetch-Site`` other than
``same-origin``/``none``, or an ``Origin`` whose host is not the request's ``Host``.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from pathlib import Path
from urllib.parse import urlsplit

from agent.config import HttpConfig
from agent.ingest.http.errors import Refusal

# Where the package puts the token (packaging/scripts/postinstall.sh) and the CLI looks.
DEFAULT_TOKEN_FILE = Path("/etc/ferry/management.token")
CREDENTIAL = "management-token"
MUTATING = frozenset({"POST", "PUT", "DELETE", "PATCH"})


class Refused(Refusal):
    """The caller may not change topics (no token, a wrong one, or a cross-site request)."""


def read_token_file(path: Path) -> str | None:
    """The token in ``path`` (its first line), or None if there is none."""
    try:
        line = path.read_text(encoding="utf-8").splitlines()
    except (FileNotFoundError, PermissionError, IsADirectoryError):
        return None
    token = line[0].strip() if line else ""
    return token or None


def management_token(cfg: HttpConfig) -> str | None:
    """The token mutating management calls need (see the module's docstring)."""
    if cfg.management_token:
        return cfg.management_token
    if cfg.management_token_file is not None:
        token = read_token_file(cfg.management_token_file)
        if token is None:
            raise ValueError(f"http.management_token_file {cfg.management_token_file} "
                             "holds no token (missing, unreadable or empty)")
        return token
    credentials = os.environ.get("CREDENTIALS_DIRECTORY")
    if credentials:
        return read_token_file(Path(credentials) / CREDENTIAL)
    return None


def check(method: str, headers: dict[str, str], client_host: str | None,
          token: str | None) -> None:
    """Raise ``Refused`` unless this management call may go ahead. ``headers``: lower-case
    names."""
    mutating = method in MUTATING
    if mutating:
        _same_site(headers)
    elif client_host is not None and _loopback(client_host):
        return  # reading, from this host
    if token is None:
        if not mutating:
            return  # reading, with no token anywhere to ask for
        raise Refused(403, "management_locked",
                      "topic management is closed: no management token is configured "
                      "(http.management_token, http.management_token_file, or the "
                      f"packaged {DEFAULT_TOKEN_FILE})")
    scheme, _, credentials = headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
            credentials.strip().encode(), token.encode()):
        raise Refused(401, "unauthorized",
                      "topic management needs Authorization: Bearer <management token>",
                      {"WWW-Authenticate": 'Bearer realm="ferry"'})


def _same_site(headers: dict[str, str]) -> None:
    fetch_site = headers.get("sec-fetch-site")
    if fetch_site is not None and fetch_site.strip().lower() not in ("same-origin", "none"):
        raise Refused(403, "cross_site",
                      f"cross-site requests may not change topics (Sec-Fetch-Site: "
                      f"{fetch_site[:40]})")
    origin = headers.get("origin")
    if origin is not None:
        host = headers.get("host", "").strip().lower()
        origin_host = urlsplit(origin.strip()).netloc.lower() if origin != "null" else ""
        if not origin_host or origin_host != host:
            raise Refused(403, "cross_site",
                          f"cross-site requests may not change topics (Origin: "
                          f"{origin[:80]}, Host: {host[:80]})")


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False

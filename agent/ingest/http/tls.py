"""The HTTPS listener's TLS settings (``http.tls_*``): its ``ssl.SSLContext``, built at start
and rebuilt when its files change (``TlsFiles``).

TLS is the standard library's (``ssl``, OpenSSL) in Ferry's own layer over the TCP transport
(tls_stream.py); the HTTP on top of it is the same protocol, limits and connection cap as
the plain listener's (protocol.py). What TLS changes:

- TLS 1.2 at least; ALPN offers ``http/1.1`` only (Ferry speaks no HTTP/2).
- With ``tls_client_ca_file`` a client must present a certificate one of those CAs signed
  (mTLS); a handshake without one fails, before any request is read.
- The TCP connection is admitted under the connection cap first, and TLS started on it
  (``tls_stream.start_tls``, from ``HttpProtocol.connection_made``), so a handshake in
  progress counts against the cap, can be closed to make room like any waiting
  connection, and must finish within the headers' deadline (``header_timeout_seconds``,
  from the connection's start). uvloop's own TLS listener would hide handshakes from the protocol
  until they finish: a flood of them would hold descriptors beyond the cap.
- Bytes that are not TLS (plain HTTP on this port) are never parsed as requests: the
  handshake fails on them and the connection closes, nothing stored.
- The certificate, key and client CA files are looked at every ``CHECK_SECONDS``
  (``TlsFiles.refresh``): when one changed, a new context is built and new connections
  get it; open ones keep theirs. Files that do not load (a key written before its
  certificate, a half-copied file) leave the current context serving, with a warning, and
  are tried again when they change again. So a renewed certificate needs no restart.
- A client's ``close_notify``, or its TCP FIN, ends only its sending side, as a FIN does
  over plain HTTP: the requests it sent whole are answered, then Ferry sends its own
  ``close_notify`` and closes (tls_stream.py; asyncio's TLS transport closed at once, and
  the answers were lost).
"""

from __future__ import annotations

import logging
import os
import ssl
from pathlib import Path

log = logging.getLogger(__name__)

CHECK_SECONDS = 10.0  # how often the files are looked at (three stat calls)

# A file as last seen: (device, inode, size, modification time in ns), or None if missing.
# A replacement by rename (what certificate managers do) changes the inode; an edit in
# place the size or the time.
_Seen = tuple[int, int, int, int] | None


class TlsConfigError(Exception):
    """The certificate, key or client CA cannot be loaded; the message says which file."""


def server_context(cert_file: Path, key_file: Path, client_ca_file: Path | None
                   ) -> ssl.SSLContext:
    """The listener's context; raises TlsConfigError naming the file that does not load."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["http/1.1"])
    try:
        context.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:
        raise TlsConfigError(f"cannot load the TLS certificate {cert_file} with the key "
                             f"{key_file} (http.tls_cert_file, http.tls_key_file): "
                             f"{exc}") from None
    if client_ca_file is not None:
        try:
            context.load_verify_locations(cafile=client_ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise TlsConfigError(f"cannot load the client CA certificates {client_ca_file} "
                                 f"(http.tls_client_ca_file): {exc}") from None
        context.verify_mode = ssl.CERT_REQUIRED
    return context


class TlsFiles:
    """The listener's context, built from its files and rebuilt when they change."""

    def __init__(self, cert_file: Path, key_file: Path, client_ca_file: Path | None) -> None:
        self.files = (cert_file, key_file, client_ca_file)
        self._seen = self._look()
        self.context = server_context(cert_file, key_file, client_ca_file)  # may raise

    def _look(self) -> tuple[_Seen, ...]:
        return tuple(_seen(f) for f in self.files if f is not None)

    def refresh(self) -> bool:
        """Rebuild the context if a file changed since last looked at; True if it was.
        Files that do not load keep the current context (logged once per change)."""
        seen = self._look()
        if seen == self._seen:
            return False
        self._seen = seen
        cert_file, key_file, client_ca_file = self.files
        try:
            context = server_context(cert_file, key_file, client_ca_file)
        except TlsConfigError as exc:
            log.warning("HTTPS: the TLS files changed but do not load; new connections keep "
                        "the certificate loaded before (tried again when they change): %s",
                        exc)
            return False
        self.context = context
        log.info("HTTPS: the TLS files changed; new connections use the certificate in %s",
                 cert_file)
        return True


def _seen(path: Path) -> _Seen:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


"""Certificates made by a test: a CA, a server certificate for 127.0.0.1/localhost, client
certificates, with the ``openssl`` command line (the venv has no ``cryptography``).

Everything is PEM, because both ends take PEM: librdkafka (``ssl.ca.location``,
``ssl.certificate.location``, ``ssl.key.location``) and Kafka 4 (``ssl.keystore.type=PEM``,
a file holding the private key and the certificate chain; ``ssl.truststore.type=PEM``).
Keys are unencrypted PKCS#8 (``BEGIN PRIVATE KEY``), the only unencrypted form Kafka's PEM
keystore reads. EC P-256 keys: made in milliseconds, where RSA takes a noticeable while on a
loaded machine.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

DAYS = "2"  # long enough for any test run, short enough to be obviously a test's


def _openssl(*args: str, cwd: Path) -> None:
    done = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed:\n{done.stderr}")


def _new_key(path: Path) -> None:
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256",
             "-out", str(path), cwd=path.parent)


@dataclass(frozen=True)
class Issued:
    """A key and the certificate a CA signed for it; ``keystore`` holds both (Kafka's PEM
    keystore: the key, then the chain)."""

    key: Path
    cert: Path
    keystore: Path


class CertificateAuthority:
    """A self-signed CA under ``root/<name>``, issuing server and client certificates."""

    def __init__(self, root: Path, name: str = "ferry-test-ca") -> None:
        self.dir = root / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.key = self.dir / "ca.key"
        self.cert = self.dir / "ca.pem"
        _new_key(self.key)
        _openssl("req", "-x509", "-new", "-key", str(self.key), "-out", str(self.cert),
                 "-days", DAYS, "-subj", f"/CN={name}",
                 "-addext", "basicConstraints=critical,CA:TRUE",
                 "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=self.dir)

    def issue(self, name: str, *, server: bool) -> Issued:
        """A certificate for ``name``: a server one valid for 127.0.0.1 and localhost (what
        librdkafka's hostname check, on by default, compares), or a client one."""
        key = self.dir / f"{name}.key"
        csr = self.dir / f"{name}.csr"
        cert = self.dir / f"{name}.pem"
        ext = self.dir / f"{name}.ext"
        _new_key(key)
        _openssl("req", "-new", "-key", str(key), "-out", str(csr), "-subj", f"/CN={name}",
                 cwd=self.dir)
        lines = ["basicConstraints=critical,CA:FALSE",
                 "keyUsage=critical,digitalSignature,keyEncipherment"]
        if server:
            lines += ["extendedKeyUsage=serverAuth",
                      "subjectAltName=IP:127.0.0.1,DNS:localhost"]
        else:
            lines += ["extendedKeyUsage=clientAuth"]
        ext.write_text("\n".join(lines) + "\n")
        _openssl("x509", "-req", "-in", str(csr), "-CA", str(self.cert), "-CAkey",
                 str(self.key), "-CAcreateserial", "-out", str(cert), "-days", DAYS,
                 "-extfile", str(ext), cwd=self.dir)
        keystore = self.dir / f"{name}.keystore.pem"
        keystore.write_text(key.read_text() + cert.read_text() + self.cert.read_text())
        return Issued(key, cert, keystore)

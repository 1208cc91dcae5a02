"""Throwaway certificate authorities for tests: made with the ``openssl`` CLI (the
``cryptography`` package is not a dependency) into a directory the test owns. EC P-256
keys, one day of validity; a server certificate names ``localhost`` and ``127.0.0.1``."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

_EC = "-newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes"


def _openssl(command: str, cwd: Path) -> None:
    """``openssl`` with ``command``'s words (no word holds a space here)."""
    args = ["openssl", *command.split()]  # names are checked by _plain: one word each
    subprocess.run(args, cwd=cwd, check=True, capture_output=True, timeout=30)


def _plain(name: str) -> str:
    if not name or any(c.isspace() or c == "/" for c in name):
        raise ValueError(f"a certificate name is one word without '/': {name!r}")
    return name


@dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path

    def pem(self) -> tuple[bytes, bytes]:
        return self.key.read_bytes(), self.cert.read_bytes()


@dataclass(frozen=True)
class ScratchCA:
    """A certificate authority in ``root``: ``ca.crt`` and ``ca.key``."""

    root: Path
    name: str

    @property
    def cert(self) -> Path:
        return self.root / f"{self.name}.crt"

    @classmethod
    def make(cls, root: Path, name: str = "ca") -> ScratchCA:
        _plain(name)
        root.mkdir(parents=True, exist_ok=True)
        _openssl(
            f"req -x509 {_EC} -keyout {name}.key -out {name}.crt -days 1 -subj /CN={name}", root
        )
        return cls(root, name)

    def issue(self, cn: str, server: bool = False) -> Issued:
        """A certificate for ``cn`` signed by this authority (``server``: with the
        loopback names as subjectAltNames)."""
        stem = f"{self.name}-{_plain(cn)}"
        _openssl(f"req {_EC} -keyout {stem}.key -out {stem}.csr -subj /CN={cn}", self.root)
        ext = self.root / f"{stem}.ext"
        names = "DNS:localhost,IP:127.0.0.1" if server else f"DNS:{cn}"
        usage = "serverAuth" if server else "clientAuth"
        ext.write_text(f"subjectAltName={names}\nextendedKeyUsage={usage}\n")
        signing = f"-CA {self.cert.name} -CAkey {self.name}.key -CAcreateserial"
        _openssl(
            f"x509 -req -in {stem}.csr {signing} -out {stem}.crt -days 1 -extfile {ext.name}",
            self.root,
        )
        return Issued(self.root / f"{stem}.crt", self.root / f"{stem}.key")

"""Throwaway certificate authorities for tests: made with the ``openssl`` CLI (the
``cryptography`` package is not a dependency) into a directory the test owns. EC P-256
keys, one day of validity; a server certificate names ``localhost`` and ``127.0.0.1``."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


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
        root.mkdir(parents=True, exist_ok=True)
        _openssl(
            "req", "-x509", *_EC, "-keyout", f"{name}.key", "-out", f"{name}.crt",
            "-days", "1", "-subj", f"/CN={name}", cwd=root,
        )  # fmt: skip
        return cls(root, name)

    def issue(self, cn: str, server: bool = False) -> Issued:
        """A certificate for ``cn`` signed by this authority (``server``: with the
        loopback names as subjectAltNames)."""
        stem = f"{self.name}-{cn}"
        _openssl(
            "req", *_EC, "-keyout", f"{stem}.key", "-out", f"{stem}.csr", "-subj", f"/CN={cn}",
            cwd=self.root,
        )  # fmt: skip
        ext = self.root / f"{stem}.ext"
        names = "DNS:localhost,IP:127.0.0.1" if server else f"DNS:{cn}"
        usage = "serverAuth" if server else "clientAuth"
        ext.write_text(f"subjectAltName={names}\nextendedKeyUsage={usage}\n")
        _openssl(
            "x509", "-req", "-in", f"{stem}.csr", "-CA", self.cert.name,
            "-CAkey", f"{self.name}.key", "-CAcreateserial", "-out", f"{stem}.crt",
            "-days", "1", "-extfile", ext.name, cwd=self.root,
        )  # fmt: skip
        return Issued(self.root / f"{stem}.crt", self.root / f"{stem}.key")

"""Self-signed certificates for tests of TLS."""

from __future__ import annotations

import subprocess
from pathlib import Path


def self_signed(folder: Path, addresses: list[str]) -> tuple[Path, Path]:
    """(certificate, key) in `folder`, self-signed for `addresses` (IP addresses), made with
    the openssl command."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    names = ",".join(f"IP:{address}" for address in addresses)
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2"]
        + ["-keyout", str(key), "-out", str(cert), "-subj", f"/CN={addresses[0]}"]
        + ["-addext", f"subjectAltName={names}"],
        check=True,
        capture_output=True,
    )
    return cert, key

"""TLS: both servers serve https:// with the certificate they are started with, and the clients
check it, against the system's CAs and the CA file they are given (an RL step over TLS is in
tests/trainer/test_rl.py)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from codeloop.config import SandboxConfig
from codeloop.sandbox.client import SandboxClient
from codeloop.types import ExecRequest, ExecStatus


def test_the_sandbox_serves_https_to_clients_that_trust_its_certificate(
    tls_certificate: tuple[Path, Path], sandbox_serve: Any
) -> None:
    cert, key = tls_certificate

    async def run(cfg: SandboxConfig, on: str) -> tuple[ExecStatus, str, str]:
        async with SandboxClient([on], cfg) as client:
            result = await client.execute(ExecRequest("print(6 * 7)"))
        return result.status, result.stdout, result.stderr

    with sandbox_serve("--tls-cert", str(cert), "--tls-key", str(key)) as url:
        trusted = SandboxConfig(ca_file=str(cert), client_retries=0)
        assert asyncio.run(run(trusted, url)) == (ExecStatus.OK, "42\n", "")
        status, _, why = asyncio.run(run(SandboxConfig(client_retries=0), url))
        assert status == ExecStatus.SANDBOX_ERROR and "certificate verify failed" in why
        plain = url.replace("https://", "http://")  # the port speaks TLS only
        assert asyncio.run(run(trusted, plain))[0] == ExecStatus.SANDBOX_ERROR


def test_a_certificate_without_its_key_is_one_line(tmp_path: Path) -> None:
    for command in (["sandbox", "serve"], ["serve", "--model", str(tmp_path)]):
        done = subprocess.run(
            [sys.executable, "-m", "codeloop", *command, "--tls-cert", str(tmp_path / "c.pem")],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2, done.stderr
        assert done.stderr.strip().endswith("give both a certificate and its key, or neither")
        assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("ca", ["missing.pem", "empty.pem"])
def test_a_ca_file_that_cannot_be_read_is_named(tmp_path: Path, ca: str) -> None:
    from codeloop.errors import InputFileError
    from codeloop.net import client_tls

    (tmp_path / "empty.pem").write_text("")
    with pytest.raises(InputFileError, match=f"{ca}: not a readable CA file"):
        client_tls(str(tmp_path / ca))

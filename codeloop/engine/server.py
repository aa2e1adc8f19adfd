"""`codeloop serve`: an OpenAI-compatible completions server for a transformers model.

Routes (JSON):
- `POST /v1/completions`: `prompt` (token ids, or a string), `max_tokens`, `temperature`,
  `top_p`, `stop`, `seed`, `logprobs`. The choice carries `text`, `token_ids` (the sampled ids),
  `logprobs.tokens` / `logprobs.token_logprobs` (as `token_id:N` strings when
  `return_tokens_as_token_ids` is true, as vLLM does) and `finish_reason` (`stop` | `length`).
  Stop strings stay in the output (vLLM's `include_stop_str_in_output`). Every field is checked
  (types, ranges: token ids inside the vocabulary, the prompt and `max_tokens` together inside
  the model's context, `max_position_embeddings`, as vLLM's max_model_len, though vLLM clamps
  a `max_tokens` past it where this server refuses it; `n` = 1, at most 64 stop strings):
  anything else is a 400 naming the field, and a body over 16 MiB a 413. A prompt that fills
  the context is answered "the prompt has N tokens; this server takes 1 to M", which clients
  read as a context overflow (`ContextExceeded`), as vLLM's "maximum context length".
  With `weights_version` set, a server holding another version answers 409 and generates nothing
  (it was restarted, or missed a push: the client retries once it is brought up to date).
- `POST /v1/weights`: new weights in place, the body `safetensors` bytes (at most twice the
  model's size in float32, else 413), the header `X-Weights-Version` their version (the
  trainer's step; a resumed run publishes its checkpoint's step again, which may be older than
  what a killed run had published). How a trainer on another host updates the server without a
  shared filesystem.
  Weights are checked before they replace anything (`check_weights`: names, shapes, floating
  point, finite); a refused push answers 400 and the old weights keep serving. A LoRA run
  pushes its adapters alone (safetensors metadata `lora_scaling` and `lora_base`, the base's
  fingerprint): they are merged into the base weights the server keeps (`engine/adapter.py`),
  and refused (400) when the server's base is not the one they were trained on.
- `POST /v1/reload` `{"path": DIR}`: load the weights of a policy directory in place; only a
  directory under the one the server was started with (`--weights-dir`), 403 otherwise (and
  always without one).
- `GET /v1/models`: the model served and its context (`max_model_len`, as vLLM's), which
  clients fit their requests' `max_tokens` to.
- `GET /metrics`: Prometheus text, read from the continuous-batching engine: requests running
  (being decoded) and waiting (not yet admitted), and KV-cache use as the tokens the running
  requests reserve (prompt + max_tokens each) over `--kv-capacity-tokens`, which is also the
  engine's admission cap.
- `GET /health`: `{"ok", "model", "version"}`, `version` the last pushed (null: the weights it
  was started with).
"""

from __future__ import annotations

import asyncio
import ssl
import time
import uuid
from pathlib import Path
from typing import Any

from aiohttp import web

from codeloop.auth import (
    CLIENT_TIMEOUT_S,
    MAX_CONNECTIONS,
    chunks_within,
    read_body_within,
    require_token,
)
from codeloop.config import GRACE_S, RolloutConfig
from codeloop.engine.adapter import SCALING, AdapterBase, metadata
from codeloop.engine.hf_engine import TransformersEngine, engine_from_config
from codeloop.engine.model import default_device, load_pretrained
from codeloop.engine.protocol import SamplingParams
from codeloop.errors import ModelError
from codeloop.serving import serve_until_signal

MAX_STOPS, MAX_STOP_CHARS = 64, 1024  # stop strings a request may give, and their length


def _request(
    body: Any, tokenizer: Any, vocab: int, context: int
) -> tuple[list[int], SamplingParams]:
    """A completion request's prompt ids and sampling settings, or a ValueError saying what is
    wrong with it (each field's type and range: nothing reaches the engine that it cannot run;
    the prompt and `max_tokens` together within the model's `context`, as vLLM's
    max_model_len)."""
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")

    def number(key: str, default: float, low: float, high: float) -> float:
        value = body.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{key} must be a number, got {value!r}")
        if not low <= value <= high:  # NaN fails too
            raise ValueError(f"{key} must be in [{low}, {high}], got {value!r}")
        return float(value)

    def integer(key: str, default: int | None, low: int, high: int) -> int | None:
        value = body.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"{key} must be an integer in [{low}, {high}], got {value!r}")
        return value

    prompt = body.get("prompt")
    room = f"this server takes 1 to {context - 1}"  # what clients map to an overflowed context
    if isinstance(prompt, list) and len(prompt) >= context:
        raise ValueError(f"the prompt has {len(prompt)} tokens; {room}")
    if isinstance(prompt, str) and len(prompt) <= 16 * context:
        ids = tokenizer.encode(prompt, add_special_tokens=False)
    elif isinstance(prompt, list):
        if not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in prompt
        ):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        ids = list(prompt)
    else:
        raise ValueError(
            f"prompt must be a string of at most {16 * context} characters or a list of token ids"
        )
    if not 0 < len(ids) < context:
        raise ValueError(f"the prompt has {len(ids)} tokens; {room}")
    n = body.get("n", 1)
    if n is not None and (isinstance(n, bool) or n != 1):
        raise ValueError(f"n must be 1 (send one request per sample), got {n!r}")
    stop = body.get("stop") or []
    stops = [stop] if isinstance(stop, str) else stop
    if (
        not isinstance(stops, list)
        or len(stops) > MAX_STOPS
        or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops)
    ):
        raise ValueError(
            f"stop must be a string or a list of at most {MAX_STOPS} strings of 1 to "
            f"{MAX_STOP_CHARS} characters"
        )
    max_tokens = integer("max_tokens", 16, 1, context - len(ids))
    integer("weights_version", None, 0, 2**63 - 1)
    return ids, SamplingParams(
        max_tokens=max_tokens or 16,
        temperature=number("temperature", 1.0, 0.0, 100.0),
        top_p=number("top_p", 1.0, 1e-9, 1.0),
        stop=list(stops),
        seed=integer("seed", None, 0, 2**63 - 1),
    )


def build_app(
    engine: TransformersEngine,
    model_name: str,
    token: str | None = None,
    *,
    weights_dir: str | Path | None = None,
    client_timeout_s: float = CLIENT_TIMEOUT_S,
) -> web.Application:
    """The server's routes (the module docstring) over `engine`; with a `token`, every route
    but /health asks for it; `/v1/reload` loads only directories under `weights_dir`."""
    completed = 0
    version: int | None = None  # of the weights last pushed
    tokenizer = engine.tokenizer
    root = Path(weights_dir).resolve() if weights_dir else None
    base = AdapterBase()  # what pushed LoRA adapters are merged into
    most_bytes = 2 * 4 * sum(p.numel() for p in engine.model.parameters()) + (1 << 20)
    vocab = engine.model.get_input_embeddings().num_embeddings
    context = getattr(engine.model.config, "max_position_embeddings", None) or (1 << 20)

    async def completions(request: web.Request) -> web.Response:
        try:
            body = await request.json()
            ids, params = _request(body, tokenizer, vocab, context)
        except (ValueError, OSError) as err:  # bad JSON or fields; a client gone mid-body
            return _error(400, f"bad request: {err}")
        wanted = body.get("weights_version")
        if wanted is not None and wanted != version:
            message = f"this server holds weights version {version}, not {wanted}"
            return web.json_response({"error": {"message": message}}, status=409)
        nonlocal completed
        try:
            generation = await engine.generate(ids, params)
        finally:
            completed += 1
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        tokens = [
            f"token_id:{i}" if as_ids else tokenizer.decode([i]) for i in generation.token_ids
        ]
        choice = {
            "index": 0,
            "text": tokenizer.decode(generation.token_ids),
            "token_ids": generation.token_ids,
            "logprobs": {"tokens": tokens, "token_logprobs": generation.logprobs},
            "finish_reason": generation.finish_reason,
        }
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(generation.token_ids)}
        return web.json_response(
            {
                "id": f"cmpl-{uuid.uuid4().hex}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": model_name,
                "choices": [choice],
                "usage": usage,
            }
        )

    async def weights(request: web.Request) -> web.Response:
        from safetensors import SafetensorError
        from safetensors.torch import load

        nonlocal version
        if (request.content_length or 0) > most_bytes:
            return _error(413, f"weights of over {most_bytes} bytes: not this model's")
        try:
            pushed = int(request.headers["X-Weights-Version"])
        except (KeyError, ValueError):
            pushed = -1
        if pushed < 0:  # any step, even an older one: a resumed run publishes its checkpoint's
            return _error(400, "bad weights: no X-Weights-Version header of a step (0, 1, ...)")
        body = bytearray()
        try:  # no cap of aiohttp's; a push that stalls for the client limit is cut
            async for chunk in chunks_within(request, 1 << 20, client_timeout_s):
                body += chunk
                if len(body) > most_bytes:
                    return _error(413, f"weights of over {most_bytes} bytes: not this model's")
        except TimeoutError:  # (an OSError too)
            response = _error(408, f"the weights stopped arriving for {client_timeout_s:g} s")
            response.force_close()
            return response
        except OSError as err:  # the client went away mid-body
            return _error(400, f"connection lost while reading the weights ({err})")
        try:
            state, meta = load(bytes(body)), metadata(body)
            adapter = SCALING in meta  # a LoRA adapter: merged into the base this server keeps
            if adapter:
                state = base.merge(engine.model.state_dict(), state, meta)
            engine.update_weights(state, pushed)
            if not adapter:  # new full weights: the next adapter's base
                base.forget()
        except (ValueError, SafetensorError) as err:  # unreadable bytes, or `check_weights`
            message = str(err) if str(err).startswith("bad weights") else f"bad weights: {err}"
            return _error(400, message)
        version = pushed
        return web.json_response({"ok": True, "version": version})

    async def reload(request: web.Request) -> web.Response:
        try:
            body = await request.json()
            path = body.get("path")
        except (ValueError, AttributeError, OSError):
            path = None
        if not isinstance(path, str):
            return _error(400, 'expected {"path": DIR}')
        if root is None:
            return _error(403, "this server reloads nothing: start it with --weights-dir")
        if not Path(path).resolve().is_relative_to(root):
            return _error(403, f"{path} is not under the server's --weights-dir")
        try:
            dtype = str(next(engine.model.parameters()).dtype).removeprefix("torch.")
            fresh, _ = load_pretrained(path, dtype)
            engine.update_weights(fresh.state_dict())
            base.forget()
        except ModelError as err:
            return _error(400, f"cannot load {path}: {err}")
        return web.json_response({"ok": True, "path": path})

    async def metrics(request: web.Request) -> web.Response:
        used, capacity = engine.kv_tokens_used, engine.kv_capacity_tokens
        lines = [
            f"codeloop_engine_requests_running {engine.running}",
            f"codeloop_engine_requests_waiting {engine.waiting}",
            f"codeloop_engine_kv_cache_usage {used / capacity if capacity else 0.0:.6f}",
            f"codeloop_engine_kv_cache_tokens {used}",
            f"codeloop_engine_kv_capacity_tokens {capacity}",
            f"codeloop_engine_requests_completed_total {completed}",
        ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "model": model_name, "version": version})

    async def models(request: web.Request) -> web.Response:
        served = {"id": model_name, "object": "model", "max_model_len": context}
        return web.json_response({"object": "list", "data": [served]})

    app = web.Application(
        client_max_size=16 << 20,
        middlewares=[
            require_token(token),
            read_body_within(client_timeout_s, streamed=frozenset({"/v1/weights"})),
        ],
    )
    app.add_routes(
        [
            web.post("/v1/completions", completions),
            web.post("/v1/weights", weights),
            web.post("/v1/reload", reload),
            web.get("/metrics", metrics),
            web.get("/health", health),
            web.get("/v1/models", models),
        ]
    )
    return app


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


def serve(
    model: Any,
    tokenizer: Any,
    *,
    name: str,
    host: str,
    port: int,
    max_batch: int,
    kv_capacity_tokens: int,
    token: str | None = None,
    weights_dir: str = "",
    tls: ssl.SSLContext | None = None,
    client_timeout_s: float = CLIENT_TIMEOUT_S,
    max_connections: int | None = None,
    grace_s: float = GRACE_S,
) -> None:
    """Serve `model` (a loaded causal LM, moved here to the default device) as `name`; with a
    `token`, every route but /health asks for it; `/v1/reload` loads only directories under
    `weights_dir` (none without it); with `tls` (`net.server_tls`) it serves https://. On SIGTERM
    or SIGINT it stops within about `grace_s` (`serving.py`)."""
    device = default_device()
    model.to(device)
    rollout = RolloutConfig(engine_max_batch=max_batch, kv_capacity_tokens=kv_capacity_tokens)
    engine = engine_from_config(model, tokenizer, rollout)
    app = build_app(
        engine, name, token, weights_dir=weights_dir or None, client_timeout_s=client_timeout_s
    )
    scheme = "https" if tls else "http"
    banner = f"codeloop serve: {name} ({device}) on {scheme}://{host}:{port}" + (
        " (a token is required)" if token else ""
    )
    served = serve_until_signal(
        app,
        host,
        port,
        tls=tls,
        client_timeout_s=client_timeout_s,
        max_connections=max_connections or MAX_CONNECTIONS,
        grace_s=grace_s,
        started=lambda: print(banner, flush=True),
    )
    asyncio.run(served)

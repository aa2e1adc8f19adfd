"""Weights sent to `codeloop serve` over HTTP: a server that missed them, or restarted, gets
them again before it serves (`trainer/weights.py`'s `ServerSink`)."""

import asyncio
import logging
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
import torch

from codeloop.config import RolloutConfig
from codeloop.engine import scheduler as scheduler_module
from codeloop.engine.model import tiny_model
from codeloop.engine.openai_engine import EngineError, servers
from codeloop.engine.protocol import Generation, SamplingParams
from codeloop.engine.scheduler import Scheduler
from codeloop.rollout.prompt import PromptFormat
from codeloop.trainer import weights as weights_module
from codeloop.trainer.distributed import World
from codeloop.trainer.weights import ServerSink


def _logprobs(model: Any, prompt: list[int], generation: Generation) -> list[float]:
    ids = torch.tensor([prompt + generation.token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    chosen = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None])
    return chosen.squeeze(-1).tolist()


def test_a_restarted_server_is_brought_up_to_date_before_it_serves_again(
    trainer_fmt: PromptFormat,
    tmp_path: Path,
    codeloop_serve: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    fmt = trainer_fmt
    # the restarted server is asked for completions several times before the sink looks at it
    monkeypatch.setattr(weights_module, "WATCH_S", 1.5)
    monkeypatch.setattr(scheduler_module, "COOL_DOWN_S", 0.1)
    torch.manual_seed(0)
    started = tiny_model(len(fmt.tokenizer), hidden_size=32, layers=2)  # what the server loads
    trained = tiny_model(len(fmt.tokenizer), hidden_size=32, layers=2)  # what the trainer sends
    with torch.no_grad():  # far from the nearly uniform start, so the two tell apart
        for parameter in trained.parameters():
            parameter.normal_(0, 0.5)
    started.save_pretrained(tmp_path / "served")
    fmt.tokenizer.save_pretrained(tmp_path / "served")
    prompt, greedy = fmt.prompt_ids("What is 2 + 3?"), SamplingParams(8, temperature=0.0)
    rollout = RolloutConfig(server_retry_s=60)

    async def main(url: str, restart: Any) -> tuple[Generation, int | None]:
        engines = servers([url], rollout, "")
        sink = ServerSink(
            engines,
            engines,
            tmp_path / "unused",
            trained,
            tokenizer=fmt.tokenizer,
            world=World(),
            read_capacity=False,
        )
        scheduler = Scheduler(engines, "kv_aware", retry_s=rollout.server_retry_s)
        try:
            await sink.publish(trained.state_dict(), 3)
            restart()  # the server comes back with the weights it was started with
            async with scheduler.lease() as engine:  # refused until the sink sends them again
                generation = await engine.generate(prompt, greedy)
            return generation, await engines[0].served_version()
        finally:
            await sink.close()
            await engines[0].close()

    with codeloop_serve(tmp_path / "served") as url:
        port = urllib.parse.urlsplit(url).port
        holder: list[Any] = []

        def restart() -> None:
            url.process.kill()
            url.process.wait()
            holder.append(codeloop_serve(tmp_path / "served", port=port))
            holder[0].__enter__()

        with caplog.at_level(logging.INFO, logger="codeloop.trainer.weights"):
            try:
                generation, version = asyncio.run(main(url, restart))
            finally:
                if holder:
                    holder[0].__exit__(None, None, None)
    assert version == 3
    assert generation.logprobs == pytest.approx(_logprobs(trained, prompt, generation), abs=1e-4)
    assert generation.logprobs != pytest.approx(_logprobs(started, prompt, generation), abs=1e-3)
    assert "brought up to weights version 3" in caplog.text
    assert not (tmp_path / "unused").exists()  # nothing went through files


def test_a_publish_goes_on_without_a_server_that_is_down_but_not_without_all(
    trainer_fmt: PromptFormat, tmp_path: Path, codeloop_serve: Any
) -> None:
    fmt = trainer_fmt
    model = tiny_model(len(fmt.tokenizer), hidden_size=32, layers=2)
    model.save_pretrained(tmp_path)
    fmt.tokenizer.save_pretrained(tmp_path)

    async def main(up: str, down: str) -> list[int | None]:
        engines = servers([up, down], RolloutConfig(), "")
        sink = ServerSink(
            engines,
            engines,
            tmp_path / "unused",
            model,
            tokenizer=fmt.tokenizer,
            world=World(),
            read_capacity=False,
        )
        try:
            await sink.publish(model.state_dict(), 1)  # the one that is down is left for later
            alone = servers([down], RolloutConfig(), "")
            lost = ServerSink(
                alone,
                alone,
                tmp_path / "unused",
                model,
                tokenizer=fmt.tokenizer,
                world=World(),
                read_capacity=False,
            )
            with pytest.raises(EngineError, match="no inference server can be reached: .*" + down):
                await lost.publish(model.state_dict(), 2)
            await alone[0].close()
            return [await engines[0].served_version(), engines[1].weights_version]
        finally:
            await sink.close()
            await asyncio.gather(*(e.close() for e in engines))

    with codeloop_serve(tmp_path) as up, codeloop_serve(tmp_path) as down:
        down.process.kill()
        down.process.wait()
        assert asyncio.run(main(up, down)) == [1, 1]


def test_training_through_vllm_with_a_nucleus_is_refused() -> None:
    """vLLM's logprobs of a nucleus-sampled token are renormalised over the nucleus (its
    processed logprobs), the trainer's are not: RL through vLLM with rollout.top_p < 1 is
    refused before any server is asked; codeloop serve's logprobs are the trainer's."""
    from codeloop.config import Config, ConfigError
    from codeloop.trainer.rollout_side import _servers

    cfg = Config()
    cfg.rollout.backend, cfg.rollout.server = "openai", "vllm"
    cfg.rollout.endpoints = ["http://127.0.0.1:9"]
    cfg.rollout.top_p = 0.9
    with pytest.raises(ConfigError, match="rollout.top_p = 0.9 with rollout.server = 'vllm'"):
        _servers(cfg)
    cfg.rollout.top_p = 1.0
    assert [s.backend for s in _servers(cfg)] == ["vllm"]
    cfg.rollout.server, cfg.rollout.top_p = "codeloop", 0.9
    assert [s.backend for s in _servers(cfg)] == ["codeloop"]


def test_a_vllm_down_at_a_reload_is_left_to_reload_later_but_not_all_of_them(
    trainer_fmt: PromptFormat, tmp_path: Path
) -> None:
    """Weights published to vLLM servers through files: one that is down is warned about and
    reloads before its next completion; with every one down the publish stops the run; a
    server that refuses the reload (a 403) stops it with the shared-filesystem hint."""
    from aiohttp import web
    from fake_http import serve

    from codeloop.engine.vllm_server import free_port

    fmt = trainer_fmt
    model = tiny_model(len(fmt.tokenizer), hidden_size=32, layers=2)
    reloads: list[str] = []

    async def reload(request: web.Request) -> web.Response:
        reloads.append((await request.json())["kwargs"]["weights_path"])
        return web.json_response({"results": [None]})

    async def reset(request: web.Request) -> web.Response:
        return web.json_response({"success": True})

    async def refuse(request: web.Request) -> web.Response:
        return web.Response(status=403, text="not this directory")

    def sink(engines: list[Any]) -> ServerSink:
        return ServerSink(
            engines,
            engines,
            tmp_path / "weights",
            model,
            tokenizer=fmt.tokenizer,
            world=World(),
            read_capacity=False,
        )

    async def main() -> tuple[list[Any], str, str]:
        up, up_url = await serve(
            {("POST", "/collective_rpc"): reload, ("POST", "/reset_prefix_cache"): reset}
        )
        no, no_url = await serve({("POST", "/collective_rpc"): refuse})
        down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
        rollout = RolloutConfig(server="vllm")
        engines = servers([up_url, down], rollout, "")
        alone, refusing = servers([down], rollout, ""), servers([no_url], rollout, "")
        try:
            await sink(engines).publish(model.state_dict(), 1)
            with pytest.raises(EngineError) as all_down:
                await sink(alone).publish(model.state_dict(), 2)
            with pytest.raises(EngineError) as refused:
                await sink(refusing).publish(model.state_dict(), 3)
            return engines, str(all_down.value), str(refused.value)
        finally:
            await asyncio.gather(*(e.close() for e in [*engines, *alone, *refusing]))
            await up.cleanup()
            await no.cleanup()

    engines, all_down, refused = asyncio.run(main())
    where = str((tmp_path / "weights").resolve())
    assert reloads == [where]  # the server that is up took them
    assert [e.weights_path for e in engines] == [where, where]  # the down one: before it samples
    assert engines[1]._reload_due and not engines[0]._reload_due
    assert all_down.startswith("no inference server can be reached: ")
    assert "403" in refused and "a shared filesystem" in refused

"""AsyncEngine in-process: concurrent generate() streams give exactly the offline engine's tokens, leaving a
stream early aborts the request, and a failing handler answers 500 without taking the server down."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest

from kvserve import LLM, SamplingParams
from kvserve.config import EngineArgs
from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.metrics import EngineMetrics
from kvserve.sampling_params import RequestOutputKind
from tests.conftest import random_prompts


def _sample(metrics: EngineMetrics, name: str) -> float:
    for line in metrics.render().decode().splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def _params(max_tokens: int, kind=RequestOutputKind.DELTA) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, output_kind=kind)


@pytest.mark.parametrize("use_process, async_scheduling", [(True, False), (False, False), (True, True)],
                         ids=["process", "thread", "process-async-scheduling"])
def test_concurrent_streams_match_offline_and_abort_frees(tiny_model_factory, use_process, async_scheduling):
    path, _ = tiny_model_factory("llama")
    prompts = random_prompts(12, 3, 40, seed=7)
    offline = LLM(path).generate([{"prompt_token_ids": p} for p in prompts], _params(12), use_tqdm=False)
    expected = [o.outputs[0].token_ids for o in offline]

    async def main():
        metrics = EngineMetrics("tiny")
        engine = AsyncEngine(EngineArgs(model=path, async_scheduling=async_scheduling), metrics, use_process=use_process)
        engine.start()
        await engine.ready()

        async def collect(i, p):
            tokens, text, outputs = [], "", 0
            async for out in engine.generate({"prompt_token_ids": p}, _params(12), request_id=f"r{i}"):
                tokens += out.outputs[0].token_ids
                text += out.outputs[0].text
                outputs += 1
                last = out
            assert last.finished and last.outputs[0].finish_reason == "length"
            return tokens, text, outputs

        async def leave_early():
            async for _ in engine.generate("leave early", _params(500)):
                break  # closing the generator aborts the request

        results = await asyncio.gather(*(collect(i, p) for i, p in enumerate(prompts)), leave_early())
        names = ("kvserve:kv_cache_usage_perc", "kvserve:num_requests_running", "kvserve:num_requests_waiting")
        for _ in range(400):  # the abort reaches the engine between steps, and its stats come back after
            stats = tuple(_sample(metrics, name) for name in names)
            if stats == (0, 0, 0):
                break
            await asyncio.sleep(0.05)
        with pytest.raises(ValueError, match="maximum model length"):
            await engine.add_request({"prompt_token_ids": [5] * 5000}, _params(1))
        await engine.shutdown()
        return results[:-1], stats, metrics

    results, stats, metrics = asyncio.run(main())
    assert [tokens for tokens, _, _ in results] == expected
    assert all(n > 1 for _, _, n in results)  # streamed as deltas, not one final output
    assert stats == (0, 0, 0)
    text = metrics.render().decode()
    assert 'kvserve:request_success_total{finished_reason="abort",model_name="tiny"} 1.0' in text
    assert 'kvserve:generation_tokens_total{model_name="tiny"} ' in text


class _ExplodingEngine:
    """Just enough of AsyncEngine for the routes; adding a request raises an unexpected error."""

    is_ready = True
    tokenizer = None
    config = SimpleNamespace(max_model_len=64, model_config=SimpleNamespace(vocab_size=100),
                             args=SimpleNamespace(max_logprobs=20, max_n=128))

    async def add_request(self, prompt, params, request_id=None):
        raise RuntimeError("boom")

    async def add_requests(self, items):
        raise RuntimeError("boom")

    def abort(self, request_id):
        pass

    def seconds_since_heard(self):
        return 0.0


def test_unexpected_handler_error_is_500_json_and_server_stays_up():
    from kvserve.entrypoints.openai.api_server import ServerSettings, ServerState, build_app

    state = ServerState(engine=_ExplodingEngine(), metrics=EngineMetrics("stub"),
                        settings=ServerSettings(served_model_name="stub", model_path="stub"))
    app = build_app(state)

    async def main():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            r = await client.post("/v1/completions", json={"model": "stub", "prompt": [1, 2], "max_tokens": 2})
            health = await client.get("/health")
            return r, health

    r, health = asyncio.run(main())
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "InternalServerError" and "boom" in r.json()["error"]["message"]
    assert health.status_code == 200


def test_loading_and_api_key_gate():
    """While the model loads every API route answers 503 (OpenAI JSON); the key is checked first."""
    from kvserve.entrypoints.openai.api_server import ServerSettings, ServerState, build_app

    loading = _ExplodingEngine()
    loading.is_ready = False
    state = ServerState(engine=loading, metrics=EngineMetrics("stub"),
                        settings=ServerSettings(served_model_name="stub", model_path="stub", api_key="k"))
    app = build_app(state)

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            auth = {"Authorization": "Bearer k"}
            return (await client.get("/v1/models", headers=auth), await client.get("/health"),
                    await client.get("/v1/models"), await client.get("/metrics"))

    models, health, unauthorized, metrics = asyncio.run(main())
    assert models.status_code == 503 and models.json()["error"]["code"] == 503
    assert health.status_code == 503
    assert unauthorized.status_code == 401
    assert metrics.status_code == 200


@pytest.mark.parametrize("use_process", [True, False], ids=["process", "thread"])
def test_server_side_keeps_only_streams_and_forgets_them(tiny_model_factory, use_process):
    """After finished, aborted and disconnected requests, the server side holds no per-request state: its one
    registry (the streams) is empty, and so is every other container it keeps, but the listeners and threads."""
    path, _ = tiny_model_factory("llama")

    async def main():
        engine = AsyncEngine(EngineArgs(model=path), EngineMetrics("tiny"), use_process=use_process)
        engine.start()
        await engine.ready()

        async def finish(i):
            params = SamplingParams(temperature=1.0, seed=i, n=2, max_tokens=6, ignore_eos=True,
                                    output_kind=RequestOutputKind.DELTA)
            async for out in engine.generate(f"finish {i}", params):
                pass
            assert out.finished

        async def leave_early(i):
            async for _ in engine.generate(f"leave {i}", _params(300)):
                break  # closing the generator aborts the request

        async def disconnect(i, started: asyncio.Event):
            async for _ in engine.generate(f"disconnect {i}", _params(300)):
                started.set()

        starts = [asyncio.Event() for _ in range(3)]
        gone = [asyncio.ensure_future(disconnect(i, s)) for i, s in enumerate(starts)]
        await asyncio.gather(*(finish(i) for i in range(4)), *(leave_early(i) for i in range(3)),
                             *(s.wait() for s in starts))
        for task in gone:  # a client that disconnects: its handler is cancelled mid-stream
            task.cancel()
        await asyncio.gather(*gone, return_exceptions=True)
        held = {name: value for name, value in vars(engine).items()
                if isinstance(value, (dict, set, list)) and value
                and name not in ("kv_snapshot", "kv_snapshot_listeners", "_threads")}
        num_active = engine.num_active
        await engine.shutdown()
        return held, num_active

    held, num_active = asyncio.run(main())
    assert held == {} and num_active == 0

"""Issue 10 on the library side: SamplingParams refuses what the server refuses (one check, shared), the
engine applies the operator's limits to LLM.generate too, and a step that fails because of one request
aborts that request only: the others go on and produce exactly the tokens they would have produced."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.engine_core import STOP, EngineCore
from kvserve.sampling_params import RequestOutputKind


@pytest.mark.parametrize("kwargs, field", [
    (dict(n=True), "n"),
    (dict(n=2.0), "n"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=1e30), "temperature"),
    (dict(temperature=True), "temperature"),
    (dict(repetition_penalty=1e30), "repetition_penalty"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(seed=2**64), "seed"),
    (dict(seed=-(2**63) - 1), "seed"),
    (dict(top_k=2**63), "top_k"),
    (dict(max_tokens=True), "max_tokens"),
    (dict(ignore_eos="yes"), "ignore_eos"),
    (dict(logit_bias={5: 1000.0}), "logit_bias"),
    (dict(logit_bias={"x": 1.0}), "logit_bias"),
    (dict(stop=["\ud800"]), "stop"),
    (dict(bad_words=["ok\udfff"]), "bad_words"),
    (dict(stop_token_ids=[True]), "stop_token_ids"),
])
def test_sampling_params_refuse_wrong_types_and_ranges(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field} "):
        SamplingParams(**kwargs)


def test_limits_against_the_model():
    SamplingParams(n=128, logprobs=20, prompt_logprobs=20, top_k=1000).verify_for_model(1000)
    for params, field in [(SamplingParams(n=129), "n"), (SamplingParams(prompt_logprobs=-1), "prompt_logprobs"),
                          (SamplingParams(logprobs=21), "logprobs"), (SamplingParams(top_k=1001), "top_k")]:
        with pytest.raises(ValueError, match=rf"^{field} "):
            params.verify_for_model(1000)
    # The operator may lift the caps: --max-logprobs -1 allows -1 (the whole vocabulary), --max-n more samples.
    SamplingParams(n=500, prompt_logprobs=-1, logprobs=-1).verify_for_model(1000, max_logprobs=-1, max_n=500)


@pytest.fixture(scope="module")
def llama(tiny_model_factory):
    return tiny_model_factory("llama")


def test_llm_generate_applies_the_engine_limits(llama):
    llm = LLM(llama[0], max_model_len=256, kv_cache_memory_bytes=8 << 20, max_logprobs=5, max_n=4)
    for params, field in [(SamplingParams(n=10**12, max_tokens=1), "n"),
                          (SamplingParams(prompt_logprobs=-1, max_tokens=1), "prompt_logprobs"),
                          (SamplingParams(logprobs=6, max_tokens=1), "logprobs")]:
        with pytest.raises(ValueError, match=rf"^{field} "):
            llm.generate(["Hello", "World"], params, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate("Hello", SamplingParams(n=4, logprobs=5, max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs) == 4


def _run_core(engine, requests, after_add=None):
    """Runs EngineCore until every request has finished or failed; returns ({id: tokens}, failed ids)."""
    pending = [("add", rid, prompt, params, None) for rid, prompt, params in requests]
    tokens: dict[str, list[int]] = {}
    done: set[str] = set()
    failed: set[str] = set()
    core = EngineCore(engine)

    def take_commands(block: bool):
        if pending:
            out = list(pending)
            pending.clear()
            return out
        return [STOP] if len(done | failed) == len(requests) else []

    def publish(batch):
        assert all(error is None for _, error in batch.accepted)
        if batch.accepted and after_add is not None:
            after_add()
        failed.update(batch.failed)
        for out in batch.outputs:
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            if out.finished:
                done.add(out.request_id)

    core.run(take_commands, publish)
    return tokens, failed


def test_a_failing_request_fails_alone(llama):
    llm = LLM(llama[0], max_model_len=256, kv_cache_memory_bytes=8 << 20, enable_prefix_caching=True)
    engine = llm.llm_engine

    def params(seed):
        return SamplingParams(temperature=1.0, seed=seed, max_tokens=12, ignore_eos=True,
                              output_kind=RequestOutputKind.DELTA)

    good = [(f"good-{i}", {"prompt_token_ids": [5 + i, 17, 99, 3, 250 + i]}, params(i)) for i in range(4)]
    expected, failed = _run_core(engine, good)
    assert not failed and all(len(t) == 12 for t in expected.values())

    # A value no admission check lets through, planted once the request runs: the next step raises.
    def poison():
        engine.scheduler.requests["bad"].sampling_params.top_k = 2**64

    bad = ("bad", {"prompt_token_ids": [9, 9, 9]}, params(7))
    tokens, failed = _run_core(engine, [*good[:2], bad, *good[2:]], after_add=poison)
    assert failed == {"bad"}
    assert {rid: t for rid, t in tokens.items() if rid != "bad"} == expected
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.usage() == 0


def test_async_engine_admits_a_prompt_list_as_one_batch_and_aborts_it_together(llama):
    """Finding 7: the server admitted a list of prompts one engine round trip at a time, without watching
    the client. add_requests hands them to the engine in one message, and cancelling it (the client left)
    aborts every one of them: nothing runs and no KV block is held afterwards."""
    import asyncio

    from kvserve.config import EngineArgs
    from kvserve.engine.async_engine import AsyncEngine
    from kvserve.engine.metrics import EngineMetrics

    def gauge(metrics, name):
        for line in metrics.render().decode().splitlines():
            if line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    async def main():
        metrics = EngineMetrics("tiny")
        engine = AsyncEngine(EngineArgs(model=llama[0], max_model_len=256, kv_cache_memory_bytes=8 << 20),
                             metrics, use_process=False)
        engine.start()
        await engine.ready()
        sizes = []
        on_batch = engine._on_batch

        def record(batch):
            if batch.accepted:
                sizes.append(len(batch.accepted))
            on_batch(batch)

        engine._on_batch = record
        params = SamplingParams(max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        streams = await engine.add_requests([(f"p{i}", {"prompt_token_ids": [5, i + 7]}, params) for i in range(40)])
        assert sizes == [40]  # one engine iteration accepted the whole list
        for s in streams:
            engine.abort(s.request_id)

        task = asyncio.ensure_future(engine.add_requests([(f"q{i}", {"prompt_token_ids": [9, i + 3]}, params)
                                                          for i in range(40)]))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert engine.num_active == 0
        names = ("kvserve:num_requests_running", "kvserve:num_requests_waiting", "kvserve:kv_cache_usage_perc")
        for _ in range(400):  # the aborts reach the engine between steps, its stats come back after
            left = tuple(gauge(metrics, n) for n in names)
            if left == (0, 0, 0):
                break
            await asyncio.sleep(0.05)
        await engine.shutdown()
        return left

    assert asyncio.run(main()) == (0, 0, 0)

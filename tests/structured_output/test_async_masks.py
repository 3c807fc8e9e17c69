"""Async scheduling with constrained requests: the mask for step N+1 is filled once step N's tokens are in,
while N+1's forward runs, so a constrained request advances one token every step (not every other step),
and its tokens are those of async scheduling off, with the uni, the mp and the ray executor."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kvserve import LLM, SamplingParams, StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                    "maxItems": 4}},
          "required": ["name", "n", "tags"], "additionalProperties": False}
REGEX = r"[a-f]{3,8}-[0-9]{2,5}"


@pytest.fixture(scope="module")
def llama(tiny_model_factory):
    return tiny_model_factory("llama")


def _requests():
    """Constrained requests (greedy and sampled) beside an unconstrained one."""
    json_c = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    return [
        ([3, 4, 5], SamplingParams(temperature=0, max_tokens=80, structured_outputs=json_c)),
        ([6, 7], SamplingParams(temperature=1.0, seed=11, max_tokens=80, structured_outputs=json_c)),
        ([8, 9, 10], SamplingParams(temperature=1.0, seed=5, max_tokens=40,
                                    structured_outputs=StructuredOutputsParams(regex=REGEX))),
        ([11], SamplingParams(temperature=1.0, seed=3, max_tokens=30, ignore_eos=True)),
    ]


def _run(llm) -> tuple[dict[int, list[int]], dict[int, int], dict[int, str]]:
    """Steps the engine by hand. Per request: its tokens, the engine steps from the one that first scheduled
    it to the one that returned its last output (both counted), and its finish reason."""
    engine = llm.llm_engine
    ids = [engine.add_request(None, {"prompt_token_ids": p}, sp) for p, sp in _requests()]
    tokens, first_step, span, finish = {}, {}, {}, {}
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        outs = engine.step()
        scheduled, _ = engine._scheduled_now
        for s in scheduled.scheduled:
            first_step.setdefault(s.request_id, step)
        for o in outs:
            c = o.outputs[0]
            tokens[o.request_id] = list(c.token_ids)  # all so far
            if o.finished:
                finish[o.request_id] = c.finish_reason
                span[o.request_id] = step - first_step[o.request_id] + 1
    index = {rid: i for i, rid in enumerate(ids)}
    return ({index[k]: v for k, v in tokens.items()}, {index[k]: v for k, v in span.items()},
            {index[k]: v for k, v in finish.items()})


@pytest.mark.parametrize("executor", ["uni", "mp", "ray"])
def test_constrained_requests_advance_every_step_with_async_scheduling(llama, executor):
    if executor == "ray":
        pytest.importorskip("ray")
    results = {}
    for async_scheduling in (False, True):
        llm = LLM(llama[0], max_model_len=256, kv_cache_memory_bytes=32 << 20, async_scheduling=async_scheduling,
                  distributed_executor_backend=executor)
        try:
            assert llm.llm_engine.async_scheduling is async_scheduling
            results[async_scheduling] = _run(llm)
            tokenizer = llm.get_tokenizer()
        finally:
            llm.llm_engine.shutdown()
    (sync_tokens, _, sync_finish), (async_tokens, async_steps, async_finish) = results[False], results[True]
    assert async_tokens == sync_tokens and async_finish == sync_finish
    for i, n in async_steps.items():
        # One step per output token (the prefill samples the first, each later step the next one), and one
        # more: the last token's step is read back by the step after it.
        assert n == len(async_tokens[i]) + 1, (i, n, len(async_tokens[i]))
    for i in (0, 1):
        assert async_finish[i] == "stop"
        jsonschema.validate(json.loads(tokenizer.decode(async_tokens[i], skip_special_tokens=True), strict=False), SCHEMA)

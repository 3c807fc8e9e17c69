"""Serving metric arithmetic, checked exactly: on hand-made timings, and through the streaming client on
a scripted clock (httpx.MockTransport, no network, no sleeping)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from kvserve.bench.metrics import (
    RequestResult,
    calculate_metrics,
    format_report,
    metrics_json,
    output_throughput_over_time,
    tpot,
)
from kvserve.bench.serve_client import CHAT_COMPLETIONS, COMPLETIONS, RequestSpec, build_payload, send_request


def _result(ttft, gaps, tokens, prompt_len=10, start=0.0):
    times, t = [], start + ttft
    for g in [0.0] + gaps:
        t += g
        times.append(t)
    return RequestResult(success=True, prompt_len=prompt_len, output_tokens=tokens, ttft=ttft,
                         latency=ttft + sum(gaps), itl=list(gaps), start_time=start, chunk_times=times)


def test_tpot_is_decode_time_over_tokens_after_the_first():
    r = _result(0.1, [0.02] * 4, tokens=5)
    assert tpot(r) == pytest.approx((0.18 - 0.1) / 4)
    assert tpot(_result(0.1, [], tokens=1)) is None  # undefined for one token
    # Several tokens per chunk (usage says 9 tokens, 5 chunks): TPOT uses tokens, ITL uses chunks.
    assert tpot(_result(0.1, [0.02] * 4, tokens=9)) == pytest.approx(0.08 / 8)


def test_calculate_metrics_exact():
    results = [
        _result(0.100, [0.020, 0.020, 0.020], tokens=4, prompt_len=10),
        _result(0.300, [0.040], tokens=2, prompt_len=20),
        _result(0.200, [], tokens=1, prompt_len=5),
        RequestResult(success=False, prompt_len=99, error="HTTP 500"),
    ]
    m = calculate_metrics(results, duration=2.0, percentiles=[50, 99])
    assert (m.completed, m.failed, m.total_input, m.total_output) == (3, 1, 35, 7)
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(3.5)
    assert m.total_token_throughput == pytest.approx(21.0)
    lat = m.latencies
    assert lat["ttft"].mean == pytest.approx(200.0) and lat["ttft"].median == pytest.approx(200.0)
    assert lat["tpot"].mean == pytest.approx((20.0 + 40.0) / 2)  # the 1-token request has no TPOT
    assert lat["itl"].mean == pytest.approx(25.0) and lat["itl"].median == pytest.approx(20.0)
    assert lat["e2el"].mean == pytest.approx((160 + 340 + 200) / 3)
    assert lat["ttft"].percentiles[99] == pytest.approx(298.0)  # numpy linear interpolation
    j = metrics_json(m)
    assert j["p99_ttft_ms"] == pytest.approx(298.0) and j["median_itl_ms"] == pytest.approx(20.0)
    assert j["total_output_tokens"] == 7 and j["failed"] == 1


def test_report_has_vllm_lines():
    m = calculate_metrics([_result(0.1, [0.02], tokens=2)], duration=1.0)
    text = format_report(m)
    for label in ["Successful requests:", "Failed requests:", "Benchmark duration (s):", "Total input tokens:",
                  "Total generated tokens:", "Request throughput (req/s):", "Output token throughput (tok/s):",
                  "Total Token throughput (tok/s):", "Mean TTFT (ms):", "Median TTFT (ms):", "P99 TTFT (ms):",
                  "Mean TPOT (ms):", "P99 ITL (ms):", "Mean E2EL (ms):", "P99 E2EL (ms):"]:
        assert label in text, label
    assert text.splitlines()[0] == "{:=^50}".format(" Serving Benchmark Result ")
    assert "Mean TTFT (ms):" + " " * 26 + "100.00" in text


def test_no_successes_gives_zeros_not_errors():
    m = calculate_metrics([RequestResult(error="x")], duration=1.0)
    assert m.completed == 0 and m.latencies["ttft"].mean == 0.0


def test_throughput_over_time_adds_up_to_total():
    results = [_result(0.1, [0.2] * 9, tokens=20, start=0.0), _result(0.5, [0.1] * 4, tokens=5, start=1.0)]
    times, rates = output_throughput_over_time(results, duration=3.0, bin_s=0.5)
    assert len(times) == 6 and times[1] == 0.5
    assert sum(r * 0.5 for r in rates) == pytest.approx(25.0)


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _sse(obj) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def _scripted_transport(clock, endpoint, chunks, usage, first=0.1, gap=0.02):
    """A server whose stream sets the clock to each chunk's due time before yielding it."""
    seen = []

    async def stream():
        if endpoint == CHAT_COMPLETIONS:
            yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})  # untimed
        for i, text in enumerate(chunks):
            clock.t = first + i * gap
            chat = endpoint == CHAT_COMPLETIONS
            choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            yield b": keep-alive\n\n" + _sse({"choices": [choice]})
        clock.t += 0.005  # the closing chunk and usage arrive later; they are not output
        yield _sse({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
        if usage:
            yield _sse({"choices": [], "usage": usage})
        yield b"data: [DONE]\n\n"

    class _Stream(httpx.AsyncByteStream):
        async def __aiter__(self):
            async for b in stream():
                yield b

    def handler(request):
        seen.append(json.loads(request.content))
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_Stream())

    return httpx.MockTransport(handler), seen


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT_COMPLETIONS])
def test_client_times_chunks_exactly(endpoint):
    clock = _Clock()
    transport, seen = _scripted_transport(clock, endpoint, ["a", "b", "c", "d", "e"],
                                          usage={"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12})
    prompt = "hello" if endpoint == CHAT_COMPLETIONS else [1, 2, 3]
    spec = RequestSpec(prompt, prompt_len=3, output_len=5)

    async def go():
        async with httpx.AsyncClient(transport=transport) as client:
            return await send_request(client, "http://stub" + endpoint, endpoint,
                                      build_payload(endpoint, "m", spec, True), spec, bench_start=-1.0, clock=clock)

    r = asyncio.run(go())
    assert r.success and r.error == ""
    assert r.ttft == pytest.approx(0.1)
    assert r.itl == pytest.approx([0.02] * 4)
    assert r.latency == pytest.approx(0.18)  # the last output chunk, not [DONE]
    assert tpot(r) == pytest.approx(0.02)
    assert (r.output_tokens, r.prompt_len) == (5, 7)  # from usage
    assert r.generated_text == "abcde"
    assert r.start_time == pytest.approx(1.0) and r.chunk_times[0] == pytest.approx(1.1)
    body = seen[0]
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["min_tokens"] == 5
    if endpoint == CHAT_COMPLETIONS:
        assert body["messages"] == [{"role": "user", "content": "hello"}] and body["max_completion_tokens"] == 5
    else:
        assert body["prompt"] == [1, 2, 3] and body["max_tokens"] == 5


def test_client_counts_tokens_without_usage():
    def run(count_tokens):
        clock = _Clock()
        transport, _ = _scripted_transport(clock, COMPLETIONS, ["ab ", "cd ", "ef"], usage=None)
        spec = RequestSpec([1], 1, 3)

        async def go():
            async with httpx.AsyncClient(transport=transport) as client:
                return await send_request(client, "http://stub/v1/completions", COMPLETIONS,
                                          build_payload(COMPLETIONS, "m", spec, False), spec, 0.0,
                                          count_tokens=count_tokens, clock=clock)

        return asyncio.run(go())

    assert run(None).output_tokens == 3  # one per chunk
    r = run(lambda text: len(text))  # a "tokenizer" with one token per character
    assert r.output_tokens == 8 and r.prompt_len == 1


def test_client_reports_http_errors():
    transport = httpx.MockTransport(lambda request: httpx.Response(404, text="model not found"))
    spec = RequestSpec([1], 1, 3)

    async def go():
        async with httpx.AsyncClient(transport=transport) as client:
            return await send_request(client, "http://stub/v1/completions", COMPLETIONS,
                                      build_payload(COMPLETIONS, "m", spec, True), spec, 0.0)

    r = asyncio.run(go())
    assert not r.success and r.error.startswith("HTTP 404: model not found")


def test_payload_without_ignore_eos_is_plain_openai():
    body = build_payload(COMPLETIONS, "m", RequestSpec("hi", 1, 4), ignore_eos=False)
    assert "ignore_eos" not in body and "min_tokens" not in body
    with pytest.raises(ValueError, match="text prompts"):
        build_payload(CHAT_COMPLETIONS, "m", RequestSpec([1, 2], 2, 4), ignore_eos=True)

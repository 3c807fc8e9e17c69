"""The engine's output path: stop strings / stop tokens / EOS / length as vLLM reports them, and
RequestOutputs per step as output_kind asks (CUMULATIVE, DELTA, FINAL_ONLY).

The model runner is replaced by a script of tokens, so the text each request produces is known."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.sampling_params import RequestOutputKind
from kvserve.worker.runner_output import RunnerOutput

TEXT = " The capital of France is Paris 日本 🎉 and more text after it, and then some more."


@pytest.fixture(scope="module")
def engine(tiny_model_factory):
    return LLM(tiny_model_factory("llama")[0], max_model_len=256, kv_cache_memory_bytes=8 << 20).llm_engine


class _Ready:
    def __init__(self, result: RunnerOutput):
        self._result = result

    def result(self) -> RunnerOutput:
        return self._result


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def script(engine, monkeypatch, request):
    """script(request_id -> token ids): each step, a sampling request gets its next scripted token.
    Run with async scheduling off and on: with it on, stops are found one step after the next was scheduled."""
    scripts: dict[str, list[int]] = {}

    def execute_async(out):
        # output_len counts tokens still in flight, so it indexes the script correctly in both modes. Past
        # the script's end (async: a step scheduled before the stop was seen) any token will do: it is dropped.
        def next_token(s):
            tokens = scripts[s.request_id]
            return tokens[s.output_len] if s.output_len < len(tokens) else 0

        sampling = [s for s in out.scheduled if s.needs_sample]
        return _Ready(RunnerOutput(req_ids=[s.request_id for s in sampling],
                                   sampled_token_ids=[[next_token(s)] for s in sampling]))

    monkeypatch.setattr(engine, "async_scheduling", request.param)
    monkeypatch.setattr(engine.executor, "execute_async", execute_async)
    return scripts


def _run(engine, rid: str, params: SamplingParams, prompt=(5, 6, 7)):
    engine.add_request(rid, {"prompt_token_ids": list(prompt)}, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert engine.kv_cache_manager.usage() == 0.0
    return outputs


def _ids(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("stop, text", [
    ("of France", " The capital "),  # the stop string spans several tokens
    ("本", " The capital of France is Paris 日"),  # a multi-byte character over several byte tokens
    ("🎉", " The capital of France is Paris 日本 "),
])
def test_stop_string_ends_the_request(engine, script, stop, text):
    ids = _ids(engine, TEXT)
    script["a"] = ids
    outs = _run(engine, "a", SamplingParams(stop=[stop], max_tokens=len(ids)))
    comp = outs[-1].outputs[0]
    assert outs[-1].finished and comp.text == text
    assert (comp.finish_reason, comp.stop_reason) == ("stop", stop)
    # Finished at the token that completed the stop string, and freed in the scheduler (usage 0 above).
    assert comp.token_ids == ids[:len(comp.token_ids)]
    assert stop in engine.tokenizer.decode(comp.token_ids)
    assert stop not in engine.tokenizer.decode(comp.token_ids[:-1])


def test_stop_string_kept_with_include_stop_str_in_output(engine, script):
    script["b"] = _ids(engine, TEXT)
    params = SamplingParams(stop=["Paris"], include_stop_str_in_output=True, max_tokens=40)
    comp = _run(engine, "b", params)[-1].outputs[0]
    assert comp.text == " The capital of France is Paris" and comp.stop_reason == "Paris"


def test_finish_reasons(engine, script):
    ids = _ids(engine, TEXT)
    eos = engine.eos_token_id
    script["len"] = ids
    comp = _run(engine, "len", SamplingParams(max_tokens=4))[-1].outputs[0]
    assert (comp.finish_reason, comp.stop_reason, len(comp.token_ids)) == ("length", None, 4)
    assert comp.text == engine.tokenizer.decode(ids[:4])

    script["eos"] = ids[:3] + [eos] + ids[3:]
    comp = _run(engine, "eos", SamplingParams(max_tokens=10))[-1].outputs[0]
    assert (comp.finish_reason, comp.stop_reason) == ("stop", None)
    assert comp.token_ids == ids[:3] + [eos] and comp.text == engine.tokenizer.decode(ids[:3])

    script["ign"] = script["eos"]
    comp = _run(engine, "ign", SamplingParams(max_tokens=6, ignore_eos=True))[-1].outputs[0]
    assert comp.finish_reason == "length" and len(comp.token_ids) == 6

    script["tok"] = ids
    comp = _run(engine, "tok", SamplingParams(stop_token_ids=[ids[2]], max_tokens=10))[-1].outputs[0]
    assert (comp.finish_reason, comp.stop_reason) == ("stop", ids[2])
    assert comp.token_ids == ids[:3] and comp.text == engine.tokenizer.decode(ids[:2])

    # A stop string completed by the very token that reaches max_tokens: the stop string wins (vLLM).
    script["both"] = ids
    n = next(i for i in range(1, len(ids)) if "France" in engine.tokenizer.decode(ids[:i]))
    comp = _run(engine, "both", SamplingParams(stop=["France"], max_tokens=n))[-1].outputs[0]
    assert (comp.finish_reason, comp.stop_reason) == ("stop", "France")


def test_output_kinds(engine, script):
    ids = _ids(engine, TEXT)[:12]
    final_text = engine.tokenizer.decode(ids)
    for rid in ("cum", "delta", "final"):
        script[rid] = ids
    cum = _run(engine, "cum", SamplingParams(max_tokens=12, logprobs=None))
    assert len(cum) == 12 and [len(o.outputs[0].token_ids) for o in cum] == list(range(1, 13))
    assert [o.finished for o in cum] == [False] * 11 + [True] and cum[-1].outputs[0].text == final_text
    assert all(final_text.startswith(o.outputs[0].text) for o in cum)

    delta = _run(engine, "delta", SamplingParams(max_tokens=12, output_kind=RequestOutputKind.DELTA))
    assert all(len(o.outputs[0].token_ids) == 1 for o in delta)
    assert "".join(o.outputs[0].text for o in delta) == final_text
    assert [t for o in delta for t in o.outputs[0].token_ids] == ids

    final = _run(engine, "final", SamplingParams(max_tokens=12, output_kind=RequestOutputKind.FINAL_ONLY))
    assert len(final) == 1 and final[0].finished and final[0].outputs[0].text == final_text


def test_streaming_holds_back_a_possible_stop_string(engine, script):
    ids = _ids(engine, " a b Paris c Pari d Paris! tail")
    script["hold"] = ids
    outs = _run(engine, "hold", SamplingParams(stop=["Paris!"], max_tokens=20, output_kind=RequestOutputKind.DELTA))
    streamed = ""
    for o in outs:
        streamed += o.outputs[0].text
        assert " a b Paris c Pari d ".startswith(streamed)  # nothing is taken back later
    assert streamed == " a b Paris c Pari d " and outs[-1].outputs[0].stop_reason == "Paris!"


def test_n_samples_stream_deltas_per_index(engine, script):
    texts = [" one two three four", " five six seven eight nine ten"]
    for i, t in enumerate(texts):
        script[f"{i}_par"] = _ids(engine, t)
    params = SamplingParams(n=2, max_tokens=30, stop=["nine"], output_kind=RequestOutputKind.DELTA)
    script["0_par"] += [engine.eos_token_id]
    outs = _run(engine, "par", params)
    assert all(o.request_id == "par" for o in outs)
    joined = {0: "", 1: ""}
    for o in outs:
        for c in o.outputs:
            joined[c.index] += c.text
    assert joined == {0: " one two three four", 1: " five six seven eight "}
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    reasons = {c.index: (c.finish_reason, c.stop_reason) for o in outs for c in o.outputs if c.finish_reason}
    assert reasons == {0: ("stop", None), 1: ("stop", "nine")}

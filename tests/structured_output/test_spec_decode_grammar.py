"""Structured outputs with speculative decoding (ngram): the grammar masks every draft position (its matcher
advanced over the drafts for one mask row per position, then rolled back), so greedy tokens are those of a
run without speculation, sampled outputs all validate, and drafts were really proposed, accepted and
rejected, also with the mp executor; the manager's rows per draft position, across the end of a thinking too."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from kvserve import LLM, SamplingParams, StructuredOutputsParams
from tests.structured_schemas import SCHEMAS

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
ENGINE = dict(max_model_len=320, kv_cache_memory_bytes=32 << 20, max_num_seqs=8)
# Repeated objects of the same keys: n-gram lookups in the output propose drafts the grammar partly allows.
ROWS = {"type": "object", "properties": {"rows": {"type": "array", "minItems": 2, "maxItems": 6, "items": {
    "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "ok": {"type": "boolean"}, "tag": {"enum": ["red", "green", "blue"]}},
    "required": ["id", "ok", "tag"], "additionalProperties": False}}},
    "required": ["rows"], "additionalProperties": False}
REGEX = r"(ab|abc|b){2,12}-[0-9]{2,6}"


def _json(schema):
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


def _prompts(n: int) -> list[dict]:
    # Prompts that repeat, so lookups also find drafts in them.
    return [{"prompt_token_ids": [100 + i, 101, 102] * 4} for i in range(n)]


def _run(path, params_list, **flags):
    llm = LLM(path, **{**ENGINE, **flags})
    engine = llm.llm_engine
    try:
        outs = llm.generate(_prompts(len(params_list)), params_list, use_tqdm=False)
        stats = engine.drafter.totals.copy() if engine.drafter is not None else None
        assert not engine.has_unfinished_requests()
        return outs, stats, llm.get_tokenizer()
    finally:
        engine.shutdown()


def _constraints():
    return [_json(ROWS), _json(SCHEMAS[5]), _json(SCHEMAS[20]), StructuredOutputsParams(regex=REGEX),
            _json(ROWS), StructuredOutputsParams(choice=["alpha beta", "alpha gamma", "delta"])]


def _check(outs, constraints):
    for o, c in zip(outs, constraints):
        out = o.outputs[0]
        assert out.finish_reason == "stop", (out.finish_reason, out.text)
        if c.json is not None:
            jsonschema.validate(json.loads(out.text, strict=False), c.json)
        elif c.regex is not None:
            assert re.fullmatch(c.regex, out.text), out.text
        else:
            assert out.text in c.choice


@pytest.mark.parametrize("executor", ["uni", "mp"])
def test_greedy_tokens_with_ngram_are_those_without_it(tiny_model_factory, executor):
    path, _ = tiny_model_factory("llama")
    constraints = _constraints()
    params = [SamplingParams(temperature=0, max_tokens=200, structured_outputs=c) for c in constraints]
    expected, _, _ = _run(path, params, distributed_executor_backend=executor)
    got, stats, _ = _run(path, params, speculative_config=NGRAM, distributed_executor_backend=executor)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    _check(got, constraints)
    assert stats.num_drafts >= 5 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_sampled_outputs_with_ngram_all_validate(tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    constraints = _constraints()
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=200, structured_outputs=c)
              for i, c in enumerate(constraints)]
    got, stats, _ = _run(path, params, speculative_config=NGRAM)
    _check(got, constraints)
    assert stats.num_drafts >= 5 and stats.num_accepted_tokens > 0
    again, _, _ = _run(path, params, speculative_config=NGRAM)  # seeded: reproducible with drafts
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in got]


def test_mask_rows_per_draft_position_and_the_matcher_is_rolled_back(smol_tokenizer):
    """The manager's rows for a request with drafts: row j is the mask after its first j drafts; a draft the
    grammar refuses leaves the later rows all ones (never sampled); with a reasoning parser, rows inside the
    thinking are all ones and the ones after a drafted </think> follow the grammar; the matcher ends where
    it started."""
    from types import SimpleNamespace

    from kvserve.structured_output.bitmask import allowed_tokens
    from kvserve.structured_output.compiler import GrammarCompiler
    from kvserve.structured_output.manager import StructuredOutputManager

    tok = smol_tokenizer
    vocab = len(tok)
    start, end = (tok.encode(m, add_special_tokens=False) for m in ("<think>", "</think>"))
    compiler = GrammarCompiler(tok, vocab, [tok.eos_token_id])
    so = StructuredOutputManager(compiler, vocab, reasoning_start_ids=start, reasoning_end_ids=end)
    regex = StructuredOutputsParams(regex="[0-9]{2}x")
    compiler.compile(regex)
    one, two, x = (tok.encode(c, add_special_tokens=False)[0] for c in "12x")
    letter = tok.encode("q", add_special_tokens=False)[0]

    def rows(rid, drafts):
        sched = SimpleNamespace(request_id=rid, needs_sample=True, spec_token_ids=drafts)
        bitmask, first = so.grammar_bitmask([sched])
        return allowed_tokens(bitmask, vocab)[first[rid]:first[rid] + 1 + len(drafts)]

    so.add_request("answer", regex, end)  # the prompt closed the thinking: constrained from the start
    assert so.status("answer") == "ready"
    r = rows("answer", [one, two, x])
    assert r[0][one] and not r[0][x] and r[1][two] and not r[1][x] and r[2][x] and not r[2][one]
    assert r[3][tok.eos_token_id] and r[3].sum() == 1  # after "12x" only the end
    r = rows("answer", [letter, one])  # the grammar refuses the first draft: later rows are all ones
    assert not r[0][letter] and r[1].all() and r[2].all()
    assert rows("answer", [])[0][one] and not rows("answer", [])[0][x]  # rolled back to where it started

    so.add_request("thinker", regex, start)  # the thinking is open
    assert so.status("thinker") == "ready"
    sched = SimpleNamespace(request_id="thinker", needs_sample=True, spec_token_ids=[])
    assert so.grammar_bitmask([sched]) == (None, {})  # thinking, no drafts: unconstrained
    r = rows("thinker", [letter, *end, one, two])
    assert r[:1 + len(end)].all()  # inside the thinking
    after = 1 + len(end)
    assert r[after][one] and not r[after][letter] and r[after + 1][two] and not r[after + 2][one]
    assert so.accept_token("thinker", letter) is False and so.grammar_bitmask([sched]) == (None, {})



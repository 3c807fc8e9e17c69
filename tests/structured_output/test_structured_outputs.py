"""Structured outputs in the engine (tiny random model, temperature 1): every sample of every constraint
holds, with n > 1, preemption, async scheduling, prefix caching, chunked prefill and the mp executor."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from kvserve import LLM, SamplingParams, StructuredOutputsParams
from tests.structured_schemas import SCHEMAS

# An EBNF grammar (xgrammar's GBNF dialect): sums of small numbers.
SUM_GRAMMAR = 'root ::= term (" + " term){0,3}\nterm ::= [1-9] [0-9]?'
SUM_RE = re.compile(r"[1-9][0-9]?( \+ [1-9][0-9]?){0,3}")


@pytest.fixture(scope="module")
def llama(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def llm(llama):
    return LLM(llama[0], max_model_len=512, kv_cache_memory_bytes=64 << 20)


def _json(schema, **kw) -> StructuredOutputsParams:
    # No optional whitespace: a random model would otherwise spend its tokens on it.
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True, **kw)


def _params(constraint, n=1, max_tokens=200, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, n=n, max_tokens=max_tokens, structured_outputs=constraint, **kw)


def _loads(text: str):
    # strict=False: xgrammar 0.2.9 lets a length-bounded string hold raw control characters (its grammar for
    # them is [^"\\\r\n]); the value is still checked against the schema.
    return json.loads(text, strict=False)


def _check_json(outputs, schema) -> None:
    for c in outputs:
        assert c.finish_reason == "stop", (c.finish_reason, c.text)
        jsonschema.validate(_loads(c.text), schema)


def test_thirty_schemas_ten_samples_each_validate(llm):
    assert len(SCHEMAS) >= 30
    prompts, params = [], []
    for i, schema in enumerate(SCHEMAS):
        p = _params(_json(schema))
        for j in range(10):
            prompts.append({"prompt_token_ids": [5 + i, 7 + j, 11]})
            params.append(p)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for k, o in enumerate(outs):
        _check_json(o.outputs, SCHEMAS[k // 10])


def test_regex_choice_grammar_and_json_object(llm):
    prompts = [{"prompt_token_ids": [9, 10 + j]} for j in range(10)]
    regex = r"[a-c]{2,4}-\d{2}"
    for o in llm.generate(prompts, _params(StructuredOutputsParams(regex=regex)), use_tqdm=False):
        assert re.fullmatch(regex, o.outputs[0].text), o.outputs[0].text
    choices = ["yes", "no", "maybe so", 'a "quoted" one']
    got = {o.outputs[0].text for o in llm.generate(prompts, _params(StructuredOutputsParams(choice=choices)),
                                                    use_tqdm=False)}
    assert got <= set(choices) and got
    for o in llm.generate(prompts, _params(StructuredOutputsParams(grammar=SUM_GRAMMAR)), use_tqdm=False):
        assert SUM_RE.fullmatch(o.outputs[0].text), o.outputs[0].text
    # Any JSON object: the model may nest it deep, so only finished ones are checked for being objects.
    for o in llm.generate(prompts, _params(StructuredOutputsParams(json_object=True), max_tokens=60),
                          use_tqdm=False):
        c = o.outputs[0]
        assert c.text.startswith("{")
        if c.finish_reason == "stop":
            assert isinstance(_loads(c.text), dict)


def test_n4_samples_each_follow_the_schema(llm):
    schema = SCHEMAS[1]
    outs = llm.generate([{"prompt_token_ids": [3, 4, 5]}] * 3, _params(_json(schema), n=4), use_tqdm=False)
    for o in outs:
        assert len(o.outputs) == 4
        _check_json(o.outputs, schema)
    assert len({c.text for o in outs for c in o.outputs}) > 1  # the samples differ


def test_max_tokens_mid_object_is_length(llm):
    schema = {"type": "object", "properties": {"a": {"type": "string", "minLength": 20, "maxLength": 30}},
              "required": ["a"]}
    c = llm.generate([{"prompt_token_ids": [3, 4]}], _params(_json(schema), max_tokens=4), use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 4
    assert c.text.startswith('{"a":')


def test_logprobs_and_stop_strings_with_a_constraint(llm):
    p = _params(StructuredOutputsParams(regex=r"(ab|cd){3}xyz"), logprobs=2, stop=["xy"])
    c = llm.generate([{"prompt_token_ids": [3, 4]}], p, use_tqdm=False)[0].outputs[0]
    assert re.fullmatch(r"(ab|cd){3}", c.text), c.text
    assert c.finish_reason == "stop" and c.stop_reason == "xy"
    assert len(c.logprobs) == len(c.token_ids)
    for tok, entry in zip(c.token_ids, c.logprobs):
        assert tok in entry and entry[tok].logprob > -1e9  # the chosen token was allowed


def test_a_repeated_schema_compiles_once(llm):
    compiler = llm.llm_engine.structured_output.compiler
    schema = {"type": "object", "properties": {"only_here": {"type": "integer"}}, "required": ["only_here"]}
    before = compiler.num_compiles
    for _ in range(3):
        llm.generate([{"prompt_token_ids": [3]}] * 2, _params(_json(schema), n=2), use_tqdm=False)
    assert compiler.num_compiles == before + 1


def test_invalid_constraints_are_value_errors(llm):
    with pytest.raises(ValueError, match="regex"):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(regex="(")), use_tqdm=False)
    with pytest.raises(ValueError, match="json"):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "foo"})),
                     use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="limit"):
        StructuredOutputsParams(regex="a" * 100_000)
    assert not llm.llm_engine.has_unfinished_requests()


def test_preemption_prefix_caching_chunked_prefill_and_async(llama):
    """A KV cache so small that requests are preempted, 24-token prefill chunks, shared prefixes, async
    scheduling: every output still follows its schema."""
    schema = SCHEMAS[-1]
    prefix = list(range(100, 140))
    prompts = [{"prompt_token_ids": prefix + [200 + j]} for j in range(8)]
    for async_scheduling in (False, True):
        llm = LLM(llama[0], max_model_len=160, num_gpu_blocks_override=14, max_num_batched_tokens=24, max_num_seqs=6,
                  async_scheduling=async_scheduling)
        outs = llm.generate(prompts, _params(_json(schema), max_tokens=100), use_tqdm=False)
        stats = llm.llm_engine.get_stats()
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
        for o in outs:
            _check_json(o.outputs, schema)


def test_greedy_tokens_unchanged_by_a_constraint_they_satisfy(llm):
    """The constraint changes nothing when the unconstrained greedy output already satisfies it."""
    prompt = [{"prompt_token_ids": [3, 4, 5, 6]}]
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    tokens = free.outputs[0].token_ids
    tok = llm.get_tokenizer()
    # A grammar of exactly those tokens' text, then anything: greedy must walk the same tokens.
    text = tok.decode(tokens)
    regex = re.escape(text) + r"(.|\n)*"
    constrained = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                               structured_outputs=StructuredOutputsParams(regex=regex)), use_tqdm=False)[0]
    assert constrained.outputs[0].token_ids == tokens


def test_mp_executor(llama):
    llm = LLM(llama[0], max_model_len=256, kv_cache_memory_bytes=32 << 20, distributed_executor_backend="mp")
    try:
        schema = SCHEMAS[11]
        outs = llm.generate([{"prompt_token_ids": [3, 4 + j]} for j in range(6)], _params(_json(schema), n=2),
                            use_tqdm=False)
        for o in outs:
            _check_json(o.outputs, schema)
    finally:
        llm.llm_engine.shutdown()

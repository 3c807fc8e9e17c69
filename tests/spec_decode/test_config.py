"""--speculative-config: vLLM's keys and defaults parsed once, every bad value refused with what to do."""

from __future__ import annotations

import pytest

from kvserve.config import EngineArgs
from kvserve import speculative_config as spec_config
from kvserve.speculative_config import SpeculativeConfig, parse_speculative_config


def test_ngram_defaults_are_vllms():
    parse = parse_speculative_config
    assert parse('{"method": "ngram", "num_speculative_tokens": 3}') == SpeculativeConfig(
        "ngram", 3, prompt_lookup_min=5, prompt_lookup_max=5)
    assert parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}).prompt_lookup_min == 4
    assert parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}).prompt_lookup_max == 2
    got = parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 6})
    assert (got.prompt_lookup_min, got.prompt_lookup_max) == (2, 6)
    assert parse(None) is None and parse("") is None and parse({}) is None


def test_method_follows_from_the_model_name_as_in_vllm():
    assert parse_speculative_config({"model": "org/EAGLE3-LLaMA3.1-8B", "num_speculative_tokens": 3}).method == "eagle3"
    assert parse_speculative_config({"model": "/m/tiny-draft", "num_speculative_tokens": 3}).method == "draft_model"
    assert parse_speculative_config({"model": "[ngram]", "num_speculative_tokens": 3}).method == "ngram"


def test_a_parsed_config_is_checked_again_against_its_target():
    spec = parse_speculative_config({"method": "draft_model", "model": "d", "num_speculative_tokens": 2,
                                     "draft_tensor_parallel_size": 2}, target_tensor_parallel_size=2)
    assert parse_speculative_config(spec, target_tensor_parallel_size=2) == spec
    with pytest.raises(ValueError, match="must equal --tensor-parallel-size 1"):
        parse_speculative_config(spec, target_tensor_parallel_size=1)


@pytest.mark.parametrize("value, message", [
    ("{method: ngram}", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ({"num_speculative_tokens": 3}, '"method" is required'),
    ({"method": "ngram"}, '"num_speculative_tokens" is required'),
    ({"method": "ngram", "num_speculative_tokens": 0}, "integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": True}, "integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     r"prompt_lookup_min \(4\) must be <= prompt_lookup_max \(2\)"),
    ({"method": "ngram", "num_speculative_tokens": 3, "model": "m"}, "takes no \"model\""),
    ({"method": "draft_model", "num_speculative_tokens": 3}, "needs \"model\""),
    ({"method": "eagle3", "num_speculative_tokens": 3, "model": "h", "prompt_lookup_max": 3}, "ngram only"),
    ({"method": "eagle", "num_speculative_tokens": 3, "model": "h"}, "use an EAGLE-3 head"),
    ({"method": "medusa", "num_speculative_tokens": 3, "model": "h"}, "not supported"),
    ({"method": "lookahead", "num_speculative_tokens": 3}, "not one of ngram, draft_model, eagle3"),
    ({"method": "ngram", "num_speculative_tokens": 3, "speculative_token_tree": "[(0,)]"}, "tree drafts"),
    ({"method": "draft_model", "model": "d", "num_speculative_tokens": 3, "quantization": "fp8"}, "quantized draft"),
    ({"method": "ngram", "num_speculative_tokens": 3, "num_lookahead": 2}, 'unknown key "num_lookahead"'),
    ({"method": "ngram", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic"}, "only 'standard'"),
    ({"method": "draft_model", "model": "d", "num_speculative_tokens": 3, "tensor_parallel_size": 2},
     "draft_tensor_parallel_size"),
    ({"method": "draft_model", "model": "d", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 2},
     "must equal --tensor-parallel-size 1"),
    ({"method": "ngram", "num_speculative_tokens": 3, "draft_sample_method": "probabilistic"}, "needs a draft model"),
])
def test_bad_values_are_refused_with_the_key(value, message):
    with pytest.raises(ValueError, match="--speculative-config: .*" + message):
        parse_speculative_config(value)


def test_engine_args_parse_once_and_gate_on_runnable_methods(monkeypatch):
    with pytest.raises(ValueError, match="--speculative-config: .*num_speculative_tokens"):
        EngineArgs(speculative_config={"method": "ngram"})
    monkeypatch.setattr(spec_config, "RUNNABLE_METHODS", ("ngram",))
    args = EngineArgs(speculative_config='{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}')
    assert args.speculative_config == SpeculativeConfig("ngram", 2, prompt_lookup_min=3, prompt_lookup_max=3)
    with pytest.raises(ValueError, match="method draft_model is not supported yet"):
        EngineArgs(speculative_config={"method": "draft_model", "model": "d", "num_speculative_tokens": 2})


def test_cli_flag_and_short_form_reach_engine_args(monkeypatch):
    from kvserve.entrypoints.cli import build_parser
    from kvserve.entrypoints.cli_args import engine_args_from_namespace

    monkeypatch.setattr(spec_config, "RUNNABLE_METHODS", ("ngram",))
    for flag in ("--speculative-config", "-sc"):
        ns = build_parser().parse_args(["serve", "m", flag, '{"method": "ngram", "num_speculative_tokens": 4}'])
        assert engine_args_from_namespace(ns, ns.model_tag).speculative_config.num_speculative_tokens == 4

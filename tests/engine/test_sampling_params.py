"""SamplingParams: vLLM's fields, defaults and validation (a ValueError that names the field)."""

from __future__ import annotations

import pytest

from kvserve.sampling_params import RequestOutputKind, SamplingParams


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(n=0), "n"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=1.1), "min_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=3, max_tokens=2), "min_tokens"),
        (dict(logprobs=-2), "logprobs"),
        (dict(prompt_logprobs=-5), "prompt_logprobs"),
        (dict(stop=["ok", ""]), "stop"),
        (dict(stop="x", detokenize=False), "stop"),
        (dict(stop_token_ids=[1.5]), "stop_token_ids"),
        (dict(bad_words=[" "]), "bad_words"),
        (dict(logit_bias={5: float("nan")}), "logit_bias"),
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
        (dict(output_kind="delta"), "output_kind"),
    ],
)
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field} .*"):
        SamplingParams(**kwargs)


def test_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (1, 1.0, 1.0, 0, 0.0, 16)
    assert p.output_kind == RequestOutputKind.CUMULATIVE and p.skip_special_tokens and p.detokenize
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(logit_bias={"7": 2}).logit_bias == {7: 2.0}  # JSON keys are strings
    # Greedy turns the filters off (they cannot change an argmax), so the batch can take the fast path.
    g = SamplingParams(temperature=0, top_k=5, top_p=0.5, min_p=0.1)
    assert g.is_greedy and (g.top_k, g.top_p, g.min_p) == (0, 1.0, 0.0)
    assert SamplingParams(temperature=1e-3).temperature == 1e-2  # vLLM's floor against inf/nan
    assert SamplingParams(stop=["ab", "abcd"]).output_text_buffer_length == 3
    assert SamplingParams(stop=["abcd"], include_stop_str_in_output=True).output_text_buffer_length == 0


def test_resolution_against_model_and_tokenizer(smol_tokenizer):
    p = SamplingParams(stop_token_ids=[7], bad_words=["hello"])
    p.update_from_model(eos_token_id=2, extra_eos_token_ids=[2, 9])
    assert p.all_stop_token_ids == {2, 7, 9}
    assert p.stop_token_ids == [7, 9]  # the model's other EOS ids stop too (vLLM)
    p.update_from_tokenizer(smol_tokenizer)
    assert smol_tokenizer.encode("hello", add_special_tokens=False) in p.bad_words_token_ids
    assert smol_tokenizer.encode(" hello", add_special_tokens=False) in p.bad_words_token_ids
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={10**6: 1.0}).verify_token_ids(1000)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[1, 5000]).verify_token_ids(1000)


def test_clone_is_independent():
    p = SamplingParams(stop=["a"], logit_bias={1: 1.0})
    c = p.clone()
    c.stop.append("b")
    c.logit_bias[2] = 1.0
    assert p.stop == ["a"] and p.logit_bias == {1: 1.0}

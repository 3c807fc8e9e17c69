"""LLM.chat: chat templates rendered in a jinja2 sandbox (in the server's render worker), one or many conversations."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams

SHORT = SamplingParams(temperature=0, max_tokens=2)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    # The tiny checkpoints carry SmolLM2's tokenizer, chat template included.
    return LLM(tiny_model_factory("llama")[0], max_model_len=256, kv_cache_memory_bytes=8 << 20)


def test_renders_the_tokenizers_template(llm):
    (out,) = llm.chat(QUESTION, SHORT, use_tqdm=False)
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in out.prompt
    assert out.prompt.endswith("<|im_start|>assistant\n")
    assert out.prompt_token_ids == llm.get_tokenizer().encode(out.prompt, add_special_tokens=False)
    assert len(out.outputs[0].token_ids) == 2


def test_many_conversations_and_options(llm):
    convs = [QUESTION, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How"}]]
    outs = llm.chat(convs, SHORT, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    assert len(outs) == 2
    assert outs[1].prompt.endswith("Hello! How")  # the reply is continued, not closed
    custom = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
              "{{ 'bot:' if add_generation_prompt }}")
    (out,) = llm.chat(QUESTION, SHORT, use_tqdm=False, chat_template=custom)
    assert out.prompt == "[user] What is the capital of France?\nbot:"
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(QUESTION, SHORT, use_tqdm=False, continue_final_message=True)


def test_templates_run_sandboxed(llm):
    escape = "{{ ().__class__.__base__.__subclasses__() }}"
    with pytest.raises(ValueError, match="could not render conversation 0: SecurityError"):
        llm.chat(QUESTION, SHORT, use_tqdm=False, chat_template=escape)
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.slow
def test_smollm2_knows_the_capital_of_france():
    llm = LLM(max_model_len=512)
    (out,) = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason in ("stop", "length")

"""Incremental detokenization and stop strings, for byte-level BPE (SmolLM2) and a sentencepiece-style
tokenizer (byte fallback, leading-space stripping), one token at a time as the engine feeds them."""

from __future__ import annotations

import json

import pytest

from kvserve.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from kvserve.sampling_params import SamplingParams

TEXTS = [
    "Hello world, this is plain text.",
    "Café, naïve élève: 日本語 and emoji 🎉🚀 mixed in.",
    " leading space and  double  spaces\nnewline",
]


@pytest.fixture(scope="module")
def sp_tokenizer():
    """A Llama-style tokenizer built in memory: BPE with byte fallback, '▁' for spaces, a decoder that
    strips the leading space. CJK and emoji are not in its vocabulary, so they decode from byte tokens."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tk.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    corpus = ["Hello world, this is a small corpus for a tiny tokenizer.", "The capital of France is Paris.",
              "Café, naïve élève: à l'école.", "Numbers 12345 and symbols #@!"] * 20
    trainer = trainers.BpeTrainer(vocab_size=150, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tk.train_from_iterator(corpus, trainer)
    # The byte tokens are ordinary vocabulary entries (not special), as in Llama's tokenizer.
    spec = json.loads(tk.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    tk = Tokenizer.from_str(json.dumps(spec))
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    assert tok.convert_ids_to_tokens(tok.encode("日", add_special_tokens=False))[-3:] == ["<0xE6>", "<0x97>", "<0xA5>"]
    assert tok.decode(tok.encode(" Paris", add_special_tokens=False)) == "Paris"  # the leading space is stripped
    return tok


@pytest.fixture(params=["bpe", "sentencepiece"])
def tokenizer(request, smol_tokenizer, sp_tokenizer):
    return smol_tokenizer if request.param == "bpe" else sp_tokenizer


def _feed(tok, prompt: str, output_ids: list[int], params: SamplingParams, delta: bool = True):
    """Feeds tokens one by one; returns (the detokenizer, streamed chunks, the stop string or None)."""
    detok = IncrementalDetokenizer(tok, tok.encode(prompt, add_special_tokens=False), params)
    chunks, stop = [], None
    for i, t in enumerate(output_ids):
        last = i == len(output_ids) - 1
        stop = detok.update([t], stop_terminated=False, finished=last)
        chunks.append(detok.get_next_output_text(finished=last or stop is not None, delta=delta))
        if stop is not None:
            break
    return detok, chunks, stop


def _expected(tok, prompt_ids: list[int], output_ids: list[int], skip_special: bool = True) -> str:
    """The output's text as decoding prompt + output in one go gives it."""
    full = tok.decode(prompt_ids + output_ids, skip_special_tokens=skip_special)
    head = tok.decode(prompt_ids, skip_special_tokens=skip_special)
    assert full.startswith(head)
    return full[len(head):]


@pytest.mark.parametrize("text", TEXTS)
def test_text_matches_one_shot_decode(tokenizer, text):
    prompt = "Say something:"
    out_ids = tokenizer.encode(text, add_special_tokens=False)
    if tokenizer.decode(out_ids[:1]) and text[0] != " ":
        out_ids = tokenizer.encode(" " + text, add_special_tokens=False)  # a continuation starts a new word
    detok, chunks, _ = _feed(tokenizer, prompt, out_ids, SamplingParams())
    expected = _expected(tokenizer, tokenizer.encode(prompt, add_special_tokens=False), out_ids)
    assert detok.output_text == "".join(chunks) == expected
    assert not any("\ufffd" in c for c in chunks), "an incomplete character was emitted"
    assert "🎉" not in text or any(c.endswith("🎉") or "🎉" in c for c in chunks)


@pytest.mark.parametrize("stop_terminated", [False, True])
def test_final_only_decodes_once_to_the_same_text(tokenizer, stop_terminated):
    """Without streaming or stop strings the text is decoded once at the end: same result."""
    ids = tokenizer.encode(" " + TEXTS[1], add_special_tokens=False) + [tokenizer.eos_token_id]
    prompt = tokenizer.encode("Say:", add_special_tokens=False)
    texts = []
    for stream in (True, False):
        detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams(), stream=stream)
        assert detok.lazy is not stream
        for i, t in enumerate(ids):
            last = i == len(ids) - 1
            detok.update([t], stop_terminated=stop_terminated and last, finished=last)
        texts.append(detok.get_next_output_text(finished=True, delta=False))
    assert texts[0] == texts[1] == " " + TEXTS[1]


def test_multibyte_character_split_over_tokens_is_held_back(smol_tokenizer):
    tok = smol_tokenizer
    ids = tok.encode(" 🎉", add_special_tokens=False)
    assert len(ids) >= 2, "the emoji should take several byte-level tokens"
    _, chunks, _ = _feed(tok, "Party:", ids, SamplingParams())
    assert chunks[:-1] == [""] * (len(ids) - 1) and chunks[-1] == " 🎉"


def test_special_tokens(tokenizer):
    eos = tokenizer.eos_token_id
    words = tokenizer.encode(" one two", add_special_tokens=False)
    ids = words[:1] + [eos] + words[1:]
    prompt_ids = tokenizer.encode("Count:", add_special_tokens=False)
    skipped, _, _ = _feed(tokenizer, "Count:", ids, SamplingParams())
    assert skipped.output_text == _expected(tokenizer, prompt_ids, ids)
    assert tokenizer.eos_token not in skipped.output_text
    kept, _, _ = _feed(tokenizer, "Count:", ids, SamplingParams(skip_special_tokens=False))
    assert tokenizer.eos_token in kept.output_text
    assert kept.output_text == _expected(tokenizer, prompt_ids, ids, skip_special=False)


@pytest.mark.parametrize("stop, include, expected_text", [
    ("of France", False, " The capital "),  # spans two tokens or more
    ("of France", True, " The capital of France"),
    ("本", False, " The capital of France is Paris 日"),  # a multi-byte character split over byte tokens
    ("本", True, " The capital of France is Paris 日本"),
    ("🎉", False, " The capital of France is Paris 日本 "),
])
def test_stop_strings(tokenizer, stop, include, expected_text):
    text = " The capital of France is Paris 日本 🎉 and more text after it"
    ids = tokenizer.encode(text, add_special_tokens=False)
    params = SamplingParams(stop=[stop, "never appears"], include_stop_str_in_output=include)
    detok, chunks, found = _feed(tokenizer, "Q:", ids, params)
    assert found == stop
    assert detok.output_text == expected_text
    assert "".join(chunks) == expected_text
    # The stop string's tokens were all consumed, none after the one that completed it.
    n = detok.num_output_tokens
    assert stop in tokenizer.decode(ids[:n]) and stop not in tokenizer.decode(ids[:n - 1])


def test_stream_never_emits_what_a_stop_string_later_removes(smol_tokenizer):
    tok = smol_tokenizer
    text = " a b Paris c Pari d Paris!"
    ids = tok.encode(text, add_special_tokens=False)
    params = SamplingParams(stop=["Paris!"])
    detok, chunks, found = _feed(tok, "Q:", ids, params)
    assert found == "Paris!" and detok.output_text == " a b Paris c Pari d "
    streamed = ""
    for c in chunks:
        streamed += c
        assert detok.output_text.startswith(streamed)
    assert streamed == detok.output_text
    # Cumulative mode shows the same text, held back by len(stop) - 1 characters until the end.
    cumulative = IncrementalDetokenizer(tok, [], params)
    cumulative.update(ids[:4], stop_terminated=False, finished=False)
    shown = cumulative.get_next_output_text(finished=False, delta=False)
    assert shown == cumulative.output_text[:len(cumulative.output_text) - 5]


def test_stop_terminated_token_is_not_in_text(smol_tokenizer):
    tok = smol_tokenizer
    ids = tok.encode(" one two", add_special_tokens=False)
    stop_tok = ids[-1]
    detok = IncrementalDetokenizer(tok, [5], SamplingParams(stop_token_ids=[stop_tok]))
    detok.update(ids[:-1], stop_terminated=False, finished=False)
    detok.update([stop_tok], stop_terminated=True, finished=True)
    assert detok.output_text == tok.decode(ids[:-1])
    kept = IncrementalDetokenizer(tok, [5], SamplingParams(stop_token_ids=[stop_tok], include_stop_str_in_output=True))
    kept.update(ids, stop_terminated=True, finished=True)
    assert kept.output_text == tok.decode(ids)


def test_min_tokens_defers_stop_strings(smol_tokenizer):
    tok = smol_tokenizer
    ids = tok.encode(" x y x y", add_special_tokens=False)
    assert len(ids) == 4
    _, _, found = _feed(tok, "Q:", ids[:2], SamplingParams(stop=["x"], min_tokens=2, max_tokens=8))
    assert found is None  # the only "x" lies inside the first min_tokens tokens
    detok, _, found = _feed(tok, "Q:", ids, SamplingParams(stop=["x"], min_tokens=2, max_tokens=8))
    assert found == "x" and detok.output_text == " x y "


def test_find_stop_string_picks_the_earliest():
    assert find_stop_string("abcdef", 6, ["ef", "cd"], include=False) == ("cd", 2)
    assert find_stop_string("abcdef", 6, ["cd"], include=True) == ("cd", 4)
    assert find_stop_string("abcdef", 1, ["bc"], include=False) is None  # searched before
    assert find_stop_string("abcdef", 1, ["ef"], include=False) == ("ef", 4)

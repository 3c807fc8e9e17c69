"""A constrained output is valid UTF-8: the mask never allows a token whose bytes make the output so far an
ill-formed UTF-8 sequence (an overlong form, a UTF-16 surrogate, a code point past U+10FFFF, a stray
continuation byte), though the grammar library itself may (xgrammar 0.2.9 lets a string hold the surrogate
bytes ED A0..BF; 0.2.7 also overlong and out-of-range forms, so a maxLength string grew past its bound).
Oracle: Python's strict incremental UTF-8 decoder on each token's bytes, read from the tokenizer's own
byte-level alphabet (not from the grammar library)."""

from __future__ import annotations

import codecs
import itertools
import json
import time
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import pytest
import torch

from kvserve import LLM, SamplingParams, StructuredOutputsParams
from kvserve.structured_output.bitmask import allowed_tokens
from kvserve.structured_output.compiler import GrammarCompiler, StructuredOutputsConfig
from kvserve.structured_output.manager import StructuredOutputManager

VOCAB = 49152
SCHEMA = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 4}}, "required": ["s"],
          "additionalProperties": False}
# Inside the string, after each of these bytes (one single-byte token each): what may follow.
LLAMA31 = next((base / "shared" / "tokenizers" / "llama-3.1" for base in Path(__file__).resolve().parents
                if (base / "shared" / "tokenizers" / "llama-3.1" / "tokenizer.json").exists()), Path("/nonexistent"))
PARTIAL = [b"", b"\xed", b"\xe0", b"\xf0", b"\xf4", b"\xe2", b"\xe2\x82", b"\xf0\x9f", b"\xf0\x9f\x98", b"\xc3"]


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character each byte is written as in the vocabulary -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _token_bytes(tokenizer) -> dict[int, bytes]:
    """Each text token's bytes (special tokens left out)."""
    alphabet = _byte_alphabet()
    special = set(tokenizer.all_special_ids)
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return {i: bytes(alphabet[c] for c in piece) for i, piece in enumerate(pieces) if i not in special}


@pytest.fixture(scope="module")
def token_bytes(smol_tokenizer):
    return _token_bytes(smol_tokenizer)


_ENDINGS = [bytes(c) for n in (1, 2, 3) for c in itertools.product((0x80, 0x90, 0xA0, 0xBF), repeat=n)]


def _valid_prefix(data: bytes) -> bool:
    """Whether some bytes can follow `data` to make it well-formed UTF-8 (Python's decoder holds back an
    unfinished character without judging it, so its possible endings are tried)."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    try:
        decoder.decode(data, final=False)
    except UnicodeDecodeError:
        return False
    held = decoder.getstate()[0]
    return not held or any(_decodes(held + ending) for ending in _ENDINGS)


def _decodes(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _ready(mgr, rid):
    while mgr.status(rid) == "waiting":
        time.sleep(0.01)
    assert mgr.status(rid) == "ready"


def _rows_inside_a_string(tokenizer, token_bytes, backend, schema=SCHEMA, prefix=None, vocab=VOCAB):
    """Per partial character after `prefix`: (the grammar, the tokens so far, the text tokens the manager's
    row allows, the text tokens that keep the output well-formed)."""
    compiler = GrammarCompiler(tokenizer, vocab, [tokenizer.eos_token_id], StructuredOutputsConfig(backend=backend))
    mgr = StructuredOutputManager(compiler, vocab)
    byte_token = {b[0]: t for t, b in token_bytes.items() if len(b) == 1}
    if prefix is None:
        prefix = '{"s": "' if backend == "xgrammar" else '{"s":"'  # each library's compact JSON
    constraint = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    for k, partial in enumerate(PARTIAL):
        mgr.add_request(str(k), constraint, [1])
        _ready(mgr, str(k))
        tokens = tokenizer.encode(prefix, add_special_tokens=False) + [byte_token[b] for b in partial]
        for t in tokens:
            assert not mgr.accept_token(str(k), t)
        bitmask, _ = mgr.grammar_bitmask([SimpleNamespace(request_id=str(k), needs_sample=True)])
        keeps_utf8 = {t for t, b in token_bytes.items() if _valid_prefix(prefix.encode() + partial + b)}
        yield compiler.compile(constraint), tokens, _text_tokens(bitmask, token_bytes, vocab), keeps_utf8
        mgr.free(str(k))


def _text_tokens(bitmask, token_bytes, vocab=VOCAB) -> set[int]:
    return {t for t in torch.nonzero(allowed_tokens(bitmask, vocab)[0]).flatten().tolist() if t in token_bytes}


def _check_xgrammar_rows(rows, token_bytes, vocab):
    import xgrammar as xgr

    for grammar, tokens, allowed, keeps_utf8 in rows:
        m = xgr.GrammarMatcher(grammar.compiled)  # the library alone
        for t in tokens:
            assert m.accept_token(t)
        bitmask = xgr.allocate_token_bitmask(1, vocab)
        m.fill_next_token_bitmask(bitmask, 0)
        library = _text_tokens(bitmask, token_bytes, vocab)
        assert allowed == library & keeps_utf8, (tokens[-3:], [token_bytes[t] for t in sorted(library - allowed)][:8],
                                                  [token_bytes[t] for t in sorted(allowed - library)][:8])
        assert allowed, tokens  # some continuation of a partial character is allowed


def test_xgrammar_rows_lose_exactly_the_tokens_that_break_utf8(smol_tokenizer, token_bytes):
    _check_xgrammar_rows(_rows_inside_a_string(smol_tokenizer, token_bytes, "xgrammar"), token_bytes, VOCAB)


@pytest.mark.skipif(not LLAMA31.exists(), reason="the Llama 3.1 tokenizer is in the team's shared/ folder")
def test_the_gpu_benchmarks_invalid_string_with_the_llama31_tokenizer():
    """benchmarks/gpu_structured.py's schema and the string one output broke maxLength with: one character
    left, then bytes that are no character."""
    import transformers

    from benchmarks.gpu_structured import SCHEMA as W1_SCHEMA

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(LLAMA31))
    token_bytes = _token_bytes(tokenizer)
    prefix = ('{"id": 1, "name": "abcd", "status": "active", "tags": ["ab"], "lines": [{"sku": "ABC-1234", '
              '"qty": 1, "note": "?' + "Wil" * 10)
    rows = _rows_inside_a_string(tokenizer, token_bytes, "xgrammar", W1_SCHEMA, prefix, len(tokenizer))
    _check_xgrammar_rows(rows, token_bytes, len(tokenizer))


def test_guidance_rows_keep_utf8(smol_tokenizer, token_bytes):
    for _, tokens, allowed, keeps_utf8 in _rows_inside_a_string(smol_tokenizer, token_bytes, "guidance"):
        assert allowed <= keeps_utf8, [token_bytes[t] for t in sorted(allowed - keeps_utf8)][:8]
        assert allowed, tokens


def test_greedy_output_that_prefers_surrogate_bytes_stays_valid_and_bounded(tiny_model_factory, smol_tokenizer,
                                                                            token_bytes):
    """The model's logits favour ED, then A0..BF: bytes of a UTF-16 surrogate, which the mask must refuse,
    so the string holds real characters and keeps to maxLength."""
    path, _ = tiny_model_factory("llama")
    byte_token = {b[0]: t for t, b in token_bytes.items() if len(b) == 1}
    bias = {byte_token[0xED]: 60.0, **{byte_token[b]: 40.0 for b in range(0x80, 0xC0)}}
    bias.update({byte_token[b]: 50.0 for b in range(0xA0, 0xC0)})  # the surrogate half above the rest
    llm = LLM(path, max_model_len=256, kv_cache_memory_bytes=32 << 20)
    try:
        constraint = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
        params = SamplingParams(temperature=0, max_tokens=64, logit_bias=bias, detokenize=False,
                                structured_outputs=constraint)
        outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8]}], params, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    for o in outs:
        out = o.outputs[0]
        data = b"".join(token_bytes[t] for t in out.token_ids if t in token_bytes)
        assert out.finish_reason == "stop"
        assert byte_token[0xED] in out.token_ids  # the bias did steer the string into ED sequences
        text = data.decode("utf-8")  # strict: raises on an ill-formed sequence
        jsonschema.validate(json.loads(text), SCHEMA)

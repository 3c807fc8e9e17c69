"""The structured-output pieces alone: params, the compile cache and backend order, the bitmask apply
function, the manager's matchers, the scheduler's waiting for grammars, and the reasoning parsers."""

from __future__ import annotations

import time

import pytest
import torch

from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request, RequestStatus
from kvserve.core.scheduler import Scheduler, SchedulerConfig
from kvserve.sampling_params import SamplingParams
from kvserve.structured_output.bitmask import allowed_tokens, apply_token_bitmask
from kvserve.structured_output.compiler import GrammarCompiler, StructuredOutputsConfig
from kvserve.structured_output.manager import StructuredOutputManager
from kvserve.structured_output.params import StructuredOutputsParams
from kvserve.structured_output.reasoning import REASONING_PARSERS, thinking_ended_in

VOCAB = 49152


@pytest.fixture(scope="module")
def compiler(smol_tokenizer):
    c = GrammarCompiler(smol_tokenizer, VOCAB, [smol_tokenizer.eos_token_id])
    c.warm_up().result()
    return c


def test_params_spec_is_canonical_and_checked():
    a = StructuredOutputsParams(json='{"b": 1, "a": 2}')
    b = StructuredOutputsParams(json={"a": 2, "b": 1})
    assert a.key() == b.key() and a.kind == "json"
    assert StructuredOutputsParams.from_dict({"choice": ["x"]}).kind == "choice"
    for bad in ({}, {"regex": "a", "grammar": "b"}, {"choice": []}, {"json": "{not json"}, {"regex": ""},
                {"json_object": "yes"}, {"nope": 1}):
        with pytest.raises(ValueError):
            StructuredOutputsParams.from_dict(bad)
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs.regex == "a+"
    with pytest.raises(ValueError):
        SamplingParams(structured_outputs="a+")


def test_config_from_json():
    assert StructuredOutputsConfig.from_json('{"backend": "guidance"}').backend == "guidance"
    for bad in ('{"backend": "outlines"}', "[1]", "{", '{"other": 1}'):
        with pytest.raises(ValueError):
            StructuredOutputsConfig.from_json(bad)


def test_bitmask_apply_matches_xgrammar(compiler):
    import xgrammar as xgr

    grammar = compiler.compile(StructuredOutputsParams(regex="(ab|x)[0-9]+"))
    bitmask = torch.empty((2, -(-VOCAB // 32)), dtype=torch.int32)
    grammar.new_matcher().fill_bitmask(bitmask, 0)
    bitmask[1] = -1  # a row that allows every token
    # Rows 0 and 2 of the logits get bitmask rows 0 and 1 (all allowed); row 1 is untouched.
    logits = torch.randn(3, VOCAB)
    ref = logits.clone()
    ref[0] = torch.where(allowed_tokens(bitmask[:1], VOCAB)[0], ref[0], float("-inf"))
    apply_token_bitmask(logits, bitmask, [0, 2])
    assert torch.equal(logits, ref)
    xg_in = torch.randn(1, VOCAB)
    mine = xg_in.clone()
    xgr.apply_token_bitmask_inplace(xg_in, bitmask[:1])
    apply_token_bitmask(mine, bitmask[:1], [0])
    assert torch.equal(xg_in, mine)
    assert 0 < int(allowed_tokens(bitmask[:1], VOCAB).sum()) < VOCAB


def _row_mapped_reference(logits, bitmask, rows, mask_rows):
    ref = logits.clone()
    for r, m in zip(rows, mask_rows):
        ref[r] = torch.where(allowed_tokens(bitmask[m:m + 1], VOCAB)[0], ref[r], float("-inf"))
    return ref


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("rows,mask_rows", [
    ([0, 1, 2, 3], None),  # every logits row, the bitmask's rows in order
    ([0, 1, 2, 3], [0, 1, 2, 3]),
    ([1, 3], [4, 0]),  # some rows, the bitmask's rows gathered out of order (drafts leave unused rows)
    ([2], [3]),
])
def test_bitmask_apply_maps_rows(compiler, device, rows, mask_rows):
    grammar = compiler.compile(StructuredOutputsParams(regex="(ab|x)[0-9]+"))
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, -(-VOCAB // 32)), dtype=torch.int32,
                            generator=torch.Generator().manual_seed(0))
    grammar.new_matcher().fill_bitmask(bitmask, 0)
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1))
    ref = _row_mapped_reference(logits, bitmask, rows, mask_rows or list(range(len(rows))))
    if mask_rows is None:
        bitmask = bitmask[:len(rows)]
    on_device = logits.to(device)
    apply_token_bitmask(on_device, bitmask.pin_memory() if device == "cuda" else bitmask, rows, mask_rows)
    assert torch.equal(on_device.cpu(), ref)


def test_auto_falls_back_to_guidance_and_caches(smol_tokenizer):
    c = GrammarCompiler(smol_tokenizer, VOCAB, [smol_tokenizer.eos_token_id])
    c.warm_up().result()  # the libraries' import is no part of a compile
    # An object with minProperties and no listed properties: xgrammar 0.2.9 refuses it, llguidance compiles it.
    schema = {"type": "object", "minProperties": 1}
    p = StructuredOutputsParams(json=schema)
    g = c.compile(p)
    assert type(g).__name__ == "GuidanceGrammar"
    c.compile(p)
    assert c.num_compiles == 1
    with pytest.raises(ValueError, match="xgrammar"):
        c.compile(StructuredOutputsParams(json=schema, disable_fallback=True))
    only_xgr = GrammarCompiler(smol_tokenizer, VOCAB, [2], StructuredOutputsConfig(backend="xgrammar"))
    only_xgr.warm_up().result()
    with pytest.raises(ValueError):
        only_xgr.compile(p)


def test_guidance_backend_constrains(smol_tokenizer):
    c = GrammarCompiler(smol_tokenizer, VOCAB, [smol_tokenizer.eos_token_id], StructuredOutputsConfig(backend="guidance"))
    c.warm_up().result()
    m = c.compile(StructuredOutputsParams(choice=["yes", "no"])).new_matcher()
    bitmask = torch.empty((1, -(-VOCAB // 32)), dtype=torch.int32)
    m.fill_bitmask(bitmask, 0)
    allowed = allowed_tokens(bitmask, VOCAB)[0].nonzero().flatten().tolist()
    texts = {smol_tokenizer.decode([t]) for t in allowed}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts)


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_manager_accepts_rolls_back_and_terminates(smol_tokenizer, backend):
    compiler = GrammarCompiler(smol_tokenizer, VOCAB, [smol_tokenizer.eos_token_id],
                               StructuredOutputsConfig(backend=backend))
    mgr = StructuredOutputManager(compiler, VOCAB)
    mgr.add_request("r", StructuredOutputsParams(choice=["yes"]), [1, 2])
    while mgr.status("r") == "waiting":
        time.sleep(0.01)
    assert mgr.status("r") == "ready"
    ids = smol_tokenizer.encode("yes", add_special_tokens=False)
    # Mask rows for the whole word as drafts: the matcher advances over them and is rolled back.
    from types import SimpleNamespace

    sched = SimpleNamespace(request_id="r", needs_sample=True, spec_token_ids=ids)
    bitmask, first = mgr.grammar_bitmask([sched])
    rows = allowed_tokens(bitmask, VOCAB)
    assert [rows[j][t] for j, t in enumerate(ids)] == [True] * len(ids)
    # llguidance stops as soon as nothing but the end can follow (the request ends there, so its last row
    # is never sampled); xgrammar stops at the stop token, which is all its last row allows.
    stops_early = backend == "guidance"
    assert rows[len(ids)].all() if stops_early else rows[len(ids)].sum() == 1
    assert rows[len(ids)][smol_tokenizer.eos_token_id]
    for t in ids[:-1]:
        assert not mgr.accept_token("r", t)
    if stops_early:
        assert mgr.accept_token("r", ids[-1])
    else:
        assert not mgr.accept_token("r", ids[-1])
        assert mgr.accept_token("r", smol_tokenizer.eos_token_id)  # the grammar ended: the request is done
    mgr.free("r")
    assert "r" not in mgr


def test_manager_reasoning_mask_starts_after_thinking(compiler, smol_tokenizer):
    start = smol_tokenizer.encode("<think>", add_special_tokens=False)
    end = smol_tokenizer.encode("</think>", add_special_tokens=False)
    mgr = StructuredOutputManager(compiler, VOCAB, reasoning_start_ids=start, reasoning_end_ids=end)
    mgr.add_request("a", StructuredOutputsParams(regex="[0-9]+"), [5] + start)
    mgr.add_request("b", StructuredOutputsParams(regex="[0-9]+"), [5] + start + [7] + end)  # thinking off
    for rid in "ab":
        while mgr.status(rid) == "waiting":
            time.sleep(0.01)
    assert not mgr.is_constrained_now("a") and mgr.is_constrained_now("b")
    for t in smol_tokenizer.encode("hmm, letters", add_special_tokens=False) + end:
        mgr.accept_token("a", t)
    assert mgr.is_constrained_now("a")


class _FakeGrammars:
    """Stands in for the StructuredOutputManager: which requests are constrained and whether compiled."""

    def __init__(self):
        self.status_of: dict[str, str] = {}
        self.accepted: list[tuple[str, int]] = []

    def __contains__(self, rid):
        return rid in self.status_of

    def status(self, rid):
        return self.status_of[rid]

    def accept_token(self, rid, token):
        self.accepted.append((rid, token))
        return False

    def free(self, rid):
        self.status_of.pop(rid, None)


def _scheduler(grammars):
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    return Scheduler(cfg, KVCacheManager(32, 4, True), structured_output=grammars)


def test_a_request_waiting_for_its_grammar_holds_up_no_one():
    g = _FakeGrammars()
    s = _scheduler(g)
    params = SamplingParams(max_tokens=4)
    for rid in ("slow", "free", "ready"):
        s.add_request(Request(rid, [1, 2, 3], params))
    g.status_of.update(slow="waiting", ready="ready")
    out = s.schedule()
    assert [r.request_id for r in out.scheduled] == ["free", "ready"]
    assert [r.request_id for r in s.waiting] == ["slow"]
    s.update(out, {"free": [7], "ready": [8]})
    assert g.accepted == [("ready", 8)]
    g.status_of["slow"] = "failed"
    out = s.schedule()
    assert "slow" not in [r.request_id for r in out.scheduled]
    touched = s.update(out, {r.request_id: [9] for r in out.scheduled})
    failed = [r for r in touched if r.request_id == "slow"]
    assert failed and failed[0].status == RequestStatus.FINISHED_ABORTED
    assert "slow" not in s.requests and "slow" not in g


def test_a_constrained_request_is_not_scheduled_ahead_of_its_token():
    """Async scheduling: its next mask depends on the token still in flight, so it skips one step."""
    g = _FakeGrammars()
    s = _scheduler(g)
    params = SamplingParams(max_tokens=4)
    s.add_request(Request("c", [1, 2, 3], params))
    s.add_request(Request("u", [1, 2, 3], params))
    g.status_of["c"] = "ready"
    first = s.schedule()
    second = s.schedule()  # before first's tokens are known
    assert [r.request_id for r in second.scheduled] == ["u"]
    s.update(first, {"c": [5], "u": [6]})
    s.update(second, {"u": [7]})
    assert "c" in [r.request_id for r in s.schedule().scheduled]


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_reasoning_parsers_split_whole_and_streamed(name):
    parser = REASONING_PARSERS[name]
    cases = {"<think>abc</think>\n\nhello": ("abc", "hello"), "<think>unfinished": ("unfinished", "")}
    if name == "deepseek_r1":
        cases.update({"abc</think>hi": ("abc", "hi"), "plain": ("plain", "")})
    else:
        cases.update({"plain answer": (None, "plain answer")})
    for text, expected in cases.items():
        assert parser.split(text) == expected
        for step in (1, 2, 5):
            st = parser.streamer()
            r = c = ""
            for i in range(0, len(text), step):
                dr, dc = st.feed(text[i:i + step], finished=i + step >= len(text))
                r, c = r + dr, c + dc
            assert (r or None, c) == ((expected[0] or None), expected[1])


def test_thinking_ended_in_prompt():
    assert thinking_ended_in([1, 5, 2, 6], [5], [6])
    assert not thinking_ended_in([1, 6, 5], [5], [6])
    assert not thinking_ended_in([1, 2], [5], [6])


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_filling_many_rows_at_once_equals_one_by_one(smol_tokenizer, backend):
    """A step's rows filled together (xgrammar's threaded batch) are the rows each matcher fills alone."""
    c = GrammarCompiler(smol_tokenizer, VOCAB, [smol_tokenizer.eos_token_id], StructuredOutputsConfig(backend=backend))
    grammar = c.compile(StructuredOutputsParams(json={"type": "object", "properties": {
        "a": {"type": "string", "maxLength": 8}, "b": {"enum": ["x", "yy"]}}, "required": ["a", "b"]}))
    texts = ['', '{"a": "', '{"a": "hi', '{"a": "hi", "b": ', '{"a": "hi", "b": "yy"}']
    matchers = []
    for text in texts:
        m = grammar.new_matcher()
        for t in smol_tokenizer.encode(text, add_special_tokens=False):
            assert m.accept_token(t)
        matchers.append(m)
    words = -(-VOCAB // 32)
    alone = torch.zeros((len(texts), words), dtype=torch.int32)
    for i, m in enumerate(matchers):
        m.fill_bitmask(alone, i)
    together = torch.zeros((len(texts) + 2, words), dtype=torch.int32)
    rows = [6, 0, 3, 1, 5]  # any rows, in any order
    type(matchers[0]).fill_bitmasks(matchers, together, rows)
    for i, row in enumerate(rows):
        assert torch.equal(together[row], alone[i]), texts[i]
    assert len({tuple(r.tolist()) for r in alone}) == len(texts)  # the states differ: the check can fail

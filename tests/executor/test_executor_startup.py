"""Executor start-up order: the hook the engine uses to let its tokenizer finish loading runs after the KV
cache is sized and before any rank allocates it and captures CUDA graphs (graph capture in the engine's own
process would otherwise share the GIL with the tokenizer thread)."""

from __future__ import annotations

from kvserve.config import EngineArgs
from kvserve.executor.abstract import Executor


def test_before_graph_capture_runs_between_sizing_and_allocation(tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    config = EngineArgs(path, device="cpu", max_model_len=64, kv_cache_memory_bytes=1 << 20).create_engine_config()
    executor = Executor.create(config)
    assert executor.in_engine_process  # uni: the default with one device
    calls = []
    sizing, allocation = executor.worker.determine_kv_cache_bytes, executor.worker.initialize_kv_cache
    executor.worker.determine_kv_cache_bytes = lambda: calls.append("size") or sizing()
    executor.worker.initialize_kv_cache = lambda n: calls.append("allocate + capture") or allocation(n)
    num_blocks = executor.initialize(before_graph_capture=lambda: calls.append("hook"))
    assert calls == ["size", "hook", "allocate + capture"] and num_blocks > 0
    executor.shutdown()

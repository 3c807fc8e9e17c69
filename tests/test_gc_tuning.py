"""The step loop's process raises the young-generation threshold once, and never lowers one set higher."""

import gc

from kvserve.gc_tuning import YOUNG_GENERATION, raise_young_generation_threshold


def test_raises_the_young_threshold_and_keeps_the_older_ones():
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 7)
        raise_young_generation_threshold()
        assert gc.get_threshold() == (YOUNG_GENERATION, 10, 7)
        gc.set_threshold(2 * YOUNG_GENERATION, 10, 10)
        raise_young_generation_threshold()
        assert gc.get_threshold()[0] == 2 * YOUNG_GENERATION
        gc.set_threshold(0)  # the collector's automatic runs are off: left off
        raise_young_generation_threshold()
        assert gc.get_threshold()[0] == 0
    finally:
        gc.set_threshold(*before)


def test_an_engine_sets_it_in_its_process(tiny_model_factory):
    from kvserve import LLM

    path, _ = tiny_model_factory("llama")
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        LLM(path, max_model_len=256, kv_cache_memory_bytes=16 << 20, skip_tokenizer_init=True)
        assert gc.get_threshold()[0] == YOUNG_GENERATION
    finally:
        gc.set_threshold(*before)

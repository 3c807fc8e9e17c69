"""The engine's StructuredOutputManager, built from the engine flags and the tokenizer."""

from __future__ import annotations

from kvserve.structured_output.compiler import GrammarCompiler, StructuredOutputsConfig
from kvserve.structured_output.reasoning import END, START, get_reasoning_parser


def make_structured_output_manager(args, tokenizer, vocab_size: int, stop_token_ids: list[int],
                                   pin_memory: bool = False):
    """None without a tokenizer (grammars are over its tokens). `pin_memory`: bitmasks in pinned host memory."""
    if tokenizer is None:
        return None
    from kvserve.structured_output.manager import StructuredOutputManager

    config = StructuredOutputsConfig.from_json(getattr(args, "structured_outputs_config", None))
    start_ids = end_ids = None
    if get_reasoning_parser(getattr(args, "reasoning_parser", None)) is not None:
        start_ids = tokenizer.encode(START, add_special_tokens=False)
        end_ids = tokenizer.encode(END, add_special_tokens=False)
    compiler = GrammarCompiler(tokenizer, vocab_size, list(dict.fromkeys(stop_token_ids)), config)
    compiler.warm_up()
    return StructuredOutputManager(compiler, vocab_size, reasoning_start_ids=start_ids, reasoning_end_ids=end_ids,
                                   pin_memory=pin_memory)

"""Grammar compilation off the step loop: a small thread pool, a bounded cache keyed by the constraint (a
repeated schema compiles once) and vLLM's backend choice (`auto`: xgrammar, llguidance where xgrammar
refuses the constraint).

A compile that runs past COMPILE_TIMEOUT_S is given up on by its waiter (the request is refused); the
size limit on constraints is what keeps such compiles rare.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass

from kvserve.structured_output.backend import CompiledGrammar, GrammarBackend
from kvserve.structured_output.limits import COMPILE_TIMEOUT_S
from kvserve.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "xgrammar", "guidance")
DEFAULT_CACHE_ENTRIES = 1024


@dataclass
class StructuredOutputsConfig:
    """--structured-outputs-config, with vLLM's field names."""

    backend: str = "auto"
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    reasoning_parser: str = ""  # set from --reasoning-parser

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"--structured-outputs-config: backend {self.backend!r} is not one of "
                             f"{', '.join(BACKENDS)}.")

    @classmethod
    def from_json(cls, text: str | None) -> StructuredOutputsConfig:
        if not text:
            return cls()
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ValueError(f"--structured-outputs-config is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ValueError("--structured-outputs-config must be a JSON object.")
        known = set(cls.__dataclass_fields__) - {"reasoning_parser"}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"--structured-outputs-config: unknown field(s) {', '.join(sorted(unknown))} "
                             f"(known: {', '.join(sorted(known))}).")
        return cls(**data)


class GrammarCompiler:
    """`submit(params)` -> a Future of the CompiledGrammar (ValueError inside when every backend refuses)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int],
                 config: StructuredOutputsConfig | None = None, max_workers: int = 2,
                 cache_entries: int = DEFAULT_CACHE_ENTRIES):
        self.config = config or StructuredOutputsConfig()
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._backends: dict[str, GrammarBackend] = {}
        self._backend_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="kvserve-grammar")
        self._cache: collections.OrderedDict[tuple, Future] = collections.OrderedDict()
        self._cache_entries = cache_entries
        self._lock = threading.Lock()
        self.num_compiles = 0  # cache misses (what a test of the cache counts)
        self._warm_up: Future | None = None

    def _backend(self, name: str) -> GrammarBackend:
        with self._backend_lock:
            if name not in self._backends:
                if name == "xgrammar":
                    from kvserve.structured_output.backend_xgrammar import XgrammarBackend as cls
                else:
                    from kvserve.structured_output.backend_guidance import GuidanceBackend as cls
                self._backends[name] = cls(self._tokenizer, self._vocab_size, self._stop_token_ids)
            return self._backends[name]

    def warm_up(self) -> Future:
        """Imports and builds the backends on the pool now (seconds: the libraries, the tokenizer's tables), so
        that the first request's compile is not charged for them."""
        with self._lock:
            if self._warm_up is None:
                names = ("xgrammar", "guidance") if self.config.backend == "auto" else (self.config.backend,)
                self._warm_up = self._pool.submit(lambda: [self._backend(name) for name in names])
            return self._warm_up

    def effective(self, params: StructuredOutputsParams) -> StructuredOutputsParams:
        """The request's params with the server-wide options of --structured-outputs-config folded in."""
        cfg = self.config
        if not (cfg.disable_any_whitespace or cfg.disable_additional_properties):
            return params
        import dataclasses

        return dataclasses.replace(
            params, disable_any_whitespace=params.disable_any_whitespace or cfg.disable_any_whitespace,
            disable_additional_properties=params.disable_additional_properties or cfg.disable_additional_properties)

    def submit(self, params: StructuredOutputsParams) -> Future:
        params = self.effective(params)
        key = (self.config.backend, *params.key())
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            self.num_compiles += 1
            future = self._pool.submit(self._compile, params)
            self._cache[key] = future
            while len(self._cache) > self._cache_entries:
                self._cache.popitem(last=False)
            return future

    def compile(self, params: StructuredOutputsParams, timeout_s: float = COMPILE_TIMEOUT_S) -> CompiledGrammar:
        """Waits for the compile; ValueError when it fails or takes longer than `timeout_s` (loading the
        libraries, once, is not counted)."""
        self.warm_up().result()
        future = self.submit(params)
        try:
            return future.result(timeout=timeout_s)
        except FutureTimeoutError:
            raise ValueError(f"structured_outputs: compiling the {params.kind} constraint took longer than "
                             f"{timeout_s:g} s; simplify it.") from None

    def _compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        order = ("xgrammar", "guidance") if self.config.backend == "auto" else (self.config.backend,)
        if params.disable_fallback:
            order = order[:1]
        errors = []
        for name in order:
            try:
                return self._backend(name).compile(params)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(f"structured_outputs.{params.kind} was refused: " + "; ".join(errors))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

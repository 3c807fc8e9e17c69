"""Incremental detokenization of one sequence, and stop strings on the text it produces.

Decoding token by token is wrong for most tokenizers: byte-level BPE splits one UTF-8 character over
several tokens, and sentencepiece drops the space in front of a word at the start of a decode. So each
step decodes a short window of ids twice (the context before the new tokens, then the context with
them) and emits the difference, holding everything back while it ends in an incomplete character.
The window starts in the prompt's tail, so the first output token gets its leading space right.

When nobody reads the text before the end (FINAL_ONLY, no stop strings) the per-step work is skipped
and the text is decoded once, when the sequence finishes.
"""

from __future__ import annotations

from kvserve.sampling_params import SamplingParams

_REPLACEMENT = "\ufffd"  # what a decoder yields for bytes that do not form a complete character yet
_PROMPT_CONTEXT = 5  # prompt tokens decoded along with the output (vLLM's choice)


def find_stop_string(text: str, new_chars: int, stops: list[str], include: bool) -> tuple[str, int] | None:
    """The earliest stop string that ends within the newest `new_chars` characters: (it, where the
    text is cut: before it, or after it with `include`)."""
    best = None
    for stop in stops:
        start = max(0, len(text) - new_chars - len(stop) + 1)  # earlier text was searched already
        i = text.find(stop, start)
        if i != -1 and (best is None or i < best[1]):
            best = (stop, i)
    if best is None:
        return None
    stop, i = best
    return stop, i + len(stop) if include else i


def make_decode(tokenizer, params: SamplingParams):
    """ids -> text with the request's options. A fast tokenizer's Rust decoder is called directly when
    the python wrapper would add nothing (it costs about 3x the decode itself)."""
    skip = params.skip_special_tokens
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return lambda ids: backend.decode(ids, skip_special_tokens=skip)
    kwargs = {"skip_special_tokens": skip}
    if not getattr(tokenizer, "is_fast", True):
        kwargs["spaces_between_special_tokens"] = params.spaces_between_special_tokens  # python tokenizers only
    return lambda ids: tokenizer.decode(ids, **kwargs)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams, stream: bool = True):
        """`stream=False`: the text is only read once the sequence has finished."""
        self._decode_ids = make_decode(tokenizer, params)
        self.lazy = not stream and not params.stop
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.buffer_length = params.output_text_buffer_length

        context = self._clean_context(prompt_token_ids)
        self.token_ids = list(context)
        self.prefix_offset = 0  # window start: context the decoder needs
        self.read_offset = len(context)  # ids before this are already in output_text
        self._prefix_text: str | None = None  # decode of [prefix_offset, read_offset), cached
        self.num_output_tokens = 0
        self.output_text = ""
        self._sent_offset = 0  # characters already handed out as deltas

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids) if ids else ""

    def _clean_context(self, prompt_token_ids: list[int]) -> list[int]:
        """The prompt's last few tokens, extended back (up to a limit) if they start mid-character."""
        n = len(prompt_token_ids)
        for size in range(min(_PROMPT_CONTEXT, n), min(n, 4 * _PROMPT_CONTEXT) + 1):
            context = prompt_token_ids[n - size:]
            if _REPLACEMENT not in self._decode(context):
                return context
        return prompt_token_ids[max(0, n - _PROMPT_CONTEXT):]

    def _next_text(self, flush: bool) -> str:
        """Text the ids after read_offset add; '' while they end in an incomplete character (unless flush)."""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset:])
        if len(full) <= len(self._prefix_text) or (full.endswith(_REPLACEMENT) and not flush):
            return ""
        new = full[len(self._prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self._prefix_text = None
        return new

    def update(self, new_token_ids: list[int], stop_terminated: bool, finished: bool) -> str | None:
        """Adds tokens to the text; returns the stop string that ends the sequence, if one appeared.

        `stop_terminated`: the last token is EOS or a stop token id: it stays out of the text (unless
        include_stop_str_in_output) and no stop string is looked for. `finished`: no more tokens will
        come, so an incomplete trailing character is emitted as is."""
        skipped = None
        if stop_terminated and not self.include_stop and new_token_ids:
            skipped, new_token_ids = new_token_ids[-1], new_token_ids[:-1]
        if self.lazy:
            self.token_ids.extend(new_token_ids)
            self.num_output_tokens += len(new_token_ids)
            if finished:
                self._decode_all()
            if skipped is not None:
                self.token_ids.append(skipped)
                self.num_output_tokens += 1
            return None
        check_from = len(self.output_text)
        for tok in new_token_ids:
            self.token_ids.append(tok)
            self.num_output_tokens += 1
            self.output_text += self._next_text(flush=False)
            if self.num_output_tokens <= self.min_tokens:
                check_from = len(self.output_text)  # no stop string may end inside the first min_tokens
        if finished and self.read_offset < len(self.token_ids):
            self.output_text += self._next_text(flush=True)
        if skipped is not None:
            self.token_ids.append(skipped)
            self.num_output_tokens += 1
        if stop_terminated or not self.stop or self.num_output_tokens <= self.min_tokens:
            return None
        found = find_stop_string(self.output_text, len(self.output_text) - check_from, self.stop, self.include_stop)
        if found is None:
            return None
        stop, cut = found
        self.output_text = self.output_text[:cut]
        return stop

    def _decode_all(self) -> None:
        """Lazy mode's one decode: the context and output together, minus the context's text; the
        token-by-token path where that is not a clean split."""
        head = self._decode(self.token_ids[:self.read_offset])
        full = self._decode(self.token_ids)
        if full.startswith(head):
            self.output_text = full[len(head):]
            self.prefix_offset = self.read_offset = len(self.token_ids)
            return
        pending = self.token_ids[self.read_offset:]
        del self.token_ids[self.read_offset:]
        for tok in pending:
            self.token_ids.append(tok)
            self.output_text += self._next_text(flush=False)
        self.output_text += self._next_text(flush=True)

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text so far, or (delta) what is new since the last call. While running, the last
        characters that could begin a stop string are held back."""
        length = len(self.output_text) - (0 if finished else self.buffer_length)
        if not delta:
            return self.output_text[:max(length, 0)]
        if length <= self._sent_offset:
            return ""
        text = self.output_text[self._sent_offset:length]
        self._sent_offset = length
        return text

"""What keeps a constrained output well-formed UTF-8 where the grammar library does not.

xgrammar decodes the bytes of a string leniently: 0.2.9 lets a JSON string hold a UTF-16 surrogate (ED A0..BF
..), 0.2.7 also overlong forms (C0 80, E0 80 ..) and code points past U+10FFFF, and counts each such sequence
as one character, so a text read back with replacement characters breaks the schema's maxLength. The guard
follows each request's output through the UTF-8 decoder's states (RFC 3629, table 3-7) and, per state,
allows only the tokens whose bytes keep the output a well-formed prefix; the step's mask is the library's row
AND the guard's row for the request's state.
"""

from __future__ import annotations

import numpy as np
import torch

ACCEPT = 0  # between characters
_NEED1, _NEED2, _NEED3 = 1, 2, 3  # 1, 2 or 3 continuation bytes (80..BF) to go
_E0, _ED, _F0, _F4 = 4, 5, 6, 7  # after a lead byte whose next byte has a narrower range
INVALID = 8  # the output is already ill-formed: the guard allows everything (the library decides)
NUM_STATES = 9


def _transitions() -> np.ndarray:
    """[state, byte] -> state."""
    t = np.full((NUM_STATES, 256), INVALID, dtype=np.uint8)
    t[ACCEPT, 0x00:0x80] = ACCEPT
    t[ACCEPT, 0xC2:0xE0] = _NEED1
    t[ACCEPT, 0xE1:0xF0] = _NEED2
    t[ACCEPT, 0xE0], t[ACCEPT, 0xED] = _E0, _ED
    t[ACCEPT, 0xF1:0xF4] = _NEED3
    t[ACCEPT, 0xF0], t[ACCEPT, 0xF4] = _F0, _F4
    t[_NEED1, 0x80:0xC0] = ACCEPT
    t[_NEED2, 0x80:0xC0] = _NEED1
    t[_NEED3, 0x80:0xC0] = _NEED2
    t[_E0, 0xA0:0xC0] = _NEED1  # below A0: overlong
    t[_ED, 0x80:0xA0] = _NEED1  # from A0: a surrogate
    t[_F0, 0x90:0xC0] = _NEED2  # below 90: overlong
    t[_F4, 0x80:0x90] = _NEED2  # from 90: past U+10FFFF
    return t


class Utf8Guard:
    """Built once per vocabulary from each token's bytes (the grammar library's own decoding of them)."""

    def __init__(self, token_bytes: list[bytes], vocab_size: int):
        num_words = -(-vocab_size // 32)
        token_bytes = token_bytes[:vocab_size]
        lengths = np.fromiter((len(b) for b in token_bytes), dtype=np.int64, count=len(token_bytes))
        flat = np.frombuffer(b"".join(token_bytes), dtype=np.uint8)
        starts = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
        table = _transitions()
        # next_state[s, t]: the state after token t from state s; tokens past the tokenizer's (padding) and
        # empty ones leave it as it is.
        state = np.tile(np.arange(NUM_STATES, dtype=np.uint8)[:, None], (1, vocab_size))
        live = np.arange(len(token_bytes))
        for pos in range(int(lengths.max(initial=0))):
            live = live[lengths[live] > pos]  # the tokens with a byte at pos
            state[:, live] = table[state[:, live], flat[starts[live] + pos]]
        self.next_state = state
        self._next = [row.tobytes() for row in state]  # per state: indexing bytes is the fastest lookup per token
        allowed = state != INVALID
        allowed[INVALID] = True
        bits = np.zeros((NUM_STATES, num_words * 32), dtype=bool)
        bits[:, :vocab_size] = allowed
        self.masks = np.packbits(bits, axis=1, bitorder="little").view(np.int32)  # [state, word]
        # Between characters only a few words hold a refused token (stray continuation bytes, C0, C1, F5..):
        # those rows are ANDed on these words alone.
        self._accept_words = np.flatnonzero(self.masks[ACCEPT] != -1)
        self._accept_mask = self.masks[ACCEPT, self._accept_words]

    def advance(self, state: int, token_id: int) -> int:
        return self._next[state][token_id]

    def apply(self, bitmask: torch.Tensor, rows: list[int], states: list[int]) -> None:
        """bitmask[rows[i]] &= the guard's row for states[i] (rows distinct, of an int32 CPU tensor). A row
        inside a character that the AND would leave empty (the grammar asks for bytes that are no UTF-8,
        e.g. a surrogate code point) keeps the library's row."""
        arr = bitmask.numpy()
        others = {row: arr[row].copy() for row, state in zip(rows, states) if state != ACCEPT}
        lo, hi = min(rows), max(rows) + 1
        words, mask = self._accept_words, self._accept_mask
        if hi - lo == len(rows):  # the usual case: one block of rows
            block = arr[lo:hi]
            block[:, words] = block[:, words] & mask
        else:
            index = np.ix_(np.asarray(rows), words)
            arr[index] = arr[index] & mask
        for row, state in zip(rows, states):
            if row in others:  # inside a character (or already ill-formed): its own row, from the library's
                library = others[row]
                guarded = library & self.masks[state]
                arr[row] = guarded if guarded.any() else library

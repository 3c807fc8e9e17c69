"""KV cache groups: the layers that share one block table per request.

Layers are grouped by their attention window (None: full attention). A full group needs every block of
a request; a windowed group only those inside its window, so it frees the rest as the request advances
(an interleaved local/global model such as Gemma then holds its full layers' blocks plus a window's worth
for the local ones). Every group holds the same number of layers, the fewest any window has (a window
with more layers is cut into several groups, the last possibly shorter), so the groups share one block
pool: block id b of any group addresses block b of each of `num_slots` per-layer KV tensors, and a layer
reads and writes tensor `slot` of its group's blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroup:
    window: int | None  # every layer of the group attends to its last `window` positions; None: all
    layers: tuple[int, ...]  # model layer indices, ascending


def kv_cache_groups(layer_windows: Sequence[int | None]) -> list[KVCacheGroup]:
    """The groups of a model whose layer i has window layer_windows[i], in order of their first layer."""
    if not layer_windows:
        raise ValueError("a model needs at least one layer")
    by_window: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        by_window.setdefault(window, []).append(layer)
    size = min(len(layers) for layers in by_window.values())
    groups = [KVCacheGroup(window, tuple(layers[i:i + size]))
              for window, layers in by_window.items() for i in range(0, len(layers), size)]
    return sorted(groups, key=lambda g: g.layers[0])


def group_windows(layer_windows: Sequence[int | None]) -> list[int | None]:
    """Each group's window, in group order: what the KV cache manager is built with."""
    return [g.window for g in kv_cache_groups(layer_windows)]


@dataclass(frozen=True)
class LayerPlacement:
    group: int  # index into kv_cache_groups()
    slot: int  # which of the stage's KV tensors holds this layer's K/V


def layer_placements(layer_windows: Sequence[int | None], layers: Sequence[int]) -> dict[int, LayerPlacement]:
    """Where each of one pipeline stage's layers keeps its K/V: its group's block table and the tensor
    slot given by its rank among the group's layers on this stage."""
    placements = {}
    wanted = set(layers)
    for g, group in enumerate(kv_cache_groups(layer_windows)):
        local = [layer for layer in group.layers if layer in wanted]
        for slot, layer in enumerate(local):
            placements[layer] = LayerPlacement(g, slot)
    return placements


def num_kv_slots(layer_windows: Sequence[int | None], layers: Sequence[int]) -> int:
    """KV tensors one pipeline stage allocates (each holds num_blocks blocks): the most layers any group
    has on the stage. Bytes per block are this times one layer's block."""
    placements = layer_placements(layer_windows, layers)
    return max((p.slot for p in placements.values()), default=-1) + 1


def blocks_held(window: int | None, num_tokens: int, chunk: int, block_size: int) -> int:
    """The most blocks one group's table of a num_tokens-token request holds at once when `chunk` tokens
    are computed per step: all of them in a full group; in a windowed one a window plus a chunk, and a
    partly filled block at each end."""
    full = -(-num_tokens // block_size)
    if window is None:
        return full
    return min(full, -(-(window - 1 + chunk) // block_size) + 1)


def request_blocks(windows: Sequence[int | None], num_tokens: int, chunk: int, block_size: int) -> int:
    """The most blocks of the shared pool one request holds at once, over every group."""
    return sum(blocks_held(w, num_tokens, chunk, block_size) for w in windows)


def longest_request_tokens(windows: Sequence[int | None], num_blocks: int, chunk: int, block_size: int) -> int:
    """A context length (whole blocks) one request can reach in num_blocks blocks: every block when no
    group keeps them all (windowed groups free as they go); else what the full groups share once the
    windowed groups hold their most, or every group full, whichever is longer."""
    num_full = sum(w is None for w in windows)
    if not num_full:
        return num_blocks * block_size
    windowed = sum(blocks_held(w, 1 << 62, chunk, block_size) for w in windows if w is not None)
    return max((num_blocks - windowed) // num_full, num_blocks // len(windows), 0) * block_size

"""CPU blocks that hold the K/V of requests preempted by swapping (--swap-space), until they resume.

A swapped request owns its CPU blocks alone (no prefix sharing on the CPU side): each block is either
free or held by exactly one request.
"""

from __future__ import annotations


class SwapSpace:
    def __init__(self, num_blocks: int):
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.req_to_blocks: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks if self.num_blocks else 0.0

    def holds(self, request_id: str) -> bool:
        return request_id in self.req_to_blocks

    def allocate(self, request_id: str, n: int) -> list[int]:
        if request_id in self.req_to_blocks:
            raise RuntimeError(f"{request_id!r} is already swapped out")
        if n > len(self._free):
            raise RuntimeError(f"cannot allocate {n} CPU blocks, only {len(self._free)} free")
        blocks = [self._free.pop() for _ in range(n)]
        self.req_to_blocks[request_id] = blocks
        return blocks

    def free(self, request_id: str) -> list[int]:
        blocks = self.req_to_blocks.pop(request_id, [])
        self._free.extend(reversed(blocks))
        return blocks

    def check_invariants(self) -> None:
        held = [b for blocks in self.req_to_blocks.values() for b in blocks]
        assert len(set(held)) == len(held), "CPU block held twice"
        assert set(held).isdisjoint(self._free), "CPU block both held and free"
        assert len(set(self._free)) == len(self._free), "CPU block free twice"
        assert len(held) + len(self._free) == self.num_blocks, "CPU block leaked"
        assert all(0 <= b < self.num_blocks for b in held + self._free)

"""How the Triton attention backend (ops/triton_attention.py) launches its kernels: the tile shapes of each
kind of step by head width, the split-KV and long-context limits, the switches of its long-prefill paths, and
the KV cache block size it prefers. Plain Python, importable without triton or torch, so that the block size
`kvserve plan` sizes a cache with on a machine without triton is the one the GPU server will use."""

from __future__ import annotations


class TritonAttentionLaunch:
    """Settings as class attributes: tests and benchmarks override them on a TritonAttentionBackend (which
    inherits them) or on one instance of it."""

    # Launch configurations: (BLOCK_M rows, TILE_N keys per inner step, num_warps, num_stages).
    # BLOCK_M is raised to the GQA group size where that is larger. Heads wider than WIDE_HEAD_DIM (Gemma's 256)
    # take the WIDE_HEAD_ settings (by_width).
    WIDE_HEAD_DIM = 128
    PREFILL_CONFIG = (64, 32, 4, 2)  # unified kernel, batches with a query longer than 1
    # Steps with a 16-bit query of at least LONG_PREFILL_MIN_QUERY tokens (long prompts and their chunks: W2,
    # TTFT at 8k), where the attention's FLOPs grow with the square of the prompt: bigger tiles do more
    # tensor-core work per K/V tile read; heads wider than 128 (Gemma's 256) take two warpgroups for their rows.
    # Placed by benchmarks/ab_kernels.py's prefill sweep on the H200 (BENCHMARKS.md). fp32 keeps PREFILL_CONFIG:
    # its three-stage tiles would not fit in shared memory.
    LONG_PREFILL_CONFIG = (128, 64, 4, 3)
    WIDE_HEAD_LONG_PREFILL_CONFIG = (128, 64, 8, 3)
    LONG_PREFILL_MIN_QUERY = 2048
    DECODE_CONFIG = (16, 128, 4, 3)  # unified kernel, decode-only batches
    SPLIT_CONFIG = (16, 128, 4, 3)  # split-KV decode kernel
    # Decode with wide heads: a K or V tile is twice the bytes a key, so shorter key steps
    # (benchmarks/sweep_decode_attention.py --gemma on the H200, BENCHMARKS.md).
    WIDE_HEAD_DECODE_CONFIG = (16, 64, 4, 2)
    WIDE_HEAD_SPLIT_CONFIG = (16, 32, 4, 3)
    # Split-KV: each split gets at least this many keys, and at most this many splits.
    MIN_KEYS_PER_SPLIT = 256
    MAX_SPLITS = 32
    # Batches large enough to fill the SMs still split when contexts may be this long per split or longer
    # (None: never): programs of a few thousand keys each even out the tail of a wave of long, uneven contexts.
    # Measured for wide heads only (W2's Gemma-3 decode: 1.38x on its attention); heads up to 128 keep the rule above.
    LONG_CONTEXT_KEYS_PER_SPLIT: int | None = None
    WIDE_HEAD_LONG_CONTEXT_KEYS_PER_SPLIT: int | None = 4096
    # Steps with a query of at least LONG_PREFILL_MIN_QUERY tokens send their one-token queries to the decode
    # kernel (its splits by choose_num_splits) and the rest to the unified kernel, in layers without a window:
    # two launches instead of one (benchmarks/ab_kernels.py --only prefill-w2, BENCHMARKS.md).
    MIXED_STEP_DECODE_KERNEL = True
    # Long prefill steps of a 16-bit cache whose block size is a multiple of the key step load each K/V tile with
    # one TMA copy (Hopper and later) instead of a key-by-key gather: for heads wider than WIDE_HEAD_DIM (measured
    # on Gemma-3's, benchmarks/ab_kernels.py --only prefill-w2, BENCHMARKS.md), not yet for narrower ones.
    TMA_KV = False
    WIDE_HEAD_TMA_KV = True

    @classmethod
    def preferred_block_size(cls, head_dim: int, dtype: str) -> int | None:
        """The KV cache block size this backend prefers for a 16-bit cache of these heads (None: no preference):
        one key step of the long-prefill tiles a block where the TMA path is on, so each step is one copy."""
        if not cls.by_width(head_dim, cls.TMA_KV, cls.WIDE_HEAD_TMA_KV) or dtype not in ("bfloat16", "float16"):
            return None
        return cls.by_width(head_dim, cls.LONG_PREFILL_CONFIG, cls.WIDE_HEAD_LONG_PREFILL_CONFIG)[1]

    @classmethod
    def by_width(cls, head_dim: int, narrow, wide):
        """`wide` for heads wider than WIDE_HEAD_DIM, else `narrow`."""
        return wide if head_dim > cls.WIDE_HEAD_DIM else narrow

    def launch_config(self, max_query_len: int, head_dim: int = 128,
                      query_bytes: int = 2) -> tuple[int, int, int, int]:
        """The unified kernel's (BLOCK_M, TILE_N, num_warps, num_stages) for a step's longest query, the heads'
        width and the bytes of one query value."""
        if max_query_len == 1:
            return self.by_width(head_dim, self.DECODE_CONFIG, self.WIDE_HEAD_DECODE_CONFIG)
        if not self.long_prefill(max_query_len, query_bytes):
            return self.PREFILL_CONFIG
        return self.by_width(head_dim, self.LONG_PREFILL_CONFIG, self.WIDE_HEAD_LONG_PREFILL_CONFIG)

    def long_prefill(self, max_query_len: int, query_bytes: int) -> bool:
        """Whether a step takes the long-prefill tiles (and, where they apply, their TMA K/V copies)."""
        return max_query_len >= self.LONG_PREFILL_MIN_QUERY and query_bytes == 2

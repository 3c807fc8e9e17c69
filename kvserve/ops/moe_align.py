"""The sort of a MoE layer's (token, k) pairs into blocks of one expert each, for the grouped GEMMs of fused_moe.py.

Contract (align_block_size is the torch reference; the Triton versions give the same blocks):
    local_ids [T, K] int: each pair's expert on this rank, -1 where it lives on another rank (left out)
    block_m: the GEMM's row tile; each expert's run of pairs is padded to a multiple of it
    returns sorted_pairs [P + E * (block_m - 1)] int32 (P = T * K): in rows below num_rows, a pair index, or P
            for padding;
            block_expert [ceil(capacity / block_m)] int32: the expert of each block of block_m rows, -1 past
            the end;
            num_rows [1] int32: rows in use.
Sizes depend on P and E only, never on the routing (no host sync: graph-safe). The Triton versions may order
the pairs inside an expert's run differently (every row is computed and written on its own, so no result
changes); they leave sorted_pairs from num_rows on unwritten (no GEMM program reads past num_rows).

Two Triton paths, chosen by P: one program holding every pair in one tile (one launch: decode steps), and for
large steps (prefill chunks) a zeroing, a counting kernel and a placing kernel, each over blocks of pairs
(above PARALLEL_ABOVE_PAIRS pairs). Both count through histograms, which the compiler keeps in the CTA's shared
memory, so global atomics are only the counts' sums and one per pair for its row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Steps of more than this many pairs are sorted over blocks of pairs (count, then place), as are all steps of
# more than ONE_PROGRAM_MAX_PAIRS (one program holds every pair in one tile).
PARALLEL_ABOVE_PAIRS = 2048
ONE_PROGRAM_MAX_PAIRS = 4096
CHUNK = 1024


def align_block_size(local_ids: torch.Tensor, num_experts: int, block_m: int):
    """The reference, in torch ops (about 30 small kernels on a GPU); fills every row of sorted_pairs."""
    flat = local_ids.reshape(-1).long()
    pairs = flat.numel()
    bucket = torch.where(flat < 0, num_experts, flat)  # bucket E: experts on other ranks, dropped
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = torch.cat([ends - padded, ends.new_zeros(1)])
    order = torch.argsort(bucket, stable=True)
    sorted_bucket = bucket[order]
    first_pair = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.arange(pairs, device=flat.device) - first_pair[sorted_bucket]
    capacity = pairs + num_experts * (block_m - 1)
    dest = torch.where(sorted_bucket < num_experts, starts[sorted_bucket] + rank_in_expert, capacity)
    sorted_pairs = torch.full((capacity + 1,), pairs, dtype=torch.int32, device=flat.device)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    num_blocks = (capacity + block_m - 1) // block_m
    block_start = torch.arange(num_blocks, device=flat.device) * block_m
    block_expert = torch.searchsorted(ends, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_pairs[:capacity], block_expert, ends[-1:].to(torch.int32)


@triton.jit
def _expert_runs(counts, E, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """(starts, ends) of each expert's padded run, from its pair count ([BLOCK_E], zero past E)."""
    e = tl.arange(0, BLOCK_E)
    padded = tl.where(e < E, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    ends = tl.cumsum(padded, axis=0)
    return ends - padded, ends


@triton.jit
def _write_padding(sorted_ptr, num_rows_ptr, counts, starts, ends, P, E, BLOCK_M: tl.constexpr,
                   BLOCK_E: tl.constexpr):
    """Each expert's padding rows (P: no pair) after its pairs, and num_rows, the end of the last run."""
    e = tl.arange(0, BLOCK_E)
    pad = (starts + counts)[:, None] + tl.arange(0, BLOCK_M)[None, :]
    tl.store(sorted_ptr + pad, tl.full([BLOCK_E, BLOCK_M], 0, tl.int32) + P,
             mask=(e[:, None] < E) & (pad < ends[:, None]))
    tl.store(num_rows_ptr, tl.max(ends, axis=0))


@triton.jit
def _write_layout(program, programs, sorted_ptr, block_expert_ptr, num_rows_ptr, counts, starts, ends, P, E,
                  num_blocks, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCKS_CHUNK: tl.constexpr):
    """Everything but the pairs' own rows: the padding and num_rows (program 0), and the expert of each block
    (blocks split among the programs)."""
    e = tl.arange(0, BLOCK_E)
    total = tl.max(ends, axis=0)
    if program == 0:
        _write_padding(sorted_ptr, num_rows_ptr, counts, starts, ends, P, E, BLOCK_M, BLOCK_E)
    for start in range(program * BLOCKS_CHUNK, num_blocks, programs * BLOCKS_CHUNK):
        b = start + tl.arange(0, BLOCKS_CHUNK)
        first_row = b * BLOCK_M
        # Experts with zero-width runs end where the next one starts: count the ends at or before.
        expert = tl.sum(((ends[None, :] <= first_row[:, None]) & (e[None, :] < E)).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, tl.where(first_row < total, expert, -1), mask=b < num_blocks)


@triton.jit(do_not_specialize=["P", "num_blocks"])
def _align_one_program(ids_ptr, sorted_ptr, block_expert_ptr, num_rows_ptr, cursor_ptr, P, E, num_blocks,
                       BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr,
                       BLOCKS_CHUNK: tl.constexpr):
    """Every pair in one tile (P <= BLOCK_P): the counts from a histogram (the CTA's shared memory), each
    expert's padded start into cursor, then every pair takes the next row of its expert (one round of global
    atomics); each pair also names its block's expert (every block of a run holds at least one pair)."""
    offs = tl.arange(0, BLOCK_P)
    ids = tl.load(ids_ptr + offs, mask=offs < P, other=-1)
    valid = (offs < P) & (ids >= 0)
    e = tl.arange(0, BLOCK_E)
    counts = tl.where(e < E, tl.histogram(tl.where(valid, ids, 0), BLOCK_E, mask=valid), 0)
    starts, ends = _expert_runs(counts, E, BLOCK_M, BLOCK_E)
    tl.store(cursor_ptr + e, starts, mask=e < E)
    tl.debug_barrier()  # the starts are in place before any pair takes a row
    row = tl.atomic_add(cursor_ptr + ids, 1, mask=valid)
    tl.store(sorted_ptr + row, offs, mask=valid)
    tl.store(block_expert_ptr + row // BLOCK_M, ids, mask=valid)
    _write_padding(sorted_ptr, num_rows_ptr, counts, starts, ends, P, E, BLOCK_M, BLOCK_E)
    for start in range(tl.max(ends, axis=0) // BLOCK_M, num_blocks, BLOCKS_CHUNK):
        b = start + tl.arange(0, BLOCKS_CHUNK)
        tl.store(block_expert_ptr + b, tl.full([BLOCKS_CHUNK], -1, tl.int32), mask=b < num_blocks)


@triton.jit(do_not_specialize=["P"])
def _count_pairs(ids_ptr, counts_ptr, P, E, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    """Pairs per expert, one block of pairs per program: its histogram, then one global atomic per expert."""
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < P, other=-1)
    e = tl.arange(0, BLOCK_E)
    valid = (offs < P) & (ids >= 0)
    tl.atomic_add(counts_ptr + e, tl.histogram(tl.where(valid, ids, 0), BLOCK_E, mask=valid), mask=e < E)


@triton.jit(do_not_specialize=["P", "num_blocks"])
def _place_pairs(ids_ptr, counts_ptr, cursor_ptr, starts_ptr, sorted_ptr, block_expert_ptr, num_rows_ptr, P, E,
                 num_blocks, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr,
                 BLOCKS_CHUNK: tl.constexpr):
    """Every program derives the runs from the finished counts; a pair's row is its run's start plus the
    next place in the run (atomics: cursor counts up from zero per expert)."""
    program, programs = tl.program_id(0), tl.num_programs(0)
    e = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + e, mask=e < E, other=0)
    starts, ends = _expert_runs(counts, E, BLOCK_M, BLOCK_E)
    # The runs' starts are gathered by expert id: through this program's own row of scratch memory.
    tl.store(starts_ptr + program * BLOCK_E + e, starts)
    tl.debug_barrier()
    offs = program * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < P, other=-1)
    valid = (offs < P) & (ids >= 0)
    start = tl.load(starts_ptr + program * BLOCK_E + ids, mask=valid, other=0)
    row = start + tl.atomic_add(cursor_ptr + ids, 1, mask=valid)
    tl.store(sorted_ptr + row, offs, mask=valid)
    _write_layout(program, programs, sorted_ptr, block_expert_ptr, num_rows_ptr, counts, starts, ends, P, E,
                  num_blocks, BLOCK_M, BLOCK_E, BLOCKS_CHUNK)


def align_block_size_triton(local_ids: torch.Tensor, num_experts: int, block_m: int):
    """align_block_size in Triton: one launch, or three above PARALLEL_ABOVE_PAIRS pairs."""
    flat = local_ids.reshape(-1).to(torch.int32)
    pairs = flat.numel()
    capacity = pairs + num_experts * (block_m - 1)
    num_blocks = triton.cdiv(capacity, block_m)
    sorted_pairs = torch.empty(capacity, dtype=torch.int32, device=flat.device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=flat.device)
    num_rows = torch.empty(1, dtype=torch.int32, device=flat.device)
    block_e = triton.next_power_of_2(num_experts)
    blocks_chunk = max(16, 4096 // block_e)
    if pairs <= min(PARALLEL_ABOVE_PAIRS, ONE_PROGRAM_MAX_PAIRS):
        cursor = torch.empty(num_experts, dtype=torch.int32, device=flat.device)
        block_p = max(16, triton.next_power_of_2(pairs))  # a few sizes, each compiled once (CUDA graph capture)
        _align_one_program[(1,)](flat, sorted_pairs, block_expert, num_rows, cursor, pairs, num_experts, num_blocks,
                                 BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_P=block_p, BLOCKS_CHUNK=blocks_chunk,
                                 num_warps=8 if block_p >= 1024 else 4)
        return sorted_pairs, block_expert, num_rows
    programs = triton.cdiv(pairs, CHUNK)
    counters = torch.zeros(2, num_experts, dtype=torch.int32, device=flat.device)  # counts, cursor
    starts = torch.empty(programs, block_e, dtype=torch.int32, device=flat.device)
    _count_pairs[(programs,)](flat, counters[0], pairs, num_experts, CHUNK=CHUNK, BLOCK_E=block_e, num_warps=4)
    _place_pairs[(programs,)](flat, counters[0], counters[1], starts, sorted_pairs, block_expert, num_rows, pairs,
                              num_experts, num_blocks, BLOCK_M=block_m, BLOCK_E=block_e, CHUNK=CHUNK,
                              BLOCKS_CHUNK=blocks_chunk, num_warps=4)
    return sorted_pairs, block_expert, num_rows

"""Which decoder layers each pipeline stage runs: evenly by default (earlier stages take the
remainder: the last one also holds the norm and LM head), or as
given by VLLM_PP_LAYER_PARTITION / KVSERVE_PP_LAYER_PARTITION ("a,b,..." layers per stage)."""

from __future__ import annotations

import os

PARTITION_ENVS = ("KVSERVE_PP_LAYER_PARTITION", "VLLM_PP_LAYER_PARTITION")


def layer_partition(num_layers: int, pp_size: int, partition: str | None = None) -> list[tuple[int, int]]:
    """[(start, end)] per stage. `partition` defaults to the environment."""
    if pp_size > num_layers:
        raise ValueError(f"--pipeline-parallel-size {pp_size} is larger than the model's {num_layers} layers; "
                         f"each stage needs at least one layer. Use --pipeline-parallel-size {num_layers} or less.")
    if partition is None:
        partition = next((os.environ[e] for e in PARTITION_ENVS if os.environ.get(e)), None)
    if partition:
        try:
            sizes = [int(x) for x in partition.split(",")]
        except ValueError:
            raise ValueError(f"layer partition {partition!r}: expected comma-separated layer counts, "
                             f"e.g. VLLM_PP_LAYER_PARTITION=\"{num_layers - num_layers // 2},{num_layers // 2}\"") from None
        if len(sizes) != pp_size or sum(sizes) != num_layers or min(sizes) < 1:
            raise ValueError(f"layer partition {partition!r} must give {pp_size} stages (--pipeline-parallel-size) "
                             f"of at least one layer each, summing to the model's {num_layers} layers.")
    else:
        base, extra = divmod(num_layers, pp_size)
        sizes = [base + (1 if i < extra else 0) for i in range(pp_size)]
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds

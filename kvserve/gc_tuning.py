"""The garbage collector's young-generation threshold, in every process that runs the step loop.

A step allocates several container objects per running request (its scheduled entry, token lists, the
workers' message), so at hundreds of requests CPython's default threshold of 700 allocations starts a
young-generation collection several times per step, and every tenth of those a collection of the middle
generation: host time the GPU waits for when the step is host-bound. A threshold of YOUNG_GENERATION
allocations runs them a few times per run instead; cyclic garbage waits that much longer to be freed,
which is little memory. The objects of start-up are not frozen (gc.freeze): an engine built and dropped in
one process (a notebook, a test) is partly a reference cycle, which the collector must still free.

This changes a process-wide setting, once, the first time an engine starts in the process; a threshold
already set higher is kept.
"""

from __future__ import annotations

import gc

YOUNG_GENERATION = 20_000


def raise_young_generation_threshold() -> None:
    young, *older = gc.get_threshold()
    if 0 < young < YOUNG_GENERATION:
        gc.set_threshold(YOUNG_GENERATION, *older)

"""What the engine tests of the gpu tier (`pytest -m gpu`) share.

An engine sizes itself from --gpu-memory-utilization as a share of the whole device, less what other
processes hold, so a second engine started beside the first sees the first's KV cache as used memory and has
nothing left. The tier runs four pytest-xdist workers on one GPU (benchmarks/gpu_tests.sh, `--dist loadgroup`):
the engine tests all join one xdist group and run one after another on one worker, while the kernel tests,
which take little memory, spread over the others.
"""

import pytest

ENGINE_TIER = [pytest.mark.gpu, pytest.mark.xdist_group("gpu_engine")]
# Room for the kernel tests running beside the engine test in the other workers.
GPU_TEST_MEMORY_UTILIZATION = 0.3
# An engine sized by --gpu-memory-utilization counts what other processes hold at its start against its share,
# and a kernel test in another worker may hold (or keep cached) several GiB then: engine tests that need no
# particular size fix their KV cache instead, which needs nothing else free.
GPU_TEST_KV_CACHE_BYTES = 2 << 30

"""What the engine tests of the gpu tier (`pytest -m gpu`) share.

The tier runs four pytest-xdist workers on one GPU (benchmarks/gpu_tests.sh), and an engine counts the memory
the other workers' engines hold against its own --gpu-memory-utilization budget: four engines at 0.3 each
over-commit the card, so each engine test asks for a fraction four of them fit in with room to spare.
"""

GPU_TEST_MEMORY_UTILIZATION = 0.15

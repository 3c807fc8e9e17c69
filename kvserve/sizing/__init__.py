"""Torch-free sizing arithmetic, shared by the engine's start-up (worker/memory.py) and `kvserve plan`."""

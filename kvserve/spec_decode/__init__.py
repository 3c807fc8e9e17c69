"""Speculative decoding: proposers offer draft tokens, the model runner verifies them (worker/spec_verify.py)."""

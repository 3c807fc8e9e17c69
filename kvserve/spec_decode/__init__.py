"""Speculative decoding: proposers offer draft tokens, the model runner verifies them exactly
(rejection_sampler.py), and the draft budget sizes drafts per step."""

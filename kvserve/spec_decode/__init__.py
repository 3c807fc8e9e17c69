"""Speculative decoding: draft proposers, and exact verification of their drafts against the target model."""

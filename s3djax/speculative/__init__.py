"""Speculative decoding: static token trees, drafters, and the draft-verify-commit loop."""

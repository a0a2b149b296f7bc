"""Speculative decoding: proposers guess the next tokens, the target verifies them in one step, and
the rejection sampler keeps outputs distributed exactly as the target's."""

"""Speculative decoding: drafters (n-gram lookup, draft head with a tuned lens) and verification."""

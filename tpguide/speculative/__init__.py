"""Speculative decoding: drafters (the grammar's forced text and JSON layouts, n-gram lookup, draft head with a tuned lens) and verification."""

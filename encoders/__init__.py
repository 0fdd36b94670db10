"""Encoder adapters and the caches of their outputs."""

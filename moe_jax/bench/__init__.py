"""Benchmarks (``python -m moe_jax.bench``)."""

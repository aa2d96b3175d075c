"""Serving: continuous batching over constant-size GLA state, and an OpenAI-compatible API.

``sequence``, ``state_pool``, ``block_manager``, ``prefix_cache`` and ``scheduler`` are pure
Python (the disaggregation simulator runs them); ``runner`` and ``sampler`` hold the torch
parts; ``engine`` glues them; ``async_engine`` and ``api`` serve them over HTTP.
"""

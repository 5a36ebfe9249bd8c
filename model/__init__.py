"""Qwen3.5 text model for one tensor-parallel rank: config, sharding, weights, state and forward."""

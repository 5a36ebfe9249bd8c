"""Kernels of the Qwen3.5 forward: torch references (`kernels.reference`) and Triton kernels beside them."""

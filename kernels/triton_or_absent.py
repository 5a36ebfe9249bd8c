"""Triton where it is installed; where it is not (macOS, a CPU-only install) a stand-in that lets the kernel
modules import, so the CPU path, whose ops are the torch references, runs without it. Launching a kernel then
says what is missing. Triton ships for Linux only, hence the dependency's platform marker in pyproject.toml."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
    from triton.runtime.errors import OutOfResources
except ImportError:  # the stand-in below
    import types

    class _AbsentKernel:
        def __init__(self, fn) -> None:
            self.fn = fn

        def __getitem__(self, grid):
            raise RuntimeError(f"Triton is not installed: the kernel {self.fn.__name__} cannot run (the CPU path "
                               "uses the torch references; install triton on Linux for the GPU kernels)")

    class OutOfResources(Exception):  # noqa: N818 (Triton's name)
        pass

    triton = types.SimpleNamespace(
        jit=lambda fn=None, **_: _AbsentKernel(fn) if fn is not None else _AbsentKernel,
        cdiv=lambda a, b: -(-a // b),
        next_power_of_2=lambda n: 1 << max(0, int(n) - 1).bit_length(),
    )

    class constexpr:  # noqa: N801 (Triton's name): an annotation, and a value wrapper at module level
        def __init__(self, value=None) -> None:
            self.value = value

    tl = types.SimpleNamespace(constexpr=constexpr)

__all__ = ["triton", "tl", "OutOfResources"]

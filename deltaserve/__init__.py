"""deltaserve: a serving runtime for the Qwen3.5 hybrid models.

The repository's top-level folders are this package's parts: `runtime/` is `deltaserve.runtime`, `devices/`
`deltaserve.devices`, `model/` `deltaserve.model`, `kernels/` `deltaserve.kernels`, `tools/` `deltaserve.tools`
(pyproject.toml maps them), so none of their short names is importable on its own.
"""

__version__ = "0.1.0"

__all__ = ["AsyncEngine", "EngineArgs", "SamplingParams", "RequestOutput", "CapacityError", "EngineDeadError",
           "QueueFullError", "__version__"]


def __getattr__(name: str):
    # Loaded on first use: `python -m deltaserve.tools.X` and `import deltaserve.kernels` must not start the
    # runtime (and with it torch and the Triton kernels) just by importing this package first.
    if name in __all__:
        from deltaserve import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'deltaserve' has no attribute {name!r}")

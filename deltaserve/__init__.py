"""deltaserve: a serving runtime for the Qwen3.5 hybrid models.

The repository's top-level folders are this package's parts: `runtime/` is `deltaserve.runtime`, `devices/`
`deltaserve.devices`, `model/` `deltaserve.model`, `kernels/` `deltaserve.kernels`, `tools/` `deltaserve.tools`
(pyproject.toml maps them), so none of their short names is importable on its own.
"""

from deltaserve.runtime import (
    AsyncEngine,
    CapacityError,
    EngineArgs,
    EngineDeadError,
    QueueFullError,
    RequestOutput,
    SamplingParams,
)

__version__ = "0.1.0"

__all__ = ["AsyncEngine", "EngineArgs", "SamplingParams", "RequestOutput", "CapacityError", "EngineDeadError",
           "QueueFullError", "__version__"]

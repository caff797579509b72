"""zinf: ZeRO stages 1-3 with optimizer state and parameters on the device, in host memory or on
NVMe, from Python.

`zinf.Engine` is the C++ engine (include/zinf/engine.hpp) as it is; `zinf.torch` trains a
`torch.nn.Module` with it in DeepSpeed's call shape (docs/PYTHON.md).
"""
from ._zinf import Engine, Error, __version__, normalize_config

__all__ = ["Engine", "Error", "__version__", "normalize_config"]

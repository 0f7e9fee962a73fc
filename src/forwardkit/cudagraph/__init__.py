"""CUDA graphs: which graph serves a batch (``dispatcher``) and capture/replay (``wrapper``).

* :mod:`forwardkit.cudagraph.dispatcher` — ``CudagraphDispatcher`` (graph keys, padding, mode per batch).
* :mod:`forwardkit.cudagraph.wrapper` — ``CUDAGraphWrapper``, ``CUDAGraphOptions``, ``CUDAGraphEntry``.
* :mod:`forwardkit.cudagraph.ubatch_graphs` — ``UBatchGraphs`` (micro-batched FULL graphs of DBO steps).
* :mod:`forwardkit.cudagraph.monitor` — capture guard, capture counter, gc freeze for capture.
* :mod:`forwardkit.cudagraph.metrics` — ``CUDAGraphStat``, ``CUDAGraphLogging``.

Names are re-exported lazily so importing the package does not pull in torch.cuda paths or
the forward context until they are used.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CudagraphDispatcher": "dispatcher",
    "cudagraphs_available": "dispatcher",
    "CUDAGraphWrapper": "wrapper",
    "CUDAGraphOptions": "wrapper",
    "CUDAGraphEntry": "wrapper",
    "GraphBackend": "wrapper",
    "piecewise_cudagraph_options": "wrapper",
    "weak_ref_tensors": "wrapper",
    "UBatchGraphs": "ubatch_graphs",
    "CUDAGraphStat": "metrics",
    "CUDAGraphLogging": "metrics",
    "capture_session": "monitor",
    "set_cudagraph_capturing_enabled": "monitor",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'forwardkit.cudagraph' has no attribute {name!r}")
    return getattr(importlib.import_module(f"forwardkit.cudagraph.{module}"), name)

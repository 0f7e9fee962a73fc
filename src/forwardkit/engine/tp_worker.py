"""Entry point of a tensor-parallel worker process: ``python -m forwardkit.engine.tp_worker FD``.

``FD`` is this process's end of the socket pair its driver created
(:class:`forwardkit.engine.tp.TPWorkerPool`); everything else arrives over it.
"""

from __future__ import annotations

import sys

from forwardkit.engine.tp import worker_main

if __name__ == "__main__":
    if len(sys.argv) != 2 or not sys.argv[1].isdigit():
        sys.exit("usage: python -m forwardkit.engine.tp_worker FD (started by LLM with "
                 "tensor_parallel_size > 1, not by hand)")
    worker_main(int(sys.argv[1]))

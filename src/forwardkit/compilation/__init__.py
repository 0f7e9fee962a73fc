"""Compilation: ``support_torch_compile``, the piecewise backend, passes, compile cache, counters.

Module map: ``decorators`` (class decorator, per-mode dispatch), ``wrapper`` (trace once, drop
guards, run captured bytecode), ``backend`` (mode-3 backend: split + lazy pieces), ``split``
(cut at splitting ops), ``piecewise`` (per-range/size artifacts, identical-piece sharing),
``compiler`` (Inductor standalone compile / eager, cache use), ``cache`` (on-disk artifacts),
``passes`` / ``fusion`` (post-grad passes), ``counters`` (counters and compile logs),
``custom_op`` (``CustomOp`` registry).
"""

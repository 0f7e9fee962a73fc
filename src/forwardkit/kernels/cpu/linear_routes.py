"""Timed choices between plain ``F.linear`` and the fast path, per weight shape and row bucket.

When a model's routed weights together are under :data:`TUNE_MAX_BYTES` (a small model), they
stay in the caches, a product is over in microseconds, and which path wins depends on the
machine: on the 2-core EPYC forwardkit's paths beat MKL's small GEMMs, on the 2-core Xeon MKL's
``F.linear`` was 1.5-3x faster at 2-8 rows. The router (:mod:`.router`) then times both per
weight shape and row bucket (1, 2, 3-4, 5-8, ... rows: :func:`row_bucket`), and every routed
weight of that shape keeps the choice, read with one list index inside the op. The choice never
changes the graph (every layer calls the op; the op picks the path), so timing is an
optimisation only; ``CpuLinearRouter(timing=False)`` (or ``set_timing(False)``) skips it and
every weight takes the fast path, which makes the arithmetic independent of the machine's speed.

:class:`RouteTable` keeps the choices of one router and saves the complete ones per machine
(CPU model and flags, torch version, thread count, candidate kernel builds) under
``$FORWARDKIT_CACHE_ROOT/linear_routes/``, so a later process skips the timing.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile

import torch

from forwardkit import envs
from forwardkit.kernels.cpu import native_linear
from forwardkit.logger import init_logger

__all__ = ["BUCKETS", "TUNE_CALLS", "TUNE_MAX_BYTES", "RouteKey", "RouteTable", "row_bucket"]

logger = init_logger(__name__)

# A model whose routed weights take at most this many bytes chooses its paths per weight shape
# and row bucket by timing (module doc).
TUNE_MAX_BYTES = 64 << 20
BUCKETS = 10  # 1, 2, 3-4, 5-8, ..., 257+ rows
TUNE_CALLS = 9  # timed calls per candidate, after two untimed

# (out features, in features, dtype, has bias)
RouteKey = tuple[int, int, torch.dtype, bool]


def row_bucket(rows: int) -> int:
    """The bucket of a product of ``rows`` rows: 0 for 1 row, 1 for 2, 2 for 3-4, ... (capped)."""
    return min(max(rows - 1, 0).bit_length(), BUCKETS - 1)


def _routes_file() -> str:
    machine = json.dumps([sorted(native_linear.cpu_flags()), native_linear.cpu_model_name(), torch.__version__,
                          torch.get_num_threads(), BUCKETS, TUNE_CALLS,
                          native_linear.candidate_builds()])
    digest = hashlib.sha256(machine.encode()).hexdigest()[:16]
    return os.path.join(envs.FORWARDKIT_CACHE_ROOT, "linear_routes", f"{digest}.json")


def _key_text(key: RouteKey) -> str:
    return f"{key[0]},{key[1]},{str(key[2]).removeprefix('torch.')},{int(key[3])}"


class RouteTable:
    """Per weight shape: per row bucket True (fast path), False (plain ``F.linear``) or None
    (not timed yet). The list of a shape is shared by every routed weight of that shape."""

    def __init__(self) -> None:
        self._routes: dict[RouteKey, list[bool | None]] = {}
        self._loaded = False

    def choices(self, key: RouteKey) -> list[bool | None]:
        """The (shared, mutable) choices of ``key``; the saved ones are read first."""
        if not self._loaded:
            self._load()
        return self._routes.setdefault(key, [None] * BUCKETS)

    def as_dict(self) -> dict[RouteKey, list[bool | None]]:
        """A copy of every choice made or loaded so far (for tests and logs)."""
        return {k: list(v) for k, v in self._routes.items()}

    def clear(self) -> None:
        """Forget every choice (the next request reads the file again; the file stays)."""
        self._routes.clear()
        self._loaded = False

    def _load(self) -> None:
        """Read the choices saved for this machine (none, or an unreadable file: time anew)."""
        self._loaded = True
        try:
            with open(_routes_file(), encoding="utf-8") as f:
                saved = json.load(f)
            for text, route in saved.items():
                n, k, dtype, has_bias = text.split(",")
                if (len(route) == BUCKETS and all(isinstance(r, bool) for r in route)
                        and isinstance(getattr(torch, dtype, None), torch.dtype)):
                    self._routes.setdefault((int(n), int(k), getattr(torch, dtype), has_bias == "1"),
                                            list(route))
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            if not isinstance(exc, FileNotFoundError):
                logger.warning_once("Ignoring saved linear-path choices (%s); timing anew", exc)

    def save(self) -> None:
        """Write every complete choice atomically (a failure only logs: the choices still hold
        for this process)."""
        path = _routes_file()
        data = {_key_text(k): v for k, v in self._routes.items() if None not in v}
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=0, sort_keys=True)
            os.replace(tmp, path)
        except OSError as exc:
            logger.warning_once("Could not save linear-path choices to %s: %s", path, exc)

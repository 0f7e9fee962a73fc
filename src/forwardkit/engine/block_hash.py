"""Block hashes for prefix caching: a chain over full KV blocks.

A full block of ``block_size`` token ids is identified by the hash of (its parent block's hash,
or a fixed seed for the first block; the block's token ids; extra keys). The extra keys make
otherwise equal tokens distinct where their KV differs or must not be shared: the request's
``cache_salt`` (first block only) and, once adapters exist, the adapter. Because each hash
covers its parent's, two requests share block ``i`` only when they agree on every token up to
the end of that block.

The algorithms are the ones vLLM 0.14.0 names (``CacheConfig.prefix_caching_hash_algo``):

- ``"sha256"``: SHA-256 over a compact length-prefixed binary encoding (the default);
- ``"sha256_cbor"``: SHA-256 over canonical CBOR (RFC 8949 §4.2.1), so another program can
  reproduce the hashes from the same tokens;
- ``"xxhash"`` / ``"xxhash_cbor"``: 128-bit xxHash3 over the same two encodings (faster, not
  cryptographic; needs the ``xxhash`` package).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from typing import TypeAlias

from forwardkit.config.cache import check_hash_algo

__all__ = ["BlockHash", "BlockHasher", "cbor_encode"]

BlockHash: TypeAlias = bytes
"""A block's hash: the digest bytes (32 for SHA-256, 16 for xxHash3-128)."""

ExtraKey: TypeAlias = "str | int | bytes"

# The first block's parent: any fixed value works; this one names what it is.
_ROOT = hashlib.sha256(b"forwardkit prefix cache root").digest()


# ----------------------------------------------------------------------------- encodings
def _cbor_head(major: int, value: int) -> bytes:
    """A CBOR data item's head: major type and argument, in the shortest form (canonical)."""
    if value < 24:
        return bytes((major << 5 | value,))
    for extra, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if value < 1 << (8 * struct.calcsize(fmt)):
            return bytes((major << 5 | extra,)) + struct.pack(fmt, value)
    raise ValueError(f"integer {value} does not fit a CBOR head (64 bits)")


def cbor_encode(value: object) -> bytes:
    """Canonical CBOR of ints, bytes, str, None and lists/tuples of those (RFC 8949)."""
    if value is None:
        return b"\xf6"
    if isinstance(value, bool):
        return b"\xf5" if value else b"\xf4"
    if isinstance(value, int):
        return _cbor_head(0, value) if value >= 0 else _cbor_head(1, -1 - value)
    if isinstance(value, bytes):
        return _cbor_head(2, len(value)) + value
    if isinstance(value, str):
        data = value.encode("utf-8")
        return _cbor_head(3, len(data)) + data
    if isinstance(value, (list, tuple)):
        return _cbor_head(4, len(value)) + b"".join(cbor_encode(v) for v in value)
    raise TypeError(f"cannot CBOR-encode {type(value).__name__}")


def _binary_encode(parent: bytes, tokens: Sequence[int], extra: tuple[ExtraKey, ...]) -> bytes:
    """Length-prefixed: parent digest, token count and ids (int64), then each extra key."""
    parts = [struct.pack("<B", len(parent)), parent, struct.pack("<I", len(tokens)),
             struct.pack(f"<{len(tokens)}q", *tokens)]
    for key in extra:
        if isinstance(key, str):
            data, tag = key.encode("utf-8"), b"s"
        elif isinstance(key, bytes):
            data, tag = key, b"b"
        else:
            data, tag = struct.pack("<q", key), b"i"
        parts += [tag, struct.pack("<I", len(data)), data]
    return b"".join(parts)


def _cbor_block(parent: bytes, tokens: Sequence[int], extra: tuple[ExtraKey, ...]) -> bytes:
    return cbor_encode([parent, list(tokens), list(extra) if extra else None])


def _digest_fn(algo: str) -> Callable[[bytes], bytes]:
    if algo.startswith("sha256"):
        return lambda data: hashlib.sha256(data).digest()
    import xxhash

    return lambda data: xxhash.xxh3_128_digest(data)


class BlockHasher:
    """Hashes full blocks with one algorithm: ``hash_block(parent, tokens, extra)``."""

    def __init__(self, algo: str = "sha256") -> None:
        check_hash_algo(algo)
        self.algo = algo
        self._digest = _digest_fn(algo)
        self._encode = _cbor_block if algo.endswith("_cbor") else _binary_encode

    def hash_block(self, parent: BlockHash | None, tokens: Sequence[int],
                   extra: tuple[ExtraKey, ...] = ()) -> BlockHash:
        """The hash of a full block whose parent block hashed to ``parent`` (None: first)."""
        return self._digest(self._encode(_ROOT if parent is None else parent, tokens, extra))

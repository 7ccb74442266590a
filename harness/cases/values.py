"""Deterministic gradient values keyed by (seed, parameter name, logical index).

Why a counter-based hash instead of a seeded RNG: a value must depend only on *which logical
element* it is, never on which rank computes it or in what order. Then every rank that holds a
replica of an element produces the same bits without talking to anyone, and two different shards
of a parameter (or two different experts) are different with overwhelming probability. A rank can
also generate just its own slice, so the cost is proportional to the local shape.

The hash is a 32-bit integer mixer evaluated in int64 arithmetic that never overflows (each
multiplication is split into 16-bit halves), so the result is the same on every platform and device.
Names are mixed in with ``zlib.crc32``; Python's ``hash()`` is salted per process and would differ
between ranks.
"""

from __future__ import annotations

import math
import zlib

import torch

from harness.cases.layout import Box

_M32 = 0xFFFFFFFF
_MULTIPLIERS = (0x7FEB352D, 0x846CA68B)


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2**32 for 0 <= x < 2**32, without int64 overflow."""
    low = x * (constant & 0xFFFF)
    high = ((x * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _MULTIPLIERS[0])
    x = x ^ (x >> 15)
    x = _mul32(x, _MULTIPLIERS[1])
    return x ^ (x >> 16)


def stream_key(seed: int, name: str) -> int:
    """A 32-bit key for one parameter's value stream."""
    return zlib.crc32(f"{seed}\x00{name}".encode()) & _M32


def flat_indices(shape: tuple[int, ...], box: Box) -> torch.Tensor:
    """Row-major flat logical indices of every element of ``box``, shaped like the box."""
    index = torch.zeros((), dtype=torch.int64)
    stride = 1
    for axis in reversed(range(len(shape))):
        start, stop = box[axis]
        coords = torch.arange(start, stop, dtype=torch.int64) * stride
        view = [1] * len(shape)
        view[axis] = stop - start
        index = index + coords.view(view)
        stride *= shape[axis]
    return index.expand(tuple(b - a for a, b in box)).contiguous()


_HIGH_OFFSET = 0x9E3779B9
_MIXED_ZERO_HIGH = int(_mix32(torch.tensor(_HIGH_OFFSET, dtype=torch.int64)))
"""What the high word of an index below 2**32 (every index of a tensor of at most 2**32 elements)
mixes to: a constant, so those indices skip a third of the hashing's tensor operations."""


def uniform_from_indices(key: int, indices: torch.Tensor, below_2_32: bool = False) -> torch.Tensor:
    """Values in (-1, 1), float64, one per flat index, a pure function of (key, index).
    ``below_2_32``: the caller knows every index is below 2**32 (the same values, computed faster)."""
    if below_2_32:
        h = _mix32(_mix32(indices ^ key) ^ _MIXED_ZERO_HIGH)
    else:
        low = indices & _M32
        high = (indices >> 32) & _M32
        h = _mix32(low ^ key)
        h = _mix32(h ^ _mix32(high + _HIGH_OFFSET))
    # map [0, 2**32) to (-1, 1), avoiding exact zeros so no element is accidentally a signed zero
    return (h.to(torch.float64) + 0.5) / 2.0**31 - 1.0


def box_values(seed: int, name: str, shape: tuple[int, ...], box: Box) -> torch.Tensor:
    """The float64 values of ``box`` of a logical tensor of ``shape``."""
    return uniform_from_indices(stream_key(seed, name), flat_indices(shape, box), math.prod(shape) <= 2**32)


def magnitude(seed: int, name: str) -> float:
    """A per-parameter scale in [1/4, 4), log-uniform, a pure function of (seed, name).

    Real gradients differ in size from tensor to tensor; so should ours. Otherwise every rank's
    largest element is close to 1, and a mistake in the inf norm (a mean of local maxima, say)
    hides inside the tolerance.
    """
    u = (zlib.crc32(f"magnitude\x00{seed}\x00{name}".encode()) & _M32) / 2.0**32
    return 2.0 ** (4.0 * u - 2.0)


def full_box(shape: tuple[int, ...]) -> Box:
    return tuple((0, s) for s in shape)


def logical_values(seed: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The whole logical tensor; equals the concatenation of every rank's slice."""
    if math.prod(shape) == 0:
        return torch.zeros(shape, dtype=torch.float64)
    return box_values(seed, name, shape, full_box(shape))

"""Dense little-endian arrays for the wire: token ids (Int32Array), log-probs (Float32Array).

The codec (common/wire/messages.py) writes an Array as ``[dtype, shape, data]``, inline or as
its own zero-copy frame; only the dtypes in ARRAY_TYPES are accepted on decode.
"""

from __future__ import annotations

import array
import math
import sys
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar


class Array:
    """A dense little-endian array: dtype, shape and a bytes-like buffer.

    Deliberately tiny so that daemons without numpy (env-hosts, reward-hosts) can
    carry token ids; ``numpy()`` gives a zero-copy view where numpy is installed.
    Build one with ``Int32Array([1, 2, 3])``, ``Int32Array(ndarray_or_tensor)`` or
    ``Int32Array.frombuffer(raw_le_bytes)``.
    """

    __slots__ = ("_data", "shape")
    dtype: ClassVar[str]  # numpy-style dtype string, as written on the wire
    _typecode: ClassVar[str]  # stdlib `array` typecode of the same item size
    itemsize: ClassVar[int] = 4

    def __init__(self, values: Iterable[Any] = ()) -> None:
        if isinstance(values, (bytes, bytearray, memoryview)):
            raise TypeError(f"use {type(self).__name__}.frombuffer() for raw bytes")
        if isinstance(values, Array):
            if values.dtype != self.dtype:
                raise TypeError(f"cannot make {self.dtype} array from {values.dtype}")
            self._data, self.shape = values._data, values.shape
            return
        if hasattr(values, "__array__"):  # numpy array, torch tensor (CPU)
            import numpy as np  # only where the caller already uses numpy

            src = np.asarray(values)
            if not np.can_cast(src.dtype, self.dtype, casting="same_kind"):
                raise TypeError(f"cannot make {self.dtype} array from {src.dtype}")
            a = np.ascontiguousarray(src, dtype=self.dtype)
            if src.dtype.kind in "iu" and src.dtype != a.dtype and not np.array_equal(src, a):
                raise OverflowError(f"values out of {self.dtype} range")
            self._data, self.shape = memoryview(a).cast("B"), tuple(a.shape)
            return
        a = array.array(self._typecode, values)
        assert a.itemsize == self.itemsize
        if sys.byteorder == "big":
            a.byteswap()
        self._data, self.shape = memoryview(a).cast("B"), (len(a),)

    @classmethod
    def frombuffer(cls, buf: Any, shape: Sequence[int] | None = None) -> Array:
        """Wrap raw little-endian bytes without copying."""
        data = memoryview(buf).cast("B")
        shape = (data.nbytes // cls.itemsize,) if shape is None else tuple(shape)
        if math.prod(shape) * cls.itemsize != data.nbytes:
            raise ValueError(f"shape {shape} does not match {data.nbytes} bytes of {cls.dtype}")
        obj = cls.__new__(cls)
        obj._data, obj.shape = data, shape
        return obj

    @property
    def data(self) -> memoryview:
        """The raw little-endian bytes (a flat, read-only-by-convention view)."""
        return self._data

    @property
    def nbytes(self) -> int:
        return self._data.nbytes

    @property
    def size(self) -> int:
        return self._data.nbytes // self.itemsize

    def __len__(self) -> int:
        return self.shape[0] if self.shape else 1

    def tolist(self) -> list[Any]:
        """Elements as a flat Python list."""
        if sys.byteorder == "big":
            a = array.array(self._typecode, bytes(self._data))
            a.byteswap()
            return a.tolist()
        return self._data.cast(self._typecode).tolist()

    def numpy(self) -> Any:
        """A read-only numpy view of the same memory (no copy)."""
        import numpy as np

        a = np.frombuffer(self._data, dtype=self.dtype).reshape(self.shape)
        a.flags.writeable = False  # it may be a received frame, or share a sender's data
        return a

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Array):
            return NotImplemented
        return self.dtype == other.dtype and self.shape == other.shape and self._data == other._data

    def __hash__(self) -> int:
        return hash((self.dtype, self.shape, bytes(self._data)))

    def __repr__(self) -> str:
        items = self.tolist()
        shown = items if len(items) <= 8 else [*items[:8], "..."]
        return f"{type(self).__name__}({shown}, shape={self.shape})"


class Int32Array(Array):
    """Token ids."""

    __slots__ = ()
    dtype = "<i4"
    _typecode = "i"


class Float32Array(Array):
    """Log-probabilities."""

    __slots__ = ()
    dtype = "<f4"
    _typecode = "f"


ARRAY_TYPES: dict[str, type[Array]] = {c.dtype: c for c in (Int32Array, Float32Array)}

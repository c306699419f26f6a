"""NIXL's descriptor lists: ``nixlXferDList`` (address, length, device),
``nixlRegDList`` (the same plus a metadata string, for registration) and
``nixlRemoteDList`` (the same plus the owning agent's name).

Each list keeps its descriptors as one N x 3 uint64 numpy array, so that
thousands of blocks (a KV cache's pages) are looked up and prepared with numpy,
without a Python loop per descriptor.
"""
from __future__ import annotations

import numpy as np

from ._types import MEM_NAMES, nixl_mem_t, nixlInvalidParamError

_EMPTY = np.zeros((0, 3), dtype=np.uint64)


def _as_mem(mem) -> nixl_mem_t:
    try:
        return nixl_mem_t(mem)
    except ValueError:
        raise nixlInvalidParamError(f"unknown memory type {mem!r}; NIXL's are "
                                    f"{', '.join(m.name for m in nixl_mem_t)}") from None


def _rows(descs, width: int, what: str) -> np.ndarray:
    """An N x 3 uint64 array of (address, length, device) from a numpy array or a
    list of tuples of `width` elements (the extra ones are read by the caller)."""
    if isinstance(descs, np.ndarray):
        if descs.ndim != 2 or descs.shape[1] != 3:
            raise nixlInvalidParamError(f"{what}: a numpy descriptor array must be N x 3 "
                                        f"(address, length, device), not {descs.shape}")
        if descs.dtype.kind not in "iu":
            raise nixlInvalidParamError(f"{what}: a numpy descriptor array must hold integers, "
                                        f"not {descs.dtype}")
        if descs.dtype.kind == "i" and descs.size and descs.min() < 0:
            raise nixlInvalidParamError(f"{what}: negative address, length or device in row "
                                        f"{int(np.argwhere(descs < 0)[0][0])}")
        return np.ascontiguousarray(descs, dtype=np.uint64)
    descs = list(descs)
    for i, d in enumerate(descs):
        if not isinstance(d, tuple) or len(d) != width:
            raise nixlInvalidParamError(f"{what}: descriptor {i} is {d!r}; expected a "
                                        f"{width}-tuple")
    if not descs:
        return _EMPTY.copy()
    try:
        return np.array([d[:3] for d in descs], dtype=np.uint64).reshape(-1, 3)
    except (OverflowError, ValueError, TypeError) as exc:
        raise nixlInvalidParamError(f"{what}: address, length and device must be "
                                    f"non-negative integers ({exc})") from None


class _DescList:
    """What the three lists share: a memory type and an N x 3 array."""

    _width = 3
    __slots__ = ("_type", "_arr")

    def __init__(self, type, descs=None, *extra):
        self._type = _as_mem(type)
        if descs is None:
            descs = 0
        if isinstance(descs, (int, np.integer)) and not isinstance(descs, bool):
            # (type, init_size): init_size zeroed descriptors, filled by __setitem__
            self._arr = np.zeros((int(descs), 3), dtype=np.uint64)
            self._init_extra([self._default_extra()] * int(descs))
            return
        self._arr = _rows(descs, self._width if not isinstance(descs, np.ndarray) else 3,
                          type_name(self))
        if isinstance(descs, np.ndarray):
            self._init_extra([self._default_extra()] * len(self._arr))
        else:
            self._init_extra([d[3] for d in descs] if self._width == 4 else [])

    # --- per-kind extra column (metadata string / agent name) ---------------------
    def _init_extra(self, extra) -> None:
        pass

    def _default_extra(self):
        return None

    def _extra(self, i: int) -> tuple:
        return ()

    def _set_extra(self, i: int, value) -> None:
        pass

    def _del_extra(self, i: int) -> None:
        pass

    def _append_extra(self, value) -> None:
        pass

    # --- NIXL's methods -----------------------------------------------------------
    def getType(self) -> nixl_mem_t:
        return self._type

    def descCount(self) -> int:
        return int(self._arr.shape[0])

    def isEmpty(self) -> bool:
        return self._arr.shape[0] == 0

    def _index(self, i) -> int:
        n = self.descCount()
        i = int(i)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"descriptor index {i} out of range: the list holds {n}")
        return i

    def __getitem__(self, i):
        i = self._index(i)
        a, ln, dev = (int(x) for x in self._arr[i])
        return (a, ln, dev) + self._extra(i)

    def __setitem__(self, i, desc) -> None:
        i = self._index(i)
        row = _rows([desc], self._width, type_name(self))
        self._arr[i] = row[0]
        if self._width == 4:
            self._set_extra(i, desc[3])

    def addDesc(self, desc) -> None:
        row = _rows([desc], self._width, type_name(self))
        self._arr = np.vstack([self._arr, row])
        if self._width == 4:
            self._append_extra(desc[3])

    append = addDesc

    def index(self, desc) -> int:
        for i in range(self.descCount()):
            if self[i] == tuple(desc):
                return i
        raise nixlInvalidParamError(f"descriptor {desc!r} is not in this {type_name(self)}")

    def remDesc(self, i) -> None:
        i = self._index(i)
        self._arr = np.delete(self._arr, i, axis=0)
        self._del_extra(i)

    def clear(self) -> None:
        self._arr = _EMPTY.copy()
        self._init_extra([])

    def print(self) -> None:
        print(repr(self))
        for i in range(self.descCount()):
            print(f"  {self[i]}")

    def __eq__(self, other) -> bool:
        return (type(other) is type(self) and other._type == self._type
                and np.array_equal(other._arr, self._arr)
                and all(other._extra(i) == self._extra(i) for i in range(self.descCount())))

    __hash__ = None

    def __repr__(self) -> str:
        return (f"<{type_name(self)} {MEM_NAMES[self._type]} "
                f"{self.descCount()} descriptor(s), {int(self._arr[:, 1].sum())} bytes>")

    # Ferry's additions: the columns, for code that wants them without a loop.
    @property
    def addresses(self) -> np.ndarray:
        return self._arr[:, 0]

    @property
    def lengths(self) -> np.ndarray:
        return self._arr[:, 1]

    @property
    def devices(self) -> np.ndarray:
        return self._arr[:, 2]

    def __reduce__(self):
        return (_rebuild, (type(self), int(self._type), self._arr.tobytes(),
                           [self._extra(i) for i in range(self.descCount())]))


def _rebuild(cls, mem: int, raw: bytes, extra: list):
    obj = cls(mem)
    obj._arr = np.frombuffer(raw, dtype=np.uint64).reshape(-1, 3).copy()
    obj._init_extra([e[0] for e in extra] if cls._width == 4 else [])
    return obj


def type_name(obj) -> str:
    return type(obj).__name__


class nixlXferDList(_DescList):
    """Transfer descriptors: (address, length, device)."""

    __slots__ = ()


class _WithExtra(_DescList):
    _width = 4
    __slots__ = ("_more",)

    def _init_extra(self, extra) -> None:
        self._more = [str(e) if e is not None else "" for e in extra]

    def _default_extra(self):
        return ""

    def _extra(self, i: int) -> tuple:
        return (self._more[i],)

    def _set_extra(self, i: int, value) -> None:
        self._more[i] = str(value)

    def _del_extra(self, i: int) -> None:
        del self._more[i]

    def _append_extra(self, value) -> None:
        self._more.append(str(value))


class nixlRegDList(_WithExtra):
    """Registration descriptors: (address, length, device, metadata string)."""

    __slots__ = ()

    def trim(self) -> nixlXferDList:
        """The same ranges as transfer descriptors (the metadata strings dropped)."""
        out = nixlXferDList(self._type)
        out._arr = self._arr.copy()
        return out


class nixlRemoteDList(_WithExtra):
    """Remote descriptors: (address, length, device, agent name)."""

    __slots__ = ()

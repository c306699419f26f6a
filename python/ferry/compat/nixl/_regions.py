"""Which registered region holds each descriptor: the lookup behind every
transfer, for this agent's memory and for a remote agent's.

Regions are kept per memory type in arrays sorted by address, so a list of N
descriptors is resolved with one ``searchsorted`` instead of N Python steps.
"""
from __future__ import annotations

import threading

import numpy as np

from ._types import MEM_NAMES, nixl_mem_t, nixlNotFoundError


class Region:
    """One registered range. ``handle`` is what the owner needs: a ferry.Region
    locally, the 64-byte Ferry descriptor for a remote agent's region."""

    __slots__ = ("mem", "address", "length", "device", "handle", "meta")

    def __init__(self, mem, address, length, device, handle, meta=""):
        self.mem = nixl_mem_t(mem)
        self.address = int(address)
        self.length = int(length)
        self.device = int(device)
        self.handle = handle
        self.meta = meta

    @property
    def key(self) -> tuple:
        return (int(self.mem), self.address, self.length, self.device)

    def __repr__(self) -> str:
        return (f"{MEM_NAMES[self.mem]} [0x{self.address:x}, +{self.length}) "
                f"device {self.device}")


class _Sorted:
    """One memory type's regions with their start/end/device columns sorted."""

    def __init__(self, regions: list):
        self.regions = sorted(regions, key=lambda r: (r.address, r.length))
        self.starts = np.array([r.address for r in self.regions], dtype=np.uint64)
        self.ends = np.array([r.address + r.length for r in self.regions], dtype=np.uint64)
        self.devices = np.array([r.device for r in self.regions], dtype=np.uint64)


class RegionTable:
    """Regions of one agent. Thread-safe: lookups run beside registrations (a
    handshake thread adding an agent while the main thread transfers)."""

    def __init__(self, owner: str):
        self.owner = owner            # for messages: "this agent 'x'" / "agent 'y'"
        self._mu = threading.Lock()
        self._by_mem: dict[int, list] = {}
        self._sorted: dict[int, _Sorted] = {}

    def add(self, region: Region) -> None:
        with self._mu:
            self._by_mem.setdefault(int(region.mem), []).append(region)
            self._sorted.pop(int(region.mem), None)

    def add_or_replace(self, region: Region) -> None:
        """For remote metadata loaded again: a range already known gets the new handle."""
        with self._mu:
            regions = self._by_mem.setdefault(int(region.mem), [])
            for i, r in enumerate(regions):
                if r.key == region.key:
                    regions[i] = region
                    break
            else:
                regions.append(region)
            self._sorted.pop(int(region.mem), None)

    def remove(self, key: tuple):
        """Takes the region with exactly this (mem, address, length, device) out."""
        with self._mu:
            regions = self._by_mem.get(key[0], [])
            for i, r in enumerate(regions):
                if r.key == key:
                    del regions[i]
                    self._sorted.pop(key[0], None)
                    return r
        return None

    def find_exact(self, key: tuple):
        with self._mu:
            for r in self._by_mem.get(key[0], []):
                if r.key == key:
                    return r
        return None

    def all(self) -> list:
        with self._mu:
            return [r for regions in self._by_mem.values() for r in regions]

    def count(self, mem) -> int:
        with self._mu:
            return len(self._by_mem.get(int(mem), []))

    def _table(self, mem: int) -> _Sorted:
        with self._mu:
            t = self._sorted.get(mem)
            if t is None:
                t = self._sorted[mem] = _Sorted(list(self._by_mem.get(mem, [])))
            return t

    def locate(self, mem, arr: np.ndarray, side: str):
        """For each (address, length, device) row: the index into ``regions`` of the
        region holding it and the offset in it. Raises nixlNotFoundError naming the
        first descriptor that lies in no region (`side` says whose list it was)."""
        mem = int(mem)
        t = self._table(mem)
        n = arr.shape[0]
        if n == 0:
            return t.regions, np.zeros(0, dtype=np.intp), np.zeros(0, dtype=np.uint64)
        addr, length, dev = arr[:, 0], arr[:, 1], arr[:, 2]
        idx = np.searchsorted(t.starts, addr, side="right").astype(np.intp) - 1
        safe = np.maximum(idx, 0)
        ok = (idx >= 0) & (addr + length <= t.ends[safe]) if len(t.regions) else np.zeros(n, bool)
        if mem == nixl_mem_t.VRAM_SEG and len(t.regions):
            ok &= dev == t.devices[safe]
        if not ok.all():
            # Nested or overlapping registrations: the closest start may not be the
            # one that holds the range; look at the others before refusing.
            for i in np.flatnonzero(~ok):
                found = self._scan(t, int(addr[i]), int(length[i]), int(dev[i]), mem)
                if found < 0:
                    raise nixlNotFoundError(self._miss(mem, t, side, int(i), arr[i]))
                idx[i] = found
        offsets = addr - t.starts[idx]
        return t.regions, idx, offsets

    @staticmethod
    def _scan(t: _Sorted, a: int, ln: int, dev: int, mem: int) -> int:
        for j, r in enumerate(t.regions):
            if r.address <= a and a + ln <= r.address + r.length and (
                    mem != nixl_mem_t.VRAM_SEG or r.device == dev):
                return j
        return -1

    def _miss(self, mem: int, t: _Sorted, side: str, i: int, row) -> str:
        a, ln, dev = (int(x) for x in row)
        name = MEM_NAMES[nixl_mem_t(mem)]
        where = f"{side} descriptor {i} ({name} [0x{a:x}, +{ln}) device {dev})"
        if not t.regions:
            return f"{where}: {self.owner} has no {name} memory registered"
        j = int(np.searchsorted(t.starts, np.uint64(a), side="right")) - 1
        near = t.regions[max(j, 0)]
        return (f"{where} lies outside the {name} memory {self.owner} registered "
                f"({len(t.regions)} region(s); nearest {near})")

"""UCCL compatibility: ``from ferry.compat.uccl import p2p`` instead of ``from uccl import p2p``.

See docs/uccl_compat.md for every difference from UCCL's behaviour.
"""
from . import p2p

__all__ = ["p2p"]

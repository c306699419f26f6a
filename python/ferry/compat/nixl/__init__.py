"""NIXL's Python API on Ferry: ``from ferry.compat.nixl import nixl_agent,
nixl_agent_config`` instead of ``from nixl._api import ...``.

The submodules mirror NIXL's: ``_api`` (nixl_agent, nixl_agent_config, the
handles), ``_bindings`` (the native names: nixlAgent, descriptor lists, enums,
exceptions), ``_utils`` and ``logging``. Code that imports ``nixl`` itself runs
unchanged once the shim is on its path: ``python -m ferry.compat.nixl.shim DIR``
writes a package ``nixl`` into DIR whose modules are these
(docs/nixl_compat.md).
"""
from . import _api, _bindings, _utils, logging
from ._api import (
    DEFAULT_COMM_PORT,
    nixl_agent,
    nixl_agent_config,
    nixl_backend_handle,
    nixl_prepped_dlist_handle,
    nixl_thread_sync_t,
    nixl_xfer_handle,
)

#: The submodules NIXL's package has, by the name they have there.
SUBMODULES = ("_api", "_bindings", "_utils", "logging")

__all__ = ["DEFAULT_COMM_PORT", "nixl_agent", "nixl_agent_config", "nixl_backend_handle",
           "nixl_prepped_dlist_handle", "nixl_thread_sync_t", "nixl_xfer_handle", "SUBMODULES"]

"""``nixl._bindings`` on Ferry: the names NIXL's native module exports (agent,
configuration, descriptor lists, enums, constants, exceptions, telemetry)."""
from __future__ import annotations

from ._agent import nixlAgent, nixlAgentConfig
from ._descs import nixlRegDList, nixlRemoteDList, nixlXferDList
from ._types import (
    DEFAULT_COMM_PORT,
    HAVE_UCX_GPU_DEVICE_API,
    NIXL_INIT_AGENT,
    nixl_cost_t,
    nixl_mem_t,
    nixl_status_t,
    nixl_thread_sync_t,
    nixl_xfer_op_t,
    nixlBackendError,
    nixlCancelledError,
    nixlError,
    nixlInvalidParamError,
    nixlMismatchError,
    nixlNoTelemetryError,
    nixlNotAllowedError,
    nixlNotFoundError,
    nixlNotPostedError,
    nixlNotSupportedError,
    nixlRemoteDisconnectError,
    nixlRepostActiveError,
    nixlUnknownError,
)
from ._xfer import nixlXferTelemetry

# pybind11's export_values(): every enum member is also a module attribute.
for _enum in (nixl_mem_t, nixl_xfer_op_t, nixl_status_t, nixl_thread_sync_t, nixl_cost_t):
    globals().update({m.name: m for m in _enum})
del _enum

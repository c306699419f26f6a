"""The package imports without torch (and without a GPU)."""
import subprocess
import sys


def test_import_without_torch():
    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # any 'import torch' now fails\n"
        "import ferry\n"
        "from ferry.compat.uccl import p2p\n"
        "e = ferry.Engine()\n"
        "assert sys.modules.get('torch') is None\n"
        "print(ferry.version(), ferry.protocol_version())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()


def test_public_names():
    import ferry
    for name in ("Engine", "Region", "Peer", "Transfer", "Descriptor", "StatusCode",
                 "FerryError", "PeerDisconnected", "PermissionDenied", "OutOfRange", "Timeout",
                 "NotFound", "InvalidArgument", "Cancelled", "NotSupported", "Busy",
                 "ProtocolError", "InternalError", "parse_metadata"):
        assert hasattr(ferry, name), name
    e = ferry.Engine(tcp_streams=2, options={"tcp.io_threads": "1"})
    opts = {o["name"]: o for o in e.options()}
    assert opts["tcp.streams"]["value"] == "2"
    info = ferry.parse_metadata(e.metadata())
    assert info.engine_id == e.id and info.tcp_addresses[0][1] == int(e.listen_address.rsplit(":", 1)[1])
    e.close()

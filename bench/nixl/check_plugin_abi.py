"""Compares the virtual-method table of libplugin_FERRY.so's backend engine with
that of a plugin shipped in a NIXL wheel (default: its POSIX plugin), slot by
slot. NIXL's core calls a backend through nixlBackendEngine's vtable, so a
plugin built against headers of another NIXL version than the one that loads it
breaks exactly here (a method added, removed or moved shifts every later slot).

    python bench/nixl/check_plugin_abi.py WHEEL_PLUGIN_DIR [FERRY_PLUGIN]

WHEEL_PLUGIN_DIR  e.g. .../site-packages/.nixl_cu13.mesonpy.libs/plugins
FERRY_PLUGIN      default build/nixl_plugins/libplugin_FERRY.so
Needs binutils (nm, readelf, c++filt). Exit status 0 when the tables agree.
"""

import re
import subprocess
import sys
from pathlib import Path


def run(*cmd):
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def symbols(so):
    """address -> name, and name -> (address, size), from the full symbol table."""
    by_address, by_name = {}, {}
    for line in run("nm", "-S", so).splitlines():
        parts = line.split()
        if len(parts) == 4:
            address, size, _, name = parts
            by_name[name] = (int(address, 16), int(size, 16))
            by_address.setdefault(int(address, 16), name)
        elif len(parts) == 3:
            by_address.setdefault(int(parts[0], 16), parts[2])
    return by_address, by_name


def vtable_slots(so, vtable_pattern):
    """The demangled method of each slot after the RTTI pointer, class name dropped."""
    by_address, by_name = symbols(so)
    names = [n for n in by_name if re.fullmatch(vtable_pattern, n)]
    if len(names) != 1:
        raise SystemExit(f"{so}: expected one vtable matching {vtable_pattern}, found {names}")
    start, size = by_name[names[0]]
    slots = {}
    for line in run("readelf", "-rW", so).splitlines():
        parts = line.split()
        if len(parts) < 4 or not re.fullmatch(r"[0-9a-f]{16}", parts[0]):
            continue
        offset = int(parts[0], 16)
        if not start <= offset < start + size:
            continue
        if "RELATIVE" in parts[2]:
            slots[offset] = by_address.get(int(parts[3], 16), parts[3])
        else:
            slots[offset] = parts[4]
    demangled = run("c++filt", *[slots[o] for o in sorted(slots)]).splitlines()
    methods = [re.sub(r"^.*?::(?=~?\w+\()", "", d) for d in demangled]
    return names[0], [m for m in methods if not m.startswith("typeinfo")]


def main():
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    reference = Path(sys.argv[1]) / "libplugin_POSIX.so"
    ferry = Path(sys.argv[2] if len(sys.argv) > 2 else "build/nixl_plugins/libplugin_FERRY.so")
    ref_name, ref_slots = vtable_slots(str(reference), r"_ZTV\d+nixlPosixEngine")
    our_name, our_slots = vtable_slots(str(ferry), r"_ZTVN5ferry11nixl_plugin18FerryBackendEngineE")
    print(f"reference {reference}: {ref_name}, {len(ref_slots)} slots")
    print(f"plugin    {ferry}: {our_name}, {len(our_slots)} slots")
    bad = 0
    for i in range(max(len(ref_slots), len(our_slots))):
        ref = ref_slots[i] if i < len(ref_slots) else "-"
        our = our_slots[i] if i < len(our_slots) else "-"
        # The destructor's name is the class's own.
        same = ref == our or (ref.startswith("~") and our.startswith("~"))
        bad += not same
        print(f"{'  ' if same else '!!'} {i:2d} {ref[:70]:70s} {our[:70]}")
    print("vtables agree" if not bad else f"{bad} slot(s) differ: rebuild against the NIXL tree of the wheel")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env bash
# Here (a machine with network): fetch what bench/cuda_ipc needs on the device
# machine, which has no network, into .devcarry/wheels-nixl (git-ignored,
# carried with run(carry=[...])). Only NIXL is missing there: torch (CUDA 13),
# numpy, matplotlib and nanobind are in its image.
#
#   bench/cuda_ipc/fetch_wheels.sh
#
# NIXL on PyPI: `nixl` is a meta package (pure Python: it picks nixl_cu12 or
# nixl_cu13 from the CUDA major of the installed torch) and requires both
# nixl-cu12 and nixl-cu13; `nixl-cu13` carries the UCX build with CUDA 13
# (nixl_cu13.libs/ucx/libuct_cuda.so: cuda_copy, cuda_ipc, gdr_copy). Both
# are installed with --no-deps (their other requirements, torch and numpy, are
# on the device). The nixl-cu13 wheel is 59 MB, of which 28 MB are the three
# torch extensions of `nixl_ep_cu13` (NIXL's expert-parallel package, unused
# here): the wheel is rewritten without that package (RECORD updated), so that
# .devcarry stays under the 64 MiB a device call may carry.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DEST="$ROOT/.devcarry/wheels-nixl"
VER=${NIXL_VERSION:-1.5.1}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$DEST"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_34_x86_64 \
  --platform any -d "$TMP" "nixl==$VER" "nixl-cu13==$VER"
rm -f "$DEST"/nixl-*.whl "$DEST"/nixl_cu13-*.whl
cp "$TMP"/nixl-"$VER"-*.whl "$DEST"/
python3 - "$TMP" "$DEST" <<'EOF'
import pathlib, sys, zipfile
src_dir, dest = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
whl = next(src_dir.glob("nixl_cu13-*.whl"))
drop = lambda name: name.startswith("nixl_ep_cu13/")
with zipfile.ZipFile(whl) as zin, zipfile.ZipFile(dest / whl.name, "w", zipfile.ZIP_DEFLATED) as zout:
    for info in zin.infolist():
        if drop(info.filename):
            continue
        data = zin.read(info)
        if info.filename.endswith(".dist-info/RECORD"):
            lines = data.decode().splitlines(keepends=True)
            data = "".join(l for l in lines if not drop(l)).encode()
        zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
print(f"{whl.name}: {whl.stat().st_size / 1e6:.1f} MB -> {(dest / whl.name).stat().st_size / 1e6:.1f} MB "
      "(without nixl_ep_cu13)")
EOF
ls -la "$DEST"
du -sh "$ROOT/.devcarry"/* 2>/dev/null

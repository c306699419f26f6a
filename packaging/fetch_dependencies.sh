#!/usr/bin/env bash
# Fills a folder with everything `pip install .` needs to build Ferry on a
# machine without network and without root (docs/design.md, "Dependencies and
# building without root"):
#   - the two pinned header archives cmake/FerryDependencies.cmake takes when
#     fmt/spdlog/nlohmann-json are not installed (checked by SHA-256 here and
#     again by CMake);
#   - the Python build requirements as wheels (scikit-build-core, nanobind,
#     cmake, ninja and theirs) and numpy, for the target's Python version.
# Then, on the machine without network:
#   FERRY_DEPENDENCY_DIR=DIR pip install --no-index --find-links DIR .
#
# usage: packaging/fetch_dependencies.sh DIR [PYTHON_VERSION, default: this python3's]
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: $0 DIR [PYTHON_VERSION e.g. 3.12]" >&2
  exit 2
fi
DIR=$1
PYVER=${2:-$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')}
SRC=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$DIR"

# name, url and sha256 as cmake/FerryDependencies.cmake pins them (one place).
pinned() {
  python3 - "$SRC/cmake/FerryDependencies.cmake" "FERRY_$1_$2" <<'PY'
import re, sys
m = re.search(r"set\(" + sys.argv[2] + r'\s+"([^"]+)"\)', open(sys.argv[1]).read())
print(m.group(1) if m else "")
PY
}
for dep in SPDLOG JSON; do
  archive=$(pinned "$dep" ARCHIVE)
  url=$(pinned "$dep" URL)
  sha=$(pinned "$dep" SHA256)
  if [ -z "$archive" ] || [ -z "$url" ] || [ -z "$sha" ]; then
    echo "fetch_dependencies: cannot read FERRY_${dep}_* from cmake/FerryDependencies.cmake" >&2
    exit 1
  fi
  if [ ! -f "$DIR/$archive" ] || ! echo "$sha  $DIR/$archive" | sha256sum -c --quiet - 2>/dev/null; then
    echo "fetch_dependencies: $url"
    curl -fsSL -o "$DIR/$archive.part" "$url"
    mv "$DIR/$archive.part" "$DIR/$archive"
  fi
  echo "$sha  $DIR/$archive" | sha256sum -c --quiet - ||
    { echo "fetch_dependencies: $archive does not have SHA-256 $sha" >&2; exit 1; }
done

# Build requirements (pyproject.toml's [build-system] requires, and what
# scikit-build-core needs on a machine without cmake/ninja), and numpy.
reqs=$(python3 - "$SRC/pyproject.toml" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
block = re.search(r"\[build-system\].*?requires\s*=\s*\[(.*?)\]", text, re.S).group(1)
print(" ".join(re.findall(r'"([^"]+)"', block)))
PY
)
# shellcheck disable=SC2086
python3 -m pip download -q --disable-pip-version-check --only-binary :all: \
  --python-version "$PYVER" --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 --platform linux_x86_64 --platform any \
  -d "$DIR" $reqs cmake ninja "numpy>=1.22"
echo "fetch_dependencies: $DIR holds $(ls "$DIR" | wc -l) files for Python $PYVER:"
ls "$DIR"

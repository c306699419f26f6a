"""pytest configuration for the Python suite.

The suite tests the installed `ferry` package (`pip install .`). For in-tree
development, point FERRY_PYTHONPATH at a build's python directory (the one
holding ferry/_ferry*.so, e.g. build-pydev/python) and it is put first on
sys.path here and in every child process.
"""
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
_extra = os.environ.get("FERRY_PYTHONPATH")
if _extra:
    sys.path.insert(0, os.path.abspath(_extra))
if _here not in sys.path:
    sys.path.insert(0, _here)
# Children started by subprocess/multiprocessing see the same path.
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in [os.path.abspath(_extra) if _extra else None, _here,
                os.environ.get("PYTHONPATH")] if p)

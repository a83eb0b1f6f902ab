"""Builds libkvfence.so into the package: with Go from the kvfence checkout
this directory belongs to (python/..; or $KVFENCE_GO_SRC), or copies the
library named by $KVFENCE_LIB. Everything else is in pyproject.toml.

    pip install --no-build-isolation ./python                 # needs Go 1.26, cgo, gcc
    KVFENCE_GO_TAGS=ucx pip install --no-build-isolation ./python   # with UCX (libucx-dev)
    KVFENCE_LIB=/path/libkvfence.so pip install --no-build-isolation ./python
"""

import os
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = os.path.dirname(os.path.abspath(__file__))


class BuildWithLibrary(build_py):
    def run(self):
        super().run()
        dst = os.path.join(self.build_lib, "kvfence", "libkvfence.so")
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        lib = os.environ.get("KVFENCE_LIB")
        if lib:
            if not os.path.isfile(lib):
                raise SystemExit("kvfence: KVFENCE_LIB=%s is not a file" % lib)
            shutil.copyfile(lib, dst)
            return
        src = os.environ.get("KVFENCE_GO_SRC", os.path.join(HERE, ".."))
        if not os.path.isfile(os.path.join(src, "go.mod")) or not os.path.isdir(os.path.join(src, "capi")):
            raise SystemExit("kvfence: no kvfence checkout at %s (set KVFENCE_GO_SRC to one, or KVFENCE_LIB to a "
                             "built libkvfence.so)" % os.path.abspath(src))
        go = shutil.which("go") or ("/usr/local/go/bin/go" if os.path.exists("/usr/local/go/bin/go") else None)
        if go is None:
            raise SystemExit("kvfence: building libkvfence.so needs Go (or set KVFENCE_LIB)")
        env = dict(os.environ, CGO_ENABLED="1")
        tags = os.environ.get("KVFENCE_GO_TAGS", "")  # e.g. "ucx": handoffs over UCX
        subprocess.check_call([go, "build", "-buildmode=c-shared", "-tags", tags, "-o", os.path.abspath(dst), "./capi"],
                              cwd=src, env=env)
        header = dst[:-3] + ".h"  # the cgo header beside it: not part of the package
        if os.path.exists(header):
            os.remove(header)


class BinaryDistribution(Distribution):
    """The wheel carries a native library: tag it for the platform."""

    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildWithLibrary}, distclass=BinaryDistribution)

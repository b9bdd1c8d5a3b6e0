# The build steps; everything else is in pyproject.toml.
# - nixl_backends._cuobj_compat: the cuObject stand-in that lets NIXL's OBJ plugin load
#   (see nixl_backends/csrc/cuobj_compat.cpp).
# - dualpath_mma/libmma_preload.so: the multipath copy library (mma_preload/), built by its own
#   Makefile, the one place its compiler flags are written.
import os
import shutil
import subprocess

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

MMA_LIBRARY = "libmma_preload.so"


class build_ext_with_mma(build_ext):
    """Also builds libmma_preload.so: into the wheel's dualpath_mma/, or for an editable install where a
    source checkout keeps it (mma_preload/build/, which dualpath_mma.library_path() falls back to)."""

    def run(self):
        super().run()
        here = os.path.dirname(os.path.abspath(__file__))
        out_dir = os.path.join(here, "mma_preload", "build") if self.inplace else os.path.abspath(
            os.path.join(self.build_temp, "mma_preload"))
        built = os.path.join(out_dir, MMA_LIBRARY)
        # CXX and CXXFLAGS from the environment reach the Makefile as its own defaults do.
        subprocess.run(["make", "-C", os.path.join(here, "mma_preload"), f"BUILD={out_dir}", built], check=True)
        if not self.inplace:
            target = os.path.join(self.build_lib, "dualpath_mma", MMA_LIBRARY)
            self.mkpath(os.path.dirname(target))
            shutil.copyfile(built, target)

    def get_outputs(self):
        if self.inplace:
            return super().get_outputs()
        return [*super().get_outputs(), os.path.join(self.build_lib, "dualpath_mma", MMA_LIBRARY)]


setup(
    cmdclass={"build_ext": build_ext_with_mma},
    ext_modules=[
        Extension(
            "nixl_backends._cuobj_compat",
            sources=["nixl_backends/csrc/cuobj_compat.cpp"],
            language="c++",
            extra_compile_args=["-O2", "-std=c++17"],
            extra_link_args=["-Wl,-soname,libcuobjclient.so.1"],
        )
    ],
)

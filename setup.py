# The only build step: the cuObject stand-in that lets NIXL's OBJ plugin load
# (see nixl_backends/csrc/cuobj_compat.cpp). Everything else is in pyproject.toml.
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "nixl_backends._cuobj_compat",
            sources=["nixl_backends/csrc/cuobj_compat.cpp"],
            language="c++",
            extra_compile_args=["-O2", "-std=c++17"],
            extra_link_args=["-Wl,-soname,libcuobjclient.so.1"],
        )
    ]
)

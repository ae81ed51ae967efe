"""Builds amoe._core, the C++ engine, as a torch C++ extension (it holds tensors and, later,
torch.distributed process groups)."""

import glob

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

sources = sorted(glob.glob("cpp/*.cpp"))

setup(
    ext_modules=[
        CppExtension(
            name="amoe._core",
            sources=sources,
            include_dirs=["cpp"],
            libraries=["zmq"],  # the communicator uses the libzmq C API (libzmq3-dev)
            extra_compile_args=["-O3", "-std=c++17", "-Wall", "-Wno-unused-function"],
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)

"""Builds amoe._core, the C++ engine, as a torch C++ extension (it holds tensors and, later,
torch.distributed process groups)."""

import glob
import os

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

sources = sorted(glob.glob("cpp/*.cpp"))


def _libzmq() -> dict:
    """How the communicator links libzmq: the system's, when its header is installed (Debian's libzmq3-dev), else
    the copy pyzmq's wheel bundles (it ships no header: cpp/zmq_api.h declares the API), so a user without root
    or Debian still builds. AMOE_LIBZMQ=pyzmq forces the bundled copy, =system the system's."""
    choice = os.environ.get("AMOE_LIBZMQ", "auto")
    if choice not in ("auto", "system", "pyzmq"):
        raise SystemExit(f"AMOE_LIBZMQ={choice!r}: expected auto, system or pyzmq")
    header = any(os.path.exists(os.path.join(d, "zmq.h")) for d in ("/usr/include", "/usr/local/include"))
    if choice == "system" or (choice == "auto" and header):
        return {"libraries": ["zmq"]}
    import zmq

    libs = os.path.join(os.path.dirname(os.path.dirname(zmq.__file__)), "pyzmq.libs")
    bundled = sorted(glob.glob(os.path.join(libs, "libzmq*.so*")))
    if not bundled:
        raise SystemExit(
            "no libzmq to link: install libzmq's headers (apt-get install libzmq3-dev) or a pyzmq wheel that "
            "bundles libzmq (pip install --force-reinstall --only-binary pyzmq pyzmq)"
        )
    # The bundled file has a hashed name (its soname): link it by that name, and find it there at run time.
    return {
        "extra_link_args": [f"-l:{os.path.basename(bundled[0])}"],
        "library_dirs": [libs],
        "runtime_library_dirs": [libs],
        "define_macros": [("AMOE_ZMQ_OWN_DECLARATIONS", "1")],
    }


setup(
    ext_modules=[
        CppExtension(
            name="amoe._core",
            sources=sources,
            include_dirs=["cpp"],
            extra_compile_args=["-O3", "-std=c++17", "-Wall", "-Wno-unused-function"],
            **_libzmq(),
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)

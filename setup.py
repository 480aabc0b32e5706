"""Builds the mover Backend (csrc/) as the extension module ``worker._C`` against the installed torch."""
import os

import torch
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

# rpath to torch's lib/ so that ``import worker._C`` works even before ``import torch`` has loaded libc10.
TORCH_LIB = os.path.join(os.path.dirname(torch.__file__), "lib")

setup(
    ext_modules=[
        CppExtension(
            name="worker._C",
            sources=["csrc/mover_backend.cpp", "csrc/bindings.cpp"],
            # -g0: Python's own CFLAGS add -g, and debug information for torch's headers doubled the compile time
            # (mover_backend.cpp 49 -> 25 s here); the symbols a backtrace needs stay in the symbol table.
            extra_compile_args=["-O2", "-g0", "-std=c++17"],
            extra_link_args=[f"-Wl,-rpath,{TORCH_LIB}"],
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)

"""Print what the build needs to know of the installed torch, one field per line.

Read by CMakeLists.txt: include dirs, library dirs, the C++11 ABI flag, torch's CUDA version
(or "none"), the C++ standard torch's headers need, and torch's version. The standard is the
one torch declares to CMake consumers in TorchConfig.cmake (20 for the torch releases whose
headers use C++20); 17 when torch declares none.
"""

import os
import re

import torch
import torch.utils.cpp_extension as cpp


def cxx_standard() -> int:
    config = os.path.join(
        os.path.dirname(torch.__file__), "share", "cmake", "Torch", "TorchConfig.cmake"
    )
    if os.path.exists(config):
        with open(config) as f:
            found = re.search(r"CXX_STANDARD\s+(\d+)", f.read())
        if found:
            return max(17, int(found.group(1)))
    return 17


print(",".join(cpp.include_paths()))
print(",".join(cpp.library_paths()))
print(int(torch._C._GLIBCXX_USE_CXX11_ABI))
print(torch.version.cuda or "none")
print(cxx_standard())
print(torch.__version__)

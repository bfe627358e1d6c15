"""Print what the build needs to know of the installed torch, one field per line.

Read by CMakeLists.txt: include dirs, library dirs, the C++11 ABI flag, torch's CUDA version
(or "none"), the C++ standard torch's headers need (:func:`cxx_standard`), torch's version and
the C++ runtime library this process loaded with torch (:func:`loaded_cxx_runtime`, or
"none").
"""

import os
import re

import torch
import torch.utils.cpp_extension as cpp


def cxx_standard() -> int:
    """The newest standard torch asks of its CMake consumers (``CXX_STANDARD 20`` up to torch
    2.14, ``cxx_std_20`` from 2.15), at least C++20 from torch 2.14 on, else C++17."""
    found = [17]
    config = os.path.join(
        os.path.dirname(torch.__file__), "share", "cmake", "Torch", "TorchConfig.cmake"
    )
    if os.path.exists(config):
        with open(config) as f:
            text = f.read()
        found += [int(n) for n in re.findall(r"(?:CXX_STANDARD\s+|cxx_std_)(\d+)", text)]
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    if (major, minor) >= (2, 14):  # its headers use C++20
        found.append(20)
    return max(found)


def loaded_cxx_runtime() -> str:
    """The path of the ``libstdc++.so.6`` mapped into this process (the one torch runs with),
    from ``/proc/self/maps``; "none" where there is none (or no ``/proc``)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1]
                if os.path.basename(path).startswith("libstdc++.so") and os.path.isfile(path):
                    return path
    except OSError:
        pass
    return "none"


print(",".join(cpp.include_paths()))
print(",".join(cpp.library_paths()))
print(int(torch._C._GLIBCXX_USE_CXX11_ABI))
print(torch.version.cuda or "none")
print(cxx_standard())
print(torch.__version__)
print(loaded_cxx_runtime())

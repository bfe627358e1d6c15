"""Building the compiled library on first use, once per torch and GPU architecture.

The package is pure Python and carries its C++/CUDA sources. The compiled library (``_C.so``:
the native planner, the op schemas and, for a Hopper GPU, the CUDA kernels) is built with CMake
and Ninja against the torch that is installed, the first time it is needed, and kept in a
cache that later processes load directly:

    $PREFIXATTN_CACHE_DIR, else $XDG_CACHE_HOME/prefixattn, else ~/.cache/prefixattn
      <torch version>-py<X.Y>-<cpu | sm90a>-<hash of the sources>/_C.so

So one wheel serves every supported torch release (the C++ standard, include paths and ABI
flags come from the torch found at build time, ``cmake/torch_info.py``), and a torch upgrade
or a source change gets a fresh build instead of a library that fails to load. A build for a
GPU needs ``nvcc`` (CUDA_HOME, else PATH, else /usr/local/cuda); without it the library is
built CPU-only and CUDA tensors are refused with the reason. ``prefixattn build`` compiles
ahead of time (for an image, or a node without a GPU); concurrent first uses (an engine's
workers) wait on one file lock and build once.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

CACHE_ENV = "PREFIXATTN_CACHE_DIR"
SUPPORTED_ARCHS = ("90a",)
"""CUDA architectures the kernels are written for (Hopper: wgmma, TMA-era PTX)."""

_SOURCE_PARTS = ("CMakeLists.txt", "cmake", "cpp")


class BuildError(RuntimeError):
    """Compiling the library failed; the message names the log."""


@dataclasses.dataclass(frozen=True)
class BuildSpec:
    """What to compile: the CUDA architectures of the kernels (empty: CPU only)."""

    cuda_archs: tuple[str, ...] = ()

    @property
    def tag(self) -> str:
        return "cpu" if not self.cuda_archs else "-".join("sm" + a for a in self.cuda_archs)


def source_dir() -> Path:
    """Where CMakeLists.txt and cpp/ are: ``prefixattn/csrc`` in an installed wheel, the
    repository root in a source checkout."""
    package = Path(__file__).resolve().parents[1]
    for root in (package / "csrc", package.parents[1]):
        if (root / "CMakeLists.txt").is_file() and (root / "cpp").is_dir():
            return root
    raise BuildError(
        f"prefixattn: the C++ sources are missing (looked in {package / 'csrc'} and "
        f"{package.parents[1]}); reinstall the package"
    )


def sources_hash(root: Path) -> str:
    digest = hashlib.sha256()
    for part in _SOURCE_PARTS:
        path = root / part
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        for f in files:
            if "__pycache__" in f.parts:
                continue
            digest.update(str(f.relative_to(root)).encode())
            digest.update(f.read_bytes())
    return digest.hexdigest()[:12]


def cache_root() -> Path:
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "prefixattn"


def find_nvcc() -> str | None:
    """The CUDA compiler: $CUDA_HOME/bin/nvcc, else nvcc on PATH, else /usr/local/cuda."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return str(Path(home) / "bin" / "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.is_file() else None


def device_arch(device: int | None = None) -> str | None:
    """The kernel architecture of a CUDA device ("90a"), or None when the kernels do not
    support it."""
    major, minor = torch.cuda.get_device_capability(device)
    arch = f"{major}{minor}a"
    return arch if arch in SUPPORTED_ARCHS else None


def device_problem() -> str | None:
    """Why this process has no GPU the kernels run on, or None when it has one."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is built without CUDA"
    if not torch.cuda.is_available():
        return "no CUDA device is available"
    if device_arch() is None:
        major, minor = torch.cuda.get_device_capability()
        return (
            f"the GPU ({torch.cuda.get_device_name()}, sm_{major}{minor}) is not supported: the "
            f"kernels are built for {', '.join('sm_' + a for a in SUPPORTED_ARCHS)} (H100 / H200)"
        )
    return None


def default_spec() -> BuildSpec:
    """The kernels for this process's GPU when it has one they support, else CPU only."""
    if device_problem() is None:
        arch = device_arch()
        assert arch is not None
        return BuildSpec((arch,))
    return BuildSpec()


def build_dir(spec: BuildSpec, root: Path | None = None) -> Path:
    root = source_dir() if root is None else root
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    name = f"torch{torch.__version__}-py{version}-{spec.tag}-{sources_hash(root)}"
    return cache_root() / name


def library_path(spec: BuildSpec) -> Path:
    return build_dir(spec) / "_C.so"


def build_info(spec: BuildSpec) -> dict[str, object] | None:
    """The record of a finished build of ``spec`` in the cache, or None."""
    info = build_dir(spec) / "build-info.json"
    if not info.is_file():
        return None
    with open(info) as f:
        data: dict[str, object] = json.load(f)
    return data


def ensure_built(spec: BuildSpec, *, verbose: bool = False) -> Path:
    """The cached library of ``spec``, compiled first if the cache has none."""
    out = build_dir(spec)
    if build_info(spec) is not None:
        return out / "_C.so"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(str(out) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it: wait
        if build_info(spec) is None:
            _compile(spec, out, verbose)
    return out / "_C.so"


def _tool(name: str) -> str:
    """cmake / ninja: the pip-installed binaries (dependencies of the package), else PATH."""
    try:
        if name == "cmake":
            import cmake

            return str(Path(cmake.CMAKE_BIN_DIR) / "cmake")
        import ninja

        return str(Path(ninja.BIN_DIR) / "ninja")
    except ImportError:
        found = shutil.which(name)
        if found is None:
            raise BuildError(f"prefixattn: {name} is needed to compile the library") from None
        return found


def _compile(spec: BuildSpec, out: Path, verbose: bool) -> None:
    root = source_dir()
    work = out / "build"
    work.mkdir(parents=True, exist_ok=True)
    what = "the native planner" + (
        f" and the CUDA kernels for {', '.join('sm_' + a for a in spec.cuda_archs)}"
        if spec.cuda_archs
        else ""
    )
    print(
        f"prefixattn: compiling {what} for torch {torch.__version__} into {out} "
        "(once; later runs load it from there)",
        file=sys.stderr,
        flush=True,
    )
    env = dict(os.environ)
    configure = [
        _tool("cmake"),
        "-S",
        str(root),
        "-B",
        str(work),
        "-G",
        "Ninja",
        f"-DCMAKE_MAKE_PROGRAM={_tool('ninja')}",
        "-DCMAKE_BUILD_TYPE=Release",
        f"-DPython_EXECUTABLE={sys.executable}",
        f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out}",
    ]
    if spec.cuda_archs:
        nvcc = find_nvcc()
        if nvcc is None:
            raise BuildError("prefixattn: nvcc was not found; set CUDA_HOME")
        configure += [
            "-DPREFIXATTN_CUDA=ON",
            f"-DCMAKE_CUDA_COMPILER={nvcc}",
            f"-DPREFIXATTN_CUDA_ARCHS={';'.join(spec.cuda_archs)}",
        ]
    else:
        configure.append("-DPREFIXATTN_CUDA=OFF")
    jobs = os.environ.get("MAX_JOBS") or str(max(1, os.cpu_count() or 1))
    start = time.monotonic()
    log_path = out / "build.log"
    with open(log_path, "w") as log:
        for cmd in (configure, [_tool("cmake"), "--build", str(work), "-j", jobs]):
            log.write("$ " + " ".join(cmd) + "\n")
            log.flush()
            result = subprocess.run(
                cmd,
                stdout=None if verbose else log,
                stderr=subprocess.STDOUT,
                env=env,
                check=False,
            )
            if result.returncode != 0:
                tail = log_path.read_text().splitlines()[-20:] if not verbose else []
                raise BuildError(
                    f"prefixattn: compiling the library failed (exit {result.returncode}); "
                    f"full log: {log_path}\n" + "\n".join(tail)
                )
    seconds = time.monotonic() - start
    info = {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_archs": list(spec.cuda_archs),
        "python": sys.version.split()[0],
        "sources": str(root),
        "compile_seconds": round(seconds, 1),
    }
    with open(out / "build-info.json", "w") as f:
        json.dump(info, f, indent=1)
    print(f"prefixattn: compiled in {seconds:.0f} s", file=sys.stderr, flush=True)

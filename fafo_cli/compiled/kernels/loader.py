"""Our C++ kernels (attention_op.cpp, packed_linear.cpp, rms_norm.cpp), compiled once per machine and torch version
with the C++ compiler that compiled steps need anyway, cached next to the compiled packages, and loaded into
torch as `fafo::` ops."""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from ...files import atomic_path
from ...runtime.llama import serve_bf16_rms_norm
from ...runtime.model import serve_cpu_attention

SOURCES = tuple(Path(__file__).with_name(name) for name in ("attention_op.cpp", "packed_linear.cpp", "rms_norm.cpp"))
HEADERS = (Path(__file__).with_name("amx.h"),)  # what the sources include from this folder
_loaded = False


class BuildError(RuntimeError):
    """The C++ compiler failed or is missing."""


@functools.cache
def cpu_flags() -> str:
    """The CPU's feature flags as Linux lists them (/proc/cpuinfo; empty elsewhere): read once per process, as every
    compiled step asks (`attends`, through build.stored_dtype)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            return next((line.split(":", 1)[1].strip() for line in info if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


AMX_FLAGS = frozenset({"amx_tile", "amx_bf16"})  # what our kernels' AMX paths need, as /proc/cpuinfo names it


def _has_flag(name: str) -> bool:
    """Whether the CPU lists `name` (a word search: every compiled step asks, through `attends`)."""
    return f" {name} " in f" {cpu_flags()} "


def has_amx() -> bool:
    return all(_has_flag(flag) for flag in AMX_FLAGS)


def attends() -> bool:
    """Whether steps attend with our kernel here: its vectors are built for AVX-512 (16 floats) and AVX2 (8); on
    other CPUs (ARM, x86 without AVX2) the compiler would split them into narrower registers, so torch's serves."""
    return _has_flag("avx512f") or _has_flag("avx2")


@functools.cache
def cpu_features() -> str:
    """What code built with -march=native depends on: the CPU's vector level and the instruction-set features the
    compiler enables for it, as the macros -march=native adds to its predefined ones (__AVX512BF16__,
    __ARM_FEATURE_SVE...: a cache folder may move to another machine of the same level that lacks one). Not
    /proc/cpuinfo's whole line, which also holds the kernel's and a VM's own flags: a kernel update or a VM moved to
    another host changed it, and every package was orphaned. Where the compiler cannot say, the CPU's flags."""
    native, base = _predefined_macros("-march=native"), _predefined_macros()
    if native is None or base is None:
        features = " ".join(flag for flag in cpu_flags().split() if ISA_FLAG.match(flag))
    else:  # ("#define NAME VALUE" lines; the features' names are upper case, not the CPU model's or its tuning's,
        # as __znver4__ and __tune_znver4__: another model of the same instruction sets runs the same code)
        names = (line.split()[1] for line in native - base if len(line.split()) > 1)
        features = " ".join(sorted(name for name in names if not re.match(r"__[a-z]", name)))
    return f"{torch.backends.cpu.get_cpu_capability()} {features}"


# /proc/cpuinfo's instruction-set flags (x86's, Arm's), where the compiler cannot name them: not the kernel's, the
# hypervisor's or the mitigations' own, which an update or another host changes
ISA_FLAG = re.compile(r"(sse|ssse|avx|amx|fma|f16c|bmi|adx|aes|vaes|pclmul|vpclmul|gfni|sha|popcnt|movbe|abm|lzcnt"
                      r"|asimd|sve|sme|bf16|i8mm|fp|crc32|atomics|dotprod)")


def _predefined_macros(*flags: str) -> frozenset[str] | None:
    """The compiler's predefined macros under `flags` ("#define NAME VALUE" lines); None where it cannot say."""
    return _macros(tuple(compiler_command()), flags)


@functools.cache  # (cpu_features and toolchain both read the plain set: the compiler runs once for both)
def _macros(command: tuple[str, ...], flags: tuple[str, ...]) -> frozenset[str] | None:
    if not developer_tools():
        return None
    try:
        done = subprocess.run([*command, *flags, "-dM", "-E", "-x", "c++", "-"], input="", capture_output=True,
                              text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return frozenset(done.stdout.splitlines()) if done.returncode == 0 else None


@functools.cache
def developer_tools() -> bool:
    """Whether a compiler may be run at all: on macOS, /usr/bin's g++ and clang++ without the Command Line Tools
    are stubs that open a dialog asking to install them, at every fafo start (a model's steps folder is named by
    the toolchain, on every device): xcode-select, which opens none, says whether they are there."""
    if sys.platform != "darwin":
        return True
    try:
        return subprocess.run(["xcode-select", "-p"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@functools.cache
def toolchain() -> str:
    """What else a built library depends on besides the CPU: the compiler's version (its C++ runtime), the C
    library's, and torch's build (its git revision and C++ ABI: two builds may share a version string). A cache shared
    by machines that differ in these (a home folder on a network) keeps a library for each, instead of one that the
    other cannot load, run after run."""
    macros = _predefined_macros() or frozenset()
    compiler_version = next((line for line in sorted(macros) if line.startswith("#define __VERSION__ ")), "")
    libc = " ".join(platform.libc_ver())
    build = getattr(torch.version, "git_version", "")
    return f"{compiler_version} {libc} {build} {int(torch._C._GLIBCXX_USE_CXX11_ABI)}"


def compiler_command() -> list[str]:
    """The C++ compiler our kernels are built with: $CXX (split as a shell splits it: `ccache g++`), else g++."""
    return shlex.split(os.environ.get("CXX", "")) or ["g++"]


def compiler() -> str:
    """Its program (what must be on the PATH)."""
    return compiler_command()[0]


def compiler_path() -> str | None:
    """Where the compiler is, where there is one that can run (not macOS's stub without its tools)."""
    return shutil.which(compiler()) if developer_tools() else None


def version() -> str:
    """Names a build of our kernels: their sources, torch's version, the CPU's features (the code is built for
    this CPU) and the toolchain. Compiled packages carry it too: they hold weights packed for packed_linear's
    layout."""
    machine = f"{torch.__version__} {cpu_features()} {toolchain()}"
    code = b"".join(p.read_bytes() for p in SOURCES + HEADERS)
    return hashlib.sha256(code + machine.encode()).hexdigest()[:16]


def library_path(folder: Path) -> Path:
    return folder / f"fafo-ops-{version()}.so"


def compile_library(path: Path, sources: tuple[Path, ...] = SOURCES) -> None:
    """Compile `sources` into the shared library `path` (atomically)."""
    from torch.utils import cpp_extension

    path.parent.mkdir(parents=True, exist_ok=True)
    cxx = compiler()
    if not developer_tools():
        raise BuildError(f"cannot run {cxx}: macOS's Command Line Tools are not installed (xcode-select --install)")
    try:
        with atomic_path(path) as partial:
            command = [*compiler_command(), "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-w",
                       f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
                       f"-I{HEADERS[0].parent}", *(f"-I{p}" for p in cpp_extension.include_paths()),
                       *map(str, sources), "-o", str(partial),
                       *(f"-L{p}" for p in cpp_extension.library_paths()), "-lc10", "-ltorch_cpu"]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode:
                lines = (done.stderr or done.stdout).strip().splitlines()
                reason = next((line for line in lines if "error" in line), lines[0] if lines else done.returncode)
                raise BuildError(f"{cxx} failed: {reason}")
    except OSError as error:
        raise BuildError(f"cannot run {cxx}: {error.strerror}") from None


def load_as(source: str, namespace: str, folder: Path, defines: str = ""):
    """The kernels in `source` (compiled in `folder` after `defines`), registered as torch.ops.<namespace>
    instead of fafo: another revision or build of a kernel beside ours, for comparisons and tests."""
    path = folder / f"{namespace}.cpp"
    path.write_text(defines + source.replace("(fafo,", f"({namespace},"))
    compile_library(folder / f"{namespace}.so", (path,))
    torch.ops.load_library(str(folder / f"{namespace}.so"))
    return getattr(torch.ops, namespace)


def loaded() -> bool:
    """Whether this process has our ops already (from any folder: a library is loaded once per process)."""
    return _loaded


def load(folder: Path) -> None:
    """Make the `torch.ops.fafo` ops available, compiling the library into `folder` on first use."""
    global _loaded
    if _loaded:
        return
    path = library_path(folder)
    if not path.exists():
        compile_library(path)
    torch.ops.load_library(str(path))

    @torch.library.register_fake("fafo::attend")
    def _(q, k, v, sees_cache, sees_view, view_mask, local, scale):  # for tracing: the queries' shape, float32
        return q.new_empty(q.shape, dtype=torch.float32)

    @torch.library.register_fake("fafo::packed_linear")
    def _(x, packed, out_features, bias):
        return x.new_empty(x.shape[0], out_features)

    @torch.library.register_fake("fafo::rms_norm")
    def _(x, weight, eps):
        return torch.empty_like(x)

    # bf16 keys take the AMX path where the CPU has one, which reads a draft tree's rows in place (attention_op.cpp:
    # a branch row may round unlike plain decoding's): there eager steps keep float32 keys (the vector path). Where
    # our kernel does not serve (`attends`), eager steps keep torch's, whose rows may round apart by ~1e-5 in float32.
    serve_cpu_attention(torch.ops.fafo.attend if attends() else None, reads_bf16=not has_amx())
    serve_bf16_rms_norm(torch.ops.fafo.rms_norm)  # eager steps and the packages then norm alike
    _loaded = True

"""``volta-train env`` / ``python -m volta_train.env``: what volta_train sees here, on one screen.

torch and its CUDA version, the GPUs, the kernel source directory, the NVRTC that would compile the kernels, the
kernel cache directory, which backend a typical call (fp16, [2, 4096, 16, 64], causal) would take and why, and the
transformers version with the model families ``volta_train.patch`` supports.

The last line is the verdict, and the exit status says the same to scripts:

* 0 (``ready``): the kernels can be built here: the CUDA sources are there and an NVRTC compiles for the GPU
  present (for sm_70 when there is none, so ``volta-train precompile`` works) and makes cubins its driver loads;
* 1 (``NOT READY``): they cannot: the sources are missing, or a GPU is present and no NVRTC targets it, or the
  NVRTC is newer than its driver (a CUDA 11 driver loads no cubin from NVRTC 12: point ``VOLTA_TRAIN_NVRTC`` at
  NVRTC 11.8's ``libnvrtc.so.11.2``);
* 2: a usage error;
* 3 (``CPU only``): no GPU and no NVRTC for sm_70: training runs on the reference backend, but no kernel can be
  built or precompiled here.
"""

from __future__ import annotations

import os
import platform

import torch

from . import __version__, resources, versions
from .dispatch import BACKEND_ENV, choose_backend
from .kernels import CallDescription
from .options import AttentionOptions
from .kernels import driver, nvrtc
from .kernels.cache import CACHE_DIR_ENV, ENTRY_SUFFIX, LOCK_TIMEOUT_ENV, cache_dir_path

READY, NOT_READY, CPU_ONLY = 0, 1, 3  # exit statuses (see the module doc)
TYPICAL_SHAPE = (2, 4096, 16, 64)  # batch, seqlen, heads, head_dim
VOLTA_ARCH = 70
ENV_VARS = (BACKEND_ENV, resources.CSRC_ENV, nvrtc.NVRTC_ENV, CACHE_DIR_ENV, LOCK_TIMEOUT_ENV, "CUDA_VISIBLE_DEVICES", "CUDA_HOME")


def gpu_lines() -> list[str]:
    if not torch.cuda.is_available():
        return ["GPU: no CUDA GPU" + ("" if torch.version.cuda else " (this torch build has no CUDA)")]
    lines = [f"CUDA driver: supports CUDA {driver_version_text()}"]
    for index in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(index)
        name = torch.cuda.get_device_name(index)
        lines.append(f"GPU {index}: {name}, compute capability {major}.{minor} (sm_{major}{minor})")
    return lines


def driver_version_text() -> str:
    try:
        return "%d.%d" % driver.driver_version()
    except driver.CudaDriverError as error:
        return f"unknown ({error})"


def target_arch() -> int:
    """The first GPU's architecture, or sm_70 (what the kernels are for) without a GPU."""
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(0)
        return 10 * major + minor
    return VOLTA_ARCH


def nvrtc_problem(arch: int) -> str | None:
    """Why no NVRTC compiles for ``arch`` here, or None."""
    try:
        nvrtc.select_nvrtc(nvrtc.available_nvrtc_libraries(), arch)
    except nvrtc.NvrtcNotFoundError as error:
        return str(error)
    return None


def driver_problem(arch: int) -> str | None:
    """Why the driver cannot load the cubins of the NVRTC chosen for ``arch`` (its CUDA major version is older than
    the NVRTC's), or None (also when either is unknown)."""
    try:
        chosen = nvrtc.select_nvrtc(nvrtc.available_nvrtc_libraries(), arch)
        supported = driver.driver_version()
    except (nvrtc.NvrtcNotFoundError, driver.CudaDriverError, OSError):
        return None
    if chosen.version[0] <= supported[0]:
        return None
    return (f"NVRTC {chosen.version_string} ({chosen.path}) makes cubins that this driver "
            f"(CUDA {supported[0]}.{supported[1]}) cannot load: update the driver, or pip install "
            f"nvidia-cuda-nvrtc-cu{supported[0]} and set {nvrtc.NVRTC_ENV} to its libnvrtc (docs/kernel_build.md)")


def source_lines() -> list[str]:
    try:
        directory = resources.csrc_dir()
    except FileNotFoundError as error:
        return [f"kernel sources: MISSING: {error}"]
    files = sorted(p.name for p in directory.iterdir() if p.suffix in (".cu", ".cuh"))
    return [f"kernel sources: {directory} ({len(files)} files)"]


def transformers_lines() -> list[str]:
    """The HF stack against its tested range, and which census table applies (volta_train.integrations.hf.census)."""
    try:
        import transformers
    except ImportError as error:
        return [f"transformers: not installed ({error}): volta_train.patch and the recipes need it"]
    from .integrations import hf  # (imports transformers: only once it is known to be there)

    record = hf.census()
    counts: dict[str, int] = {}
    for status, _ in record["results"].values():
        counts[status] = counts.get(status, 0) + 1
    summary = ", ".join(f"{counts.get(s, 0)} {s}" for s in ("ok", "refused", "wrong"))
    if record["transformers"] == transformers.__version__:
        which = f"census of transformers {record['transformers']}, the installed release"
    else:
        which = (f"no census of transformers {transformers.__version__}; the newest older one, of transformers "
                 f"{record['transformers']}, applies (patch() checks every model the same way on any release; "
                 "the test suite's census checks this one)")
    return [*(versions.standing(package) for package in versions.TESTED),
            f"volta_train.patch takes any model transformers declares flash-attention capable whose attention goes "
            f"through its attention interface; {which}: {len(record['results'])} text model types, {summary} "
            f"(the list: docs/hf_integration.md, or volta_train.integrations.hf.supported_model_types())"]


def problems() -> list[str]:
    """What stops the kernels from being built here (empty: nothing)."""
    found = []
    if any(line.startswith("kernel sources: MISSING") for line in source_lines()):
        found.append("the CUDA sources are missing (reinstall volta_train from a wheel or sdist, or run from a checkout)")
    if torch.cuda.is_available():
        arch = target_arch()
        why = nvrtc_problem(arch)
        if why is not None:
            found.append(f"no NVRTC targets the GPU present (sm_{arch}): {why.splitlines()[0]}")
        else:
            mismatch = driver_problem(arch)
            if mismatch is not None:
                found.append(mismatch)
    return found


def status(found: list[str]) -> int:
    """The exit status of the report (see the module doc)."""
    if found:
        return NOT_READY
    if not torch.cuda.is_available() and nvrtc_problem(VOLTA_ARCH) is not None:
        return CPU_ONLY
    return READY


def verdict_line(found: list[str]) -> str:
    if found:
        return "NOT READY: " + "; ".join(found)
    if torch.cuda.is_available():
        return f"ready: kernels compile for sm_{target_arch()} at first use (volta-train precompile does it ahead)"
    if status(found) == CPU_ONLY:
        return ("CPU only: no GPU -> reference backend; no NVRTC for sm_70, so no kernel can be built or precompiled "
                "here (pip install nvidia-cuda-nvrtc-cu12)")
    return "ready: no GPU -> reference backend; kernels for sm_70 can be precompiled here"


def nvrtc_lines(arch: int) -> list[str]:
    try:
        libraries = nvrtc.available_nvrtc_libraries()
        chosen = nvrtc.select_nvrtc(libraries, arch)
    except nvrtc.NvrtcNotFoundError as error:
        return [f"NVRTC for sm_{arch}: NOT FOUND: {error}"]
    lines = [f"NVRTC for sm_{arch}: {chosen.version_string} at {chosen.path}"]
    for library in libraries:
        archs = " ".join(str(a) for a in library.supported_archs)
        lines.append(f"  found NVRTC {library.version_string} at {library.path}; archs {archs}")
    for path, why in nvrtc.load_failures().items():
        lines.append(f"  unusable: {path}: {why}")
    return lines


def cache_lines() -> list[str]:
    directory = cache_dir_path()
    if not directory.is_dir():
        return [f"kernel cache: {directory} (not created yet)"]
    entries = sum(1 for path in directory.iterdir() if path.name.endswith(ENTRY_SUFFIX))
    mode = oct(directory.stat().st_mode & 0o777)[2:]
    return [f"kernel cache: {directory} (entries: {entries}, mode {mode})"]


def backend_line() -> str:
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    batch, seqlen, heads, head_dim = TYPICAL_SHAPE
    call = CallDescription(device=device, dtype=torch.float16, head_dim=head_dim,
                           options=AttentionOptions(softmax_scale=head_dim**-0.5, causal=True))
    what = f"typical call (fp16, [{batch}, {seqlen}, {heads}, {head_dim}], causal, on {device})"
    try:
        choice = choose_backend(call)
    except Exception as error:  # e.g. VOLTA_TRAIN_BACKEND=kernel where the kernel cannot run: report, don't fail
        return f"{what}: error: {error}"
    return f"{what}: {choice.backend} backend, because {choice.reason}"


def report(found: list[str] | None = None) -> str:
    lines = [
        f"volta_train {__version__}, Python {platform.python_version()}",
        f"torch {torch.__version__}, torch CUDA {torch.version.cuda or 'none (CPU build)'}",
        *gpu_lines(),
        *source_lines(),
        *nvrtc_lines(target_arch()),
        *cache_lines(),
        backend_line(),
        *transformers_lines(),
    ]
    settings = [f"{name}={os.environ[name]}" for name in ENV_VARS if name in os.environ]
    lines.append("environment: " + (" ".join(settings) if settings else "no volta_train/CUDA variables set"))
    lines.append(verdict_line(problems() if found is None else found))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the report; the exit status is :func:`status`: 0 ready, 1 not ready, 3 CPU only (module doc)."""
    import argparse

    argparse.ArgumentParser(prog="volta-train env", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    found = problems()
    print(report(found))
    return status(found)


if __name__ == "__main__":
    raise SystemExit(main())

"""The test kernels of tests/kernels/: the mma probe of the compile / cache / launch pipeline, and the m8n8k4 fragment
layout probe of csrc/mma_sm70.cuh. They are not shipped (lab/smem_conflicts.py uses the mma probe as its baseline)."""

from __future__ import annotations

import ctypes
from pathlib import Path

from volta_train.kernels.variants import KernelVariant

KERNELS_DIR = Path(__file__).resolve().parents[1] / "kernels"

PROBE_WARPS_PER_BLOCK = 2
PROBE_THREADS = 32 * PROBE_WARPS_PER_BLOCK
PROBE_SMEM_BYTES = PROBE_WARPS_PER_BLOCK * 4 * 64 * 4  # 4 quad-pair tiles of 8x8 fp32 per warp
PROBE_VARIANT = KernelVariant(
    name="probe_mma",
    sources=("probe_mma.cu",),
    name_expressions=(f"volta_probe_mma_kernel<{PROBE_WARPS_PER_BLOCK}>",),
    exports_geometry=False,
    source_dir=KERNELS_DIR,
    meta={"warps_per_block": PROBE_WARPS_PER_BLOCK, "threads": PROBE_THREADS},
)

MMA_LAYOUT_PROBE = KernelVariant(
    name="mma_layout_probe",
    sources=("mma_layout_probe.cu",),
    name_expressions=("mma_layout_probe_kernel",),
    exports_geometry=False,
    source_dir=KERNELS_DIR,
    meta={"threads": 32},
)


class ProbeParams(ctypes.Structure):
    """ctypes mirror of ``ProbeParams`` in tests/kernels/probe_mma.cu, passed by value."""

    _fields_ = [
        ("a", ctypes.c_void_p),
        ("b", ctypes.c_void_p),
        ("c", ctypes.c_void_p),
        ("d", ctypes.c_void_p),
        ("num_warps", ctypes.c_int),
        ("alpha", ctypes.c_float),
    ]

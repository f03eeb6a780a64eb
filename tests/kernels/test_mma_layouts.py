"""The m8n8k4 fragment layouts written in csrc/mma_sm70.cuh, checked on a GPU for all four variants the
kernels use (A row-major; B col- or row-major; fp32 or fp16 accumulation)."""

from __future__ import annotations

import pytest
import torch

from volta_train.kernels import driver

from probes import MMA_LAYOUT_PROBE as PROBE

pytestmark = pytest.mark.gpu


def test_fragment_layouts_of_all_variants():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    major, minor = torch.cuda.get_device_capability()
    kernel = driver.load_function(PROBE.compile(10 * major + minor), "mma_layout_probe_kernel", torch.device("cuda"))
    a = torch.randint(-4, 5, (4, 8, 4), device="cuda").half()  # small integers: every product exact in fp16
    b = torch.randint(-4, 5, (4, 4, 8), device="cuda").half()
    d = torch.full((4, 4, 8, 8), float("nan"), device="cuda")
    kernel.launch(1, 32, 0, [a, b, d])
    torch.cuda.synchronize()
    expected = torch.matmul(a.double(), b.double())
    names = ["row.col f32", "row.row f32", "row.col f16", "row.row f16"]
    for variant, name in enumerate(names):
        assert torch.equal(d[variant].double(), expected), f"{name}: layout formula wrong\n{d[variant]}\n{expected}"

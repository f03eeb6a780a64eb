"""Caps every Python process that starts with this directory on PYTHONPATH at VOLTA_LAB_MEM_GB GiB of its GPU
(torch.cuda.set_per_process_memory_fraction), as a smaller card would: lab/gpu_checks/recipe_long_context.sh runs
the recipes unchanged under it. Nothing happens without the variable.

The cap is set right after the process initialises CUDA (torch.cuda._lazy_init, which every first CUDA use goes
through), on the device the process uses (LOCAL_RANK under accelerate launch), so it never initialises CUDA itself:
the recipes' allocator settings (PYTORCH_CUDA_ALLOC_CONF, set before CUDA starts) still take effect."""

import os

_GB = os.environ.get("VOLTA_LAB_MEM_GB")

if _GB:
    import torch

    _original_lazy_init = torch.cuda._lazy_init
    _applied = []

    def _lazy_init_with_cap():
        _original_lazy_init()
        if _applied:
            return
        _applied.append(True)
        device = int(os.environ.get("LOCAL_RANK", "0"))
        total = torch.cuda.get_device_properties(device).total_memory
        fraction = min(1.0, float(_GB) * 2**30 / total)
        torch.cuda.set_per_process_memory_fraction(fraction, device)
        print(f"[memory_cap] cuda:{device} capped at {float(_GB):g} GiB ({fraction:.3f} of {total / 2**30:.1f} GiB)",
              flush=True)

    torch.cuda._lazy_init = _lazy_init_with_cap

"""One backward call per head_dim for Nsight Compute (lab/gpu_checks/bwd_check.sh): B*N = 16384, H = 2048/d,
N = 4096, full attention, fp32 accumulation; a warm-up call first so that compilation is not profiled."""
import sys

import torch

import volta_train

d = int(sys.argv[1])
torch.manual_seed(0)
q, k, v = (torch.randn(4, 4096, 2048 // d, d, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
for _ in range(2):
    out = volta_train.flash_attn_func(q, k, v, bwd_accum="fp32")
    out.backward(torch.randn_like(out))
torch.cuda.synchronize()

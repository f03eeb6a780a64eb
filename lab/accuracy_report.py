#!/usr/bin/env python3
"""Accuracy of the Volta kernel against float64, next to PyTorch's own fp16 attention on the same inputs.

    python lab/accuracy_report.py [--out DIR]

For each shape: ||out - ref|| / ||ref|| of the kernel with fp32 and fp16 accumulation and of PyTorch's fp16
SDPA (explicit bottom-right mask), and the log-sum-exp error. Fresh random inputs (N(0, 1)), fp16. Prints a
markdown table and writes accuracy_fwd.md to --out. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from volta_train.options import AttentionOptions
from volta_train.kernels import launch
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))  # the float64 oracles
from oracles import naive_attention, visible_mask

SHAPES = [  # batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, causal
    (4, 1024, 1024, 8, 8, 64, False),
    (4, 1024, 1024, 8, 8, 64, True),
    (2, 2048, 2048, 8, 2, 128, False),
    (2, 2048, 2048, 8, 2, 128, True),
    (1, 4096, 4096, 4, 4, 64, True),
    (2, 333, 1000, 6, 3, 96, False),
    (2, 1000, 333, 4, 1, 80, True),
    (8, 1, 2048, 8, 1, 128, True),
]


def rel(a, b, rows):
    a, b = a.double()[rows], b.double()[rows]
    return ((a - b).norm() / b.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = parser.parse_args()
    lines = ["| B | Nq | Nk | H/Hkv | D | causal | kernel fp32-acc | kernel fp16-acc | PyTorch fp16 | ratio fp32/PyTorch "
             "| lse rel err (fp32-acc) |", "|" + "---|" * 11]
    for b, sq, sk, h, hk, d, causal in SHAPES:
        q = torch.randn(b, sq, h, d, device="cuda").half()
        k = torch.randn(b, sk, hk, d, device="cuda").half()
        v = torch.randn(b, sk, hk, d, device="cuda").half()
        ref, ref_lse = naive_attention(q, k, v, causal=causal)
        rows = ~torch.isinf(ref_lse).transpose(1, 2)
        params = AttentionOptions(softmax_scale=d**-0.5, causal=causal)
        errors = {}
        for accum in ("fp32", "fp16"):
            out, lse = launch.forward(q, k, v, None, None, sq, sk, dataclasses.replace(params, accum=accum), None)
            errors[accum] = rel(out, ref, rows)
            if accum == "fp32":
                finite = ~torch.isinf(ref_lse)
                lse_err = ((lse.double()[finite] - ref_lse[finite]).norm() / ref_lse[finite].norm()).item()
        group = h // hk
        mask = visible_mask(sq, sk, causal, device="cuda")
        torch_out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.repeat_interleave(group, 2).transpose(1, 2), v.repeat_interleave(group, 2).transpose(1, 2),
            attn_mask=mask).transpose(1, 2)
        torch_err = rel(torch_out, ref, rows)
        lines.append(f"| {b} | {sq} | {sk} | {h}/{hk} | {d} | {causal} | {errors['fp32']:.2e} | {errors['fp16']:.2e} | "
                     f"{torch_err:.2e} | {errors['fp32'] / torch_err:.2f} | {lse_err:.1e} |")
    table = "\n".join([f"device: {torch.cuda.get_device_name()}; errors are ||out - ref|| / ||ref|| against float64", ""] + lines)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "accuracy_fwd.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()

"""lab/long_context_probe.py --smoke on the CPU (the search, the features, the table and JSON), and its memory
model's arithmetic."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _probe():
    spec = importlib.util.spec_from_file_location("long_context_probe", ROOT / "lab" / "long_context_probe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke_and_memory_model(tmp_path):
    probe = _probe()
    summary = probe.main(["--smoke", "--variants", "baseline,tiled+offload", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "long_context_probe.json").read_text())
    assert [r["variant"] for r in saved["results"]] == ["baseline", "tiled+offload"]
    assert all(r["longest"] == 512 and r["first_fail"] is None for r in summary["results"])
    assert summary["results"][1]["offloaded_bytes"] > 0
    assert "| tiled+offload | 512 |" in (tmp_path / "long_context_probe.md").read_text()
    shape = probe.model_shape("llama1b", 128256)
    assert abs(shape["parameters"] - 1.2358e9) < 1e6  # Llama-3.2-1B with tied embeddings
    assert probe.predicted_max_tokens(shape, 32, True, True) > probe.predicted_max_tokens(shape, 32, False, False)


def test_memory_model_terms():
    """The per-token terms are the tensors lab/memory_inventory.py finds alive at each block's backward peak (for
    Llama-3.2-1B's widths: h 2048, key/value 512, MLP 8192, 32 heads of 64), and the predictions bracket or miss the
    measured 32 GiB lengths of docs/long_context.md by what the docs say."""
    probe = _probe()
    shape = probe.model_shape("llama1b", 128256)
    h, kv, inter, heads, d = 2048, 512, 8192, 32, 64
    amp, half = probe.variant_memory(probe.parse_variant("baseline")), \
        probe.variant_memory(probe.parse_variant("tiled+offload+optim_offload"))
    base = probe.memory_moments(shape, False, False, **amp)
    tiled = probe.memory_moments(shape, True, True, **amp)
    host = probe.memory_moments(shape, True, True, **half)
    attention = 4 * h + 3 * 2 * h + (2 * h + 4 * kv + 2 * h + 4 * heads) + 4 * h + 4 * h
    # checkpoints of the 16 blocks' inputs (fp32), the incoming gradient, what the block saved, the MLP's backward
    assert base["backward, last block"]["bytes_per_token"] == \
        16 * 4 * h + 4 * h + attention + 2 * 2 * h + 12 * inter + 8 * d + 16
    # offload: three inputs on the GPU; tiled: the MLP input's gradient and the norm's backward temporaries
    assert tiled["backward, first block"]["bytes_per_token"] == 3 * 4 * h + 4 * h + attention + 12 * h + 8 * d + 16
    # 16-bit model: 16-bit inputs and gradient, fp32 norm upcasts
    assert host["backward, first block"]["bytes_per_token"] == \
        3 * 2 * h + 2 * h + (8 * h + 2 * h + 4 * kv + 2 * h + 4 * heads + 4 * h) + 20 * h + 4 * d + 16
    # CPU inventory figures (lab/memory_inventory.py, 1280 tokens): 162,448, 80,528, 80,268 bytes per token beyond
    # the checkpointed inputs
    assert base["backward, last block"]["bytes_per_token"] - 16 * 4 * h == 162448
    assert tiled["backward, first block"]["bytes_per_token"] - 3 * 4 * h == 80528
    assert abs(host["backward, first block"]["bytes_per_token"] - 3 * 2 * h - 80268) <= 16  # ids: 8 or 16 bytes
    # the fixed part of the baseline's last block: fp32 weights + AdamW, the head's fp32 gradient, the down
    # projection's gradient, autocast's fp16 copies of the block's other weights, 1 GiB allocator overhead
    linear = shape["layer_linear_parameters"]
    assert base["backward, last block"]["fixed"] == 12 * shape["parameters"] + 4 * 128256 * h + 4 * h * inter \
        + 2 * (linear - h * inter) + 2**30
    predicted = {v: probe.predicted_max_tokens(shape, 32, f["tiled"], f["offload"], **probe.variant_memory(f))
                 for v, f in ((v, probe.parse_variant(v)) for v in probe.VARIANTS)}
    assert 57344 <= predicted["baseline"] < 65536  # measured: 57,344 trains, 65,536 fails
    assert predicted["tiled+offload"] == 128000  # measured 114,688 / 122,880: 4% over the first failing
    assert predicted["tiled+offload+optim_offload"] == 306176  # measured 311,296 / 327,680: 1.6% under
    # lean norm: the block's peak moves to attention's backward (lab/memory_inventory.py --lean-norm: 49,676 bytes
    # per token beyond the checkpointed inputs at Llama-3.2-1B's widths in a 16-bit model, 62,220 under autocast)
    for variant, amp, per_token in (("tiled+offload+optim_offload+lean_norm", False, 49676),
                                    ("tiled+offload+lean_norm", True, 62220)):
        f = probe.parse_variant(variant)
        work = probe._layer_working_set(shape, True, amp, lean_norm=True)
        small = 2 * (4 if amp else 2) * 64 + 16  # rotary cos and sin, ids and targets
        assert sum(work.values()) + small - 4 == per_token  # the inventory's rsqrt row scale (4 bytes) aside
        lean = probe.predicted_max_tokens(shape, 32, True, True, **probe.variant_memory(f))
        plain = probe.parse_variant(variant.removesuffix("+lean_norm"))
        assert lean > probe.predicted_max_tokens(shape, 32, True, True, **probe.variant_memory(plain))


def test_smoke_optim_offload(tmp_path):
    """The optim_offload variants on the CPU: bf16 weights, AdamW state in host memory, every probe trains."""
    probe = _probe()
    summary = probe.main(["--smoke", "--variants",
                          "optim_offload,tiled+offload+optim_offload,tiled+offload+optim_offload+lean_norm",
                          "--out", str(tmp_path)])
    for r in summary["results"]:
        assert r["longest"] == 512 and r["first_fail"] is None, r
        assert r["optim_offload"] and r["weights_dtype"] == "bfloat16" and r["skipped_steps"] == 0
        assert all(p["status"] == "ok" and 5 < p["loss"] < 7 for p in r["probes"])  # ~log(320) = 5.77
        # master weights + their gradients + two moments (fp32) and the bf16 staging: 18 bytes per parameter (and
        # AdamW's step counts, 4 bytes per tensor)
        assert 0 < r["host_optimizer_bytes"] - 18 * summary["shape"]["parameters"] < 1024
    assert summary["results"][1]["offloaded_bytes"] > 0
    assert "| tiled+offload+optim_offload | 512 |" in (tmp_path / "long_context_probe.md").read_text()
    probe.main(["--replot", str(tmp_path / "both.png"), str(tmp_path / "long_context_probe.json"),
                str(tmp_path / "long_context_probe.json")])
    assert (tmp_path / "both.png").stat().st_size > 0


def test_host_adamw_step_is_adamw_on_the_master_weights():
    """HostAdamW: the step equals torch's AdamW on fp32 weights given the 16-bit gradients; the model gets the
    updated weights in 16 bits; fp16 gradients are unscaled, and an overflow skips the step and halves the scale."""
    import torch

    probe = _probe()
    for dtype in (torch.bfloat16, torch.float16):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))
        reference = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
        host = probe.HostAdamW(model, dtype, lr=1e-2, clip=1e9)
        assert all(p.dtype == dtype for p in model.parameters())
        optimizer = torch.optim.AdamW(reference, lr=1e-2)
        for _ in range(3):
            grads = [torch.randn_like(p) * 1e-3 for p in reference]  # x 2^16 stays finite in fp16
            for p, g in zip(model.parameters(), grads):
                p.grad = (g * host.scale).to(dtype)
            for p, g in zip(reference, grads):
                p.grad = (g * host.scale).to(dtype).double().div(host.scale).float()
            assert host.step()
            optimizer.step()
            for m, r, p in zip(host.master, reference, model.parameters()):
                torch.testing.assert_close(m, r.detach(), rtol=1e-6, atol=1e-7)
                assert torch.equal(p.detach(), m.to(dtype))
                assert p.grad is None
        if dtype == torch.float16:
            scale = host.scale
            before = [m.clone() for m in host.master]
            for p in model.parameters():
                p.grad = torch.full_like(p, float("inf"))
            assert not host.step() and host.scale == scale / 2 and host.skipped == 1
            assert all(torch.equal(a, b) for a, b in zip(before, host.master))


def test_variants_and_memory_model_for_optim_offload():
    import pytest

    probe = _probe()
    assert probe.parse_variant("baseline") == dict.fromkeys(probe.FEATURES, False)
    assert probe.parse_variant("tiled+offload+optim_offload+lean_norm") == dict.fromkeys(probe.FEATURES, True)
    for bad in ("offload+tiled", "tiled+tiled", "zero", "", "baseline+tiled"):
        with pytest.raises(ValueError, match="accepted: baseline"):
            probe.parse_variant(bad)
    shape = probe.model_shape("llama1b", 128256)
    plain = probe.memory_model(shape, 1000, True, True, **probe.variant_memory(probe.parse_variant("tiled+offload")))
    host = probe.memory_model(shape, 1000, True, True,
                              **probe.variant_memory(probe.parse_variant("tiled+offload+optim_offload")))
    # 12 bytes per parameter leave the GPU (the fixed parts differ by that and the fp32 gradients' and fp16 weight
    # copies' share); the 16-bit residual stream halves the checkpoints and the gradient, the norms stay fp32
    assert plain["moments"]["backward, embedding"]["fixed"] - host["moments"]["backward, embedding"]["fixed"] == \
        12 * shape["parameters"] + 2 * 2 * 128256 * 2048
    assert plain["moments"]["backward, first block"]["bytes_per_token"] - \
        host["moments"]["backward, first block"]["bytes_per_token"] == 2048 * 6 + 4 * 64

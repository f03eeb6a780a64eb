"""Padded query positions of the padding route hold what eager attention writes there (outputs and gradients),
against transformers' own eager mask (masking_utils.eager_mask) and an eager softmax in float64."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")
masking_utils = pytest.importorskip("transformers.masking_utils")
if not hasattr(masking_utils, "eager_mask"):
    pytest.skip("transformers without masking_utils.eager_mask", allow_module_level=True)

from volta_train.integrations import hf  # noqa: E402
from volta_train.integrations.hf import padded_rows  # noqa: E402

BATCH, SEQ, HEADS, HEADS_KV, DIM = 3, 13, 4, 2, 8
WINDOW = 4


def two_d_mask(padding: str) -> torch.Tensor:
    """Row 0 pads 3 tokens, row 1 none, row 2 pads 8 (more than the window: some padded rows see no key)."""
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    for row, pads in ((0, 3), (2, 8)):
        if padding == "left":
            mask[row, :pads] = 0
        else:
            mask[row, SEQ - pads:] = 0
    return mask


def mask_function(causal: bool, window: int | None):
    base = masking_utils.causal_mask_function if causal else masking_utils.bidirectional_mask_function
    if window is None:
        return base
    overlay = (masking_utils.sliding_window_overlay if causal
               else masking_utils.sliding_window_bidirectional_overlay)(window)
    return masking_utils.and_masks(base, overlay)


def eager(q, k, v, additive, scale, softcap=None, sinks=None):
    """transformers' eager attention in float64: q [b, h, sq, d], additive [b, 1, sq, sk] -> [b, sq, h, dv]."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores + additive
    if sinks is not None:
        sink = sinks.reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v).transpose(1, 2)


def module(causal: bool) -> SimpleNamespace:
    return SimpleNamespace(config=SimpleNamespace(model_type="llama"), training=False, is_cross_attention=False,
                           is_causal=causal)


def run_both(padding, causal, window, dtype=torch.float64, value_dim=DIM, softcap=None, sinks=False, seed=0,
             device="cpu"):
    torch.manual_seed(seed)
    q = torch.randn(BATCH, HEADS, SEQ, DIM).to(device, dtype).requires_grad_()
    k = torch.randn(BATCH, HEADS_KV, SEQ, DIM).to(device, dtype).requires_grad_()
    v = torch.randn(BATCH, HEADS_KV, SEQ, value_dim).to(device, dtype).requires_grad_()
    # sinks reach the API as fp32 (hf_attention_forward's cast): fp32-exact values keep the float64 comparison tight
    s_aux = torch.randn(HEADS).to(device, dtype).requires_grad_() if sinks else None
    grad_out = torch.randn(BATCH, SEQ, HEADS, value_dim, dtype=torch.float64).to(device)
    mask, function, scale = two_d_mask(padding).to(device), mask_function(causal, window), DIM ** -0.5
    additive = masking_utils.eager_mask(BATCH, q_length=SEQ, kv_length=SEQ, mask_function=function,
                                        attention_mask=mask.bool(), dtype=torch.float64, device=device)
    ours = hf.padding_mask(BATCH, SEQ, 0, mask_function=function, attention_mask=mask, q_length=SEQ, q_offset=0)
    kwargs = dict(scaling=scale, softcap=softcap, s_aux=s_aux)
    out, _ = hf.hf_attention_forward(module(causal), q, k, v, ours, **kwargs)
    inputs = [t for t in (q, k, v, s_aux) if t is not None]
    grads = torch.autograd.grad((out.double() * grad_out).sum(), inputs)
    ref_inputs = [t.detach().double().requires_grad_() for t in inputs]
    ref = eager(*ref_inputs[:3], additive, scale, softcap, ref_inputs[3] if sinks else None)
    ref_grads = torch.autograd.grad((ref * grad_out).sum(), ref_inputs)
    return mask.bool(), out.double(), ref, grads, ref_grads


@pytest.mark.parametrize("window", [None, WINDOW])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("padding", ["left", "right"])
def test_padded_rows_are_eagers(padding, causal, window):
    valid, out, ref, grads, ref_grads = run_both(padding, causal, window)
    # the padded rows are not zero and include rows that see no key (uniform weights in eager)
    assert out[~valid].abs().amax() > 0.1
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-10, atol=1e-10)


def test_padded_rows_with_gqa_softcap_sinks_and_value_head_dim():
    valid, out, ref, grads, ref_grads = run_both("right", True, WINDOW, value_dim=12, softcap=2.5, sinks=True, seed=1)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for grad, ref_grad in zip(grads[:3], ref_grads[:3]):
        torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(grads[3].double(), ref_grads[3], rtol=1e-6, atol=1e-6)  # through the fp32 cast


def test_padded_rows_fp32_within_fp32_rounding():
    valid, out, ref, grads, ref_grads = run_both("right", True, WINDOW, dtype=torch.float32, seed=2)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-5, atol=1e-5)


def test_padded_rows_chunked(monkeypatch):
    """Several chunks per batch row give the same rows as one."""
    whole = run_both("left", False, None)[1]
    monkeypatch.setattr(padded_rows, "SCORES_PER_CHUNK", HEADS * SEQ * 2)  # two rows per chunk
    torch.testing.assert_close(run_both("left", False, None)[1], whole, rtol=1e-12, atol=1e-12)


def test_no_padding_leaves_the_dense_route():
    """Without padding the mask function gives no mask, and the padded-row path is not entered."""
    calls = []
    original = padded_rows.fill
    padded_rows.fill = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        q = torch.randn(2, HEADS, SEQ, DIM)
        mask = hf.padding_mask(2, SEQ, 0, mask_function=masking_utils.causal_mask_function,
                               attention_mask=torch.ones(2, SEQ, dtype=torch.long), q_length=SEQ, q_offset=0)
        assert mask is None
        hf.hf_attention_forward(module(True), q, q[:, :HEADS_KV], q[:, :HEADS_KV], mask, scaling=0.3)
    finally:
        padded_rows.fill = original
    assert not calls


def test_padded_rows_under_autocast():
    """Under autocast the varlen output has autocast's dtype; the padded rows are computed in fp32 and join it."""
    mask = two_d_mask("right")
    function = mask_function(True, None)
    ours = hf.padding_mask(BATCH, SEQ, 0, mask_function=function, attention_mask=mask, q_length=SEQ, q_offset=0)
    torch.manual_seed(3)
    q, k, v = torch.randn(BATCH, HEADS, SEQ, DIM), torch.randn(BATCH, HEADS_KV, SEQ, DIM), torch.randn(BATCH, HEADS_KV, SEQ, DIM)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = hf.hf_attention_forward(module(True), q, k, v, ours, scaling=DIM ** -0.5)
    additive = masking_utils.eager_mask(BATCH, q_length=SEQ, kv_length=SEQ, mask_function=function,
                                        attention_mask=mask.bool(), dtype=torch.float64)
    ref = eager(q.double(), k.double(), v.double(), additive, DIM ** -0.5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("padding", ["left", "right"])
def test_padded_rows_fp16_on_the_gpu(padding):
    """fp16 on a GPU: the real rows from the kernel, the padded rows in fp32 PyTorch, both within fp16 rounding."""
    valid, out, ref, grads, ref_grads = run_both(padding, True, WINDOW, dtype=torch.float16, softcap=2.5, seed=4,
                                                 device="cuda")
    torch.testing.assert_close(out, ref, rtol=5e-3, atol=5e-3)
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-2, atol=1e-2)


def test_padded_rows_default_scale():
    """No scaling kwarg and no family default: flash-attn's head_dim ** -0.5, for the padded rows too."""
    mask = two_d_mask("right")
    ours = hf.padding_mask(BATCH, SEQ, 0, mask_function=masking_utils.causal_mask_function, attention_mask=mask,
                           q_length=SEQ, q_offset=0)
    torch.manual_seed(5)
    q, k, v = (torch.randn(BATCH, heads, SEQ, DIM, dtype=torch.float64) for heads in (HEADS, HEADS_KV, HEADS_KV))
    out, _ = hf.hf_attention_forward(module(True), q, k, v, ours)
    additive = masking_utils.eager_mask(BATCH, q_length=SEQ, kv_length=SEQ, mask_function=masking_utils.causal_mask_function,
                                        attention_mask=mask.bool(), dtype=torch.float64)
    torch.testing.assert_close(out, eager(q, k, v, additive, DIM ** -0.5), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("window", [None, WINDOW])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("padding", ["left", "right"])
def test_padded_rows_by_what_they_see(padding, causal, window, sinks, monkeypatch):
    """Rows that see every token key run one varlen call, rows that see none (without gradients) the mean of v, and
    only the rest the dense PyTorch path; every row equals eager's, with and without gradients."""
    dense, original = [], padded_rows._rows
    monkeypatch.setattr(padded_rows, "_rows", lambda *a: dense.append(a[0].shape[0]) or original(*a))
    valid, out, ref, grads, ref_grads = run_both(padding, causal, window, sinks=sinks, seed=5)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for grad, ref_grad in zip(grads[:3], ref_grads[:3]):
        torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-10, atol=1e-10)
    with_grad = sum(dense)
    dense.clear()
    with torch.no_grad():
        _, out_no_grad, ref_no_grad, *_ = run_both_forward(padding, causal, window, sinks=sinks, seed=5)
    torch.testing.assert_close(out_no_grad, ref_no_grad, rtol=1e-10, atol=1e-10)
    padded_count = int((~valid).sum())
    if window is None and (padding == "right" or not causal):
        assert with_grad == 0 and sum(dense) == 0  # every padded row sees every token key: the varlen call
    if window is None and padding == "left" and causal:
        assert with_grad >= padded_count and sum(dense) == 0  # no key: dense with gradients, the mean without


def run_both_forward(padding, causal, window, sinks=False, seed=0):
    """run_both's outputs without autograd (the inference path of the padded rows)."""
    torch.manual_seed(seed)
    q = torch.randn(BATCH, HEADS, SEQ, DIM, dtype=torch.float64)
    k = torch.randn(BATCH, HEADS_KV, SEQ, DIM, dtype=torch.float64)
    v = torch.randn(BATCH, HEADS_KV, SEQ, DIM, dtype=torch.float64)
    s_aux = torch.randn(HEADS).double() if sinks else None  # fp32-exact: the API takes sinks in fp32
    mask, function, scale = two_d_mask(padding), mask_function(causal, window), DIM ** -0.5
    additive = masking_utils.eager_mask(BATCH, q_length=SEQ, kv_length=SEQ, mask_function=function,
                                        attention_mask=mask.bool(), dtype=torch.float64)
    ours = hf.padding_mask(BATCH, SEQ, 0, mask_function=function, attention_mask=mask, q_length=SEQ, q_offset=0)
    out, _ = hf.hf_attention_forward(module(causal), q, k, v, ours, scaling=scale, s_aux=s_aux)
    return mask.bool(), out.double(), eager(q, k, v, additive, scale, None, s_aux)

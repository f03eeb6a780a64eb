"""The patched-vs-stock comparison of the HF integration's tests (tests/hf/test_patch_hf*.py): the same tiny model's
logits and parameter gradients before and after volta_train.patch(), with spies on the API entry points that prove the
attention ran through volta_train. The inputs: a batch of BATCH x SEQ random tokens, rows padded to LENGTHS."""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from unittest import mock

import torch

import volta_train

VOCAB, BATCH, SEQ = 97, 3, 9
LENGTHS = (SEQ, 6, 3)  # tokens per row when padded
RTOL = 1e-5  # relative to the largest magnitude of the reference

# Key biases' gradients are zero in exact arithmetic (softmax ignores a per-query constant): both sides rounding noise.
KEY_BIAS = re.compile(r"(\.key|\.k_lin)\.bias$")  # encoders; with rotary embeddings (k_proj) it matters
GRAD_SCALES = ("tensor", "model")


def tokens(batch: int = BATCH, seqlen: int = SEQ) -> torch.Tensor:
    return torch.randint(2, VOCAB, (batch, seqlen), generator=torch.Generator().manual_seed(1))


def padding_mask(padding: str, batch: int = BATCH, seqlen: int = SEQ) -> torch.Tensor | None:
    """None for "none"; else rows of LENGTHS real tokens, at the start ("right" padding) or the end ("left")."""
    if padding == "none":
        return None
    mask = torch.zeros(batch, seqlen, dtype=torch.long)
    for row, length in enumerate(LENGTHS[:batch]):
        if padding == "right":
            mask[row, :length] = 1
        else:
            mask[row, seqlen - length:] = 1
    return mask


@contextlib.contextmanager
def spies():
    """Wrap the public volta_train entry points the integration must call: yields (dense, varlen) mocks."""
    api = volta_train.interface  # what the integration calls (not the package root)
    with mock.patch.object(api, "flash_attn_func", wraps=api.flash_attn_func) as dense, \
            mock.patch.object(api, "flash_attn_varlen_func", wraps=api.flash_attn_varlen_func) as varlen:
        yield dense, varlen


def run(model, ids, mask, forward=None, **kwargs):
    """Logits and parameter gradients of a random projection of the logits at the non-padded positions only
    (forward: the model or a wrapper of it), in float32 whatever the model's dtype, on the model's device."""
    model.zero_grad(set_to_none=True)
    logits = (model if forward is None else forward)(ids, attention_mask=mask, **kwargs).logits
    keep = torch.ones(ids.shape, dtype=torch.bool, device=ids.device) if mask is None else mask.bool()
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(2)).to(logits.device)
    (logits.float() * weights)[keep].sum().backward()
    grads = {name: p.grad.detach().float().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return logits.detach().float()[keep], grads


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str = "", rtol: float = RTOL) -> None:
    """Equal up to rtol relative to the largest magnitude in `expected` (fp32 sums in a different order)."""
    scale = expected.abs().max().clamp_min(1e-6)
    error = (actual - expected).abs().max()
    assert error <= rtol * scale, f"{what}: max |difference| {error:.3g} > {rtol:g} x max |expected| {scale:.3g}"


def assert_grads_close(grads: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], rtol: float = RTOL,
                       scale: str = "tensor") -> None:
    """The same parameters' gradients, each equal up to rtol relative to its own largest magnitude (scale="tensor";
    a key bias's, rounding noise on both sides, need only stay within rtol x the model's largest gradient) or relative
    to the model's largest gradient (scale="model")."""
    if scale not in GRAD_SCALES:
        raise ValueError(f"scale={scale!r}: accepted {', '.join(GRAD_SCALES)}")
    assert grads.keys() == expected.keys()
    largest = max(g.abs().max() for g in expected.values())
    for name, reference in expected.items():
        if scale == "model":
            error = (grads[name] - reference).abs().max()
            assert error <= rtol * largest, \
                f"gradient of {name}: max |difference| {error:.3g} > {rtol:g} x {largest:.3g}"
        elif KEY_BIAS.search(name):
            assert max(grads[name].abs().max(), reference.abs().max()) <= rtol * largest, name
        else:
            assert_close(grads[name], reference, f"gradient of {name}", rtol)


@dataclass
class Patched:
    """One model run stock, then patched: what patch() returned, both runs' logits and gradients, and the spies of the
    patched run."""

    returned: object
    ref_logits: torch.Tensor
    ref_grads: dict[str, torch.Tensor]
    logits: torch.Tensor
    grads: dict[str, torch.Tensor]
    dense: mock.MagicMock
    varlen: mock.MagicMock


def run_stock_then_patched(model, ids, mask) -> Patched:
    """:func:`run` on ``model`` as built, then volta_train.patch(model) and :func:`run` again under :func:`spies`."""
    ref_logits, ref_grads = run(model, ids, mask)
    returned = volta_train.patch(model)
    with spies() as (dense, varlen):
        logits, grads = run(model, ids, mask)
    return Patched(returned, ref_logits, ref_grads, logits, grads, dense, varlen)

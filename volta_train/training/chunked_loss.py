"""Linear + cross-entropy over chunks of tokens: the causal-LM loss without a ``[tokens, vocab]`` tensor.

The stock loss builds the logits of every token (``[tokens, vocab]``, in fp32 for the softmax) and
autograd keeps them, or their softmax, until the backward, which builds a gradient of the same size.
At 128k words that is about 1 MiB per token. :func:`linear_cross_entropy` instead walks the tokens
in chunks; per chunk it computes the logits, their log-sum-exp (fp32), the token losses, and, in
the same pass, the gradient of the summed loss with respect to the chunk's hidden states and its
share of the gradient with respect to the head's weight (and bias). Only those gradients are kept
(``[tokens, hidden]`` and ``[vocab, hidden]``, the sizes of the inputs); the backward scales them by
the incoming gradient (mean reduction, gradient accumulation, loss scale) and hands them on.
Pure PyTorch: runs wherever a matmul does (V100 included, fp16, no Triton).

Precision. The logits are computed in the dtype a matmul would use there: the autocast dtype
under ``torch.autocast`` (fp16 on a V100), else the inputs' dtype; the log-sum-exp, the softmax and
the loss are fp32 (fp64 for fp64 inputs), as transformers' loss upcasts the logits. The gradient of
the logits (fp32) goes into two more matmuls of that same dtype, as autograd's would: in fp16 the
products are accumulated in fp32 (``torch.mm(..., out_dtype=torch.float32)`` where the build has
it, CUDA; elsewhere the fp16 operand is scaled by a power of two chosen so that nothing can
overflow and the product is unscaled in fp32), so no chunk's partial weight gradient is ever
rounded to fp16 and no overflow can come from the chunking. Gradients come back in the inputs'
dtypes.

Causal LM. :func:`shift_labels` shifts the labels by one *before* anything is chunked, over the
whole sequence, as transformers' ``ForCausalLMLoss`` does (position ``t`` predicts ``labels[t + 1]``;
the last position predicts nothing); ``-100`` marks tokens that are no target (padding, prompts,
document starts of packed rows). :func:`causal_lm_loss_sum` runs a transformers causal LM with its
output head (``get_output_embeddings()``, tied or not) computing this loss instead of logits: the
head is still *called* by the model (so DeepSpeed ZeRO-3 gathers its weight, DDP and Accelerate's
autocast wrap the forward as usual) and receives exactly the hidden states the logits would be
computed from; its weight is the model's own Parameter, so a tied embedding gets the head's
gradient through autograd, added to its own. :func:`supported` says which models qualify (the
logits must not be changed after the head: no soft-capping, no logit scale).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger("volta_train")

IGNORE_INDEX = -100
DEFAULT_CHUNK_MIB = 1024
"""Default budget: a chunk's fp32 logits take at most this many MiB (the chunk holds about twice that). Each chunk
reads and writes the fp32 ``[vocab, hidden]`` weight gradient once, so smaller chunks cost step time
(docs/performance.md, "Loss memory", gives the measured cost)."""

ANY_TOKEN_COUNT = 1 << 30  # more tokens than any batch holds: chunk_size's answer is then the budget's alone

# config attributes of transformers models that change the logits after the head (Gemma-2 soft-capping,
# Cohere's logit_scale, Granite's logits_scaling): the chunked loss would not be the model's loss
_LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


class ChunkedLossError(ValueError):
    """A model or input the chunked loss cannot take (the message says why and what would work)."""


_LAST_BAD_TARGETS: dict[str, Any] = {}


def _bad_targets_message(count: int, vocab: int, ignore_index: int, example: int) -> str:
    return (f"targets: {count} id(s) outside [0, {vocab}) (the head's vocabulary) that are not ignore_index "
            f"({ignore_index}), e.g. {example}")


def describe_bad_targets() -> str | None:
    """Why the last GPU call of :func:`linear_cross_entropy` returned NaN, if its targets were the reason (one host
    synchronisation; for error messages: on a GPU out-of-range targets make the loss and gradients NaN rather than
    stop the host every call to check them). None when they were all in range."""
    bad = _LAST_BAD_TARGETS.get("bad")
    if bad is None or not bool(bad.any()):
        return None
    targets = _LAST_BAD_TARGETS["targets"]
    return _bad_targets_message(int(bad.sum()), _LAST_BAD_TARGETS["vocab"], _LAST_BAD_TARGETS["ignore_index"],
                                int(targets[bad].reshape(-1)[0]))


# --------------------------------------------------------------------------------------------------
# chunk size
# --------------------------------------------------------------------------------------------------


def chunk_size(vocab: int, tokens: int, chunk_tokens: int | None = None, budget_mib: float = DEFAULT_CHUNK_MIB) -> int:
    """Tokens per chunk: ``chunk_tokens`` if given, else as many as keep ``chunk x vocab`` fp32 logits within
    ``budget_mib`` (a multiple of 64 when that is at least 64); never more than ``tokens``."""
    if chunk_tokens is not None:
        if not isinstance(chunk_tokens, int) or isinstance(chunk_tokens, bool) or chunk_tokens < 1:
            raise ChunkedLossError(f"chunk_tokens must be a positive integer (or None: from the memory budget), "
                                   f"got {chunk_tokens!r}")
        return max(1, min(chunk_tokens, tokens))
    if budget_mib <= 0:
        raise ChunkedLossError(f"budget_mib must be positive, got {budget_mib!r}")
    n = int(budget_mib * 2**20) // (4 * max(1, vocab))
    if n >= 64:
        n = n // 64 * 64
    return max(1, min(n, tokens))


# --------------------------------------------------------------------------------------------------
# low-precision matmuls accumulated in fp32
# --------------------------------------------------------------------------------------------------

_HALF = (torch.float16, torch.bfloat16)
_OUT_DTYPE_WORKS: dict[tuple[str, torch.dtype], bool] = {}


def _out_dtype_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``aten::addmm.dtype_out`` (half inputs, fp32 accumulator updated in place) runs and is right here."""
    if device.type != "cuda":
        return False  # CPU builds have no such kernel (torch 2.13)
    key = (str(device), dtype)
    if key not in _OUT_DTYPE_WORKS:
        try:
            # autocast off: under fp16 autocast the fp32 reference product below would be an fp16 one, the check
            # would fail, and every chunk would take the slower scaled path.
            # Needs a CUDA device here (cuda is the only type that passes the test above).
            with torch.autocast("cuda", enabled=False):
                ok = _out_dtype_check(device, dtype)
        except (RuntimeError, NotImplementedError, AttributeError, TypeError):
            ok = False
        _OUT_DTYPE_WORKS[key] = ok
        if not ok:
            logger.info("chunked loss: no fp16->fp32 matmul (aten::mm.dtype_out) on %s for %s: scaled fp16 products "
                        "instead", device, dtype)
    return _OUT_DTYPE_WORKS[key]


def _out_dtype_check(device: torch.device, dtype: torch.dtype) -> bool:
    """One small (add)mm.dtype_out against the fp32 product (call with autocast off)."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(48, 40, device=device, generator=gen).to(dtype)
    b = torch.randn(40, 24, device=device, generator=gen).to(dtype)
    product = a.float() @ b.float()
    acc = torch.randn(48, 24, device=device, generator=gen)
    expected = acc + product
    torch.ops.aten.addmm.dtype_out(acc, a, b, torch.float32, out=acc)
    fresh = torch.full((48, 24), float("nan"), device=device)
    torch.ops.aten.mm.dtype_out(a, b, torch.float32, out=fresh)
    return bool(torch.allclose(acc, expected, rtol=1e-3, atol=1e-3)) and \
        bool(torch.allclose(fresh, product, rtol=1e-3, atol=1e-3))


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, low: torch.dtype, accumulate: bool,
             a_row_bound: torch.Tensor | float | None, mode: str) -> None:
    """``out (+)= a @ b`` with ``out`` fp32/fp64, ``a`` fp32/fp64 and ``b`` already in ``low`` (the matmul dtype).

    ``low`` fp32/fp64: one exact in-place (add)mm. Half ``low``, ``mode`` "out_dtype": half operands, fp32
    accumulation in ``out``. ``mode`` "scaled": ``a`` times a power of two ``s`` is cast to ``low``, the half product
    is divided by ``s`` in fp32; ``s`` keeps ``s * a`` and the product below 32768 given ``a_row_bound`` (an upper
    bound of the rows' absolute sums of ``a``) and ``|b|``'s maximum, and as large as that allows (no underflow of
    small entries of ``a``, the reason for a loss scale).
    """
    if low not in _HALF:
        a = a.to(low)
        if accumulate:
            out.addmm_(a, b)
        else:
            torch.mm(a, b, out=out)
        return
    if mode == "out_dtype":
        a = a.to(low)  # a no-op when the caller cast it already
        if accumulate:
            torch.ops.aten.addmm.dtype_out(out, a, b, torch.float32, out=out)
        else:
            torch.ops.aten.mm.dtype_out(a, b, torch.float32, out=out)
        return
    if low == torch.bfloat16:  # fp32's range: nothing to scale
        part = a.to(low) @ b
        out.add_(part) if accumulate else out.copy_(part)
        return
    limit = 32768.0
    b_max = b.abs().amax().float()
    # a Python bound becomes a device scalar by a fill, not a host-to-device copy (which synchronised every chunk)
    bound = torch.full((), a_row_bound, dtype=torch.float32, device=a.device) if isinstance(a_row_bound, float) else \
        (a_row_bound if a_row_bound is not None else a.abs().sum(1).amax()).to(torch.float32)
    a_max = a.abs().amax().float()
    # the largest power of two with s * max|a| <= limit and s * bound * max|b| <= limit (and within [2^-24, 2^24])
    room = torch.minimum(limit / a_max.clamp_min(1e-30), limit / (bound * b_max).clamp_min(1e-30))
    s = torch.exp2(torch.floor(torch.log2(room)).clamp(-24.0, 24.0))
    part = (a * s).to(low) @ b
    if accumulate:
        out.add_(part.float().div_(s))
    else:
        out.copy_(part).div_(s)


# --------------------------------------------------------------------------------------------------
# the chunked loss
# --------------------------------------------------------------------------------------------------


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    device = hidden.device.type
    if torch.is_autocast_enabled(device) and hidden.dtype in (torch.float32, *_HALF):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _chunked_forward(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                     chunk: int, ignore_index: int, needs: tuple[bool, bool, bool], mode: str,
                     correct: torch.Tensor | None = None):
    """Loss sum and, for the inputs in ``needs``, the gradients of that sum (unscaled; fp32 or fp64).

    ``correct`` (an int64 scalar): incremented by the targets whose logit is the row's largest (eval only).
    """
    low = _compute_dtype(hidden, weight)
    acc_dtype = torch.float64 if low == torch.float64 else torch.float32
    if mode == "auto":
        mode = "out_dtype" if low in _HALF and _out_dtype_works(hidden.device, low) else "scaled"
    vocab, width = weight.shape
    h2 = hidden.reshape(-1, width)
    t1 = targets.reshape(-1)
    n = h2.shape[0]
    need_h, need_w, need_b = needs
    grad_h = torch.zeros(n, width, dtype=acc_dtype, device=hidden.device) if need_h else None
    grad_w = torch.zeros(vocab, width, dtype=acc_dtype, device=weight.device) if need_w else None
    grad_b = torch.zeros(vocab, dtype=acc_dtype, device=weight.device) if need_b else None
    loss = torch.zeros((), dtype=acc_dtype, device=hidden.device)
    with torch.autocast(hidden.device.type, enabled=False):
        w_low = weight.to(low)
        b_low = bias.to(low) if bias is not None else None
        w_bound = None
        if need_h and low == torch.float16 and mode == "scaled":
            w_bound = 2.0  # a row of softmax - one-hot sums to at most 2 in absolute value
        for start in range(0, n, chunk):
            rows = slice(start, min(start + chunk, n))
            h = h2[rows].to(low)
            t = t1[rows]
            valid = t != ignore_index
            safe = torch.where(valid, t, 0).unsqueeze(1)
            logits = F.linear(h, w_low, b_low)
            if logits.dtype != acc_dtype:
                logits32 = logits.to(acc_dtype)
                del logits
            else:
                logits32 = logits
            lse = torch.logsumexp(logits32, dim=1)
            token_loss = lse - logits32.gather(1, safe).squeeze(1)
            loss += torch.where(valid, token_loss, 0.0).sum()
            if correct is not None:
                correct += ((logits32.argmax(1) == t) & valid).sum()
            if not (need_h or need_w or need_b):
                continue
            # d(sum of token losses)/d(logits) = softmax - one-hot, zero for tokens that are no target (their
            # log-sum-exp taken as +inf: exp gives 0 without another pass over the chunk)
            lse = torch.where(valid, lse, torch.inf)
            probs = logits32.sub_(lse.unsqueeze(1)).exp_()
            del logits32
            probs.scatter_add_(1, safe, -valid.to(acc_dtype).unsqueeze(1))
            if need_b:
                grad_b += probs.sum(0)
            if mode == "out_dtype" and (need_h or need_w):
                probs = probs.to(low)  # one cast for both products; the fp32 chunk is freed here
            if need_h:
                _mm_into(grad_h[rows], probs, w_low, low, False, w_bound, mode)
            if need_w:
                _mm_into(grad_w, probs.t(), h, low, True, None, mode)
            del probs
    return loss, grad_h, grad_w, grad_b


class _LinearCrossEntropySum(torch.autograd.Function):
    """Sum over target tokens of ``cross_entropy(hidden @ weight.T + bias, targets)``; gradients made in the forward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk, ignore_index, needs, mode, any_bad):  # noqa: D102
        loss, grad_h, grad_w, grad_b = _chunked_forward(hidden, weight, bias, targets, chunk, ignore_index, needs,
                                                         mode)
        ctx.grads = (grad_h, grad_w, grad_b)
        ctx.any_bad = any_bad
        ctx.shapes = (hidden.shape, hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_output):  # noqa: D102
        if ctx.grads is None:
            raise RuntimeError("linear_cross_entropy: backward ran twice through the same loss (retain_graph); the "
                               "chunked loss keeps its gradients for one backward only: compute the loss again")
        grad_h, grad_w, grad_b = ctx.grads
        ctx.grads = None  # released once handed on; the in-place scaling below reuses their memory
        shape, h_dtype, w_dtype, b_dtype = ctx.shapes
        g = grad_output.detach()
        if ctx.any_bad is not None:  # targets outside the vocabulary (GPU): NaN gradients, as the loss
            g = torch.where(ctx.any_bad, torch.nan, g)
        out_h = grad_h.mul_(g).to(h_dtype).reshape(shape) if grad_h is not None else None
        out_w = grad_w.mul_(g).to(w_dtype) if grad_w is not None else None
        out_b = grad_b.mul_(g).to(b_dtype) if grad_b is not None else None
        return out_h, out_w, out_b, None, None, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         bias: torch.Tensor | None = None, *, reduction: str = "mean", ignore_index: int = IGNORE_INDEX,
                         chunk_tokens: int | None = None, budget_mib: float = DEFAULT_CHUNK_MIB,
                         matmul: str = "auto") -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias).float(), targets, ignore_index=..., reduction=...)`` in chunks.

    ``hidden`` ``[..., H]``, ``weight`` ``[V, H]``, ``bias`` ``[V]`` or None, ``targets`` (int64) of
    ``hidden``'s shape without H: class ids in ``[0, V)`` or ``ignore_index``. Targets are used as given
    (shift causal-LM labels first: :func:`shift_labels`). ``reduction`` "sum" or "mean" (over the
    targets; 0 when there is none, where F.cross_entropy gives nan). ``chunk_tokens``: tokens per
    chunk (default from ``budget_mib``, see :func:`chunk_size`). The returned loss (fp32; fp64 for
    fp64 inputs) takes one backward. ``matmul`` ("auto", "out_dtype", "scaled") picks the fp16
    product's accumulation (for tests). See the module doc.

    A target outside ``[0, V)`` that is not ``ignore_index`` raises :class:`ChunkedLossError` on the CPU; on a GPU,
    where checking would stop the host every call, it makes the loss and every gradient NaN instead, and
    :func:`describe_bad_targets` names it (the recipes' trainer stops on the NaN with that message).
    """
    if reduction not in ("mean", "sum"):
        raise ChunkedLossError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if matmul not in ("auto", "out_dtype", "scaled"):
        raise ChunkedLossError(f"matmul must be 'auto', 'out_dtype' or 'scaled', got {matmul!r}")
    if weight.dim() != 2:
        raise ChunkedLossError(f"weight must be [vocab, hidden], got shape {tuple(weight.shape)}")
    vocab, width = weight.shape
    if hidden.dim() < 1 or hidden.shape[-1] != width:
        raise ChunkedLossError(f"hidden must be [..., {width}] (the weight's width), got shape {tuple(hidden.shape)}")
    if bias is not None and tuple(bias.shape) != (vocab,):
        raise ChunkedLossError(f"bias must be [{vocab}], got shape {tuple(bias.shape)}")
    if targets.shape != hidden.shape[:-1]:
        raise ChunkedLossError(f"targets must have hidden's shape without its last axis, "
                               f"{tuple(hidden.shape[:-1])}, got {tuple(targets.shape)}")
    if targets.dtype != torch.long:
        raise ChunkedLossError(f"targets must be int64 class ids, got {targets.dtype}")
    if not hidden.is_floating_point() or not weight.is_floating_point():
        raise ChunkedLossError(f"hidden and weight must be floating point, got {hidden.dtype} and {weight.dtype}")
    valid = targets != ignore_index
    bad = valid & ((targets < 0) | (targets >= vocab))
    if targets.device.type == "cpu":
        if bool(bad.any()):
            raise ChunkedLossError(_bad_targets_message(int(bad.sum()), vocab, ignore_index, int(targets[bad][0])))
        any_bad = None
    else:
        # on a GPU the check must not stop the host (a synchronisation per step cost GPT-2 small's step 1.3x): the
        # loss and the gradients become NaN instead, which the trainer stops on, naming this (describe_bad_targets)
        any_bad = bad.any()  # (the count and an example are read only for the message: describe_bad_targets)
        _LAST_BAD_TARGETS.update(bad=bad, targets=targets, vocab=vocab, ignore_index=ignore_index)
        targets = torch.where(bad, ignore_index, targets)  # nothing out of range is gathered or scattered
    chunk = chunk_size(vocab, max(1, targets.numel()), chunk_tokens, budget_mib)
    grad = torch.is_grad_enabled()
    needs = (grad and hidden.requires_grad, grad and weight.requires_grad,
             grad and bias is not None and bias.requires_grad)
    if any(needs):
        total = _LinearCrossEntropySum.apply(hidden, weight, bias, targets, chunk, ignore_index, needs, matmul,
                                             any_bad)
    else:
        total = _chunked_forward(hidden, weight, bias, targets, chunk, ignore_index, needs, matmul)[0]
    if any_bad is not None:
        total = torch.where(any_bad, torch.nan, total)
    if reduction == "sum":
        return total
    return total / valid.sum().clamp_min(1).to(total.dtype)


# --------------------------------------------------------------------------------------------------
# transformers causal LMs
# --------------------------------------------------------------------------------------------------


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """``out[:, t] = labels[:, t + 1]``, ``ignore_index`` at the end (what transformers' causal-LM loss does)."""
    out = torch.full_like(labels, ignore_index)
    out[:, :-1] = labels[:, 1:]
    return out


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model inside DDP / a DeepSpeed engine / other ``.module`` wrappers."""
    while not hasattr(model, "get_output_embeddings") and isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


def supported(model: nn.Module) -> tuple[bool, str]:
    """(True, "") when :func:`causal_lm_loss_sum` gives ``model``'s own causal-LM loss, else (False, why)."""
    inner = unwrap(model)
    getter = getattr(inner, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    if not isinstance(head, nn.Linear):
        return False, f"{type(inner).__name__} has no nn.Linear output head (get_output_embeddings)"
    config = getattr(inner, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in _LOGIT_POSTPROCESSING:
        if getattr(text, name, None) is not None:
            return False, f"its config sets {name} (the logits are changed after the head)"
    return True, ""


@contextlib.contextmanager
def _head_computes_loss(head: nn.Linear, targets: torch.Tensor, record: dict, **kwargs: Any) -> Iterator[None]:
    """Within the block, ``head(hidden)`` returns the summed chunked loss of ``hidden`` against ``targets``."""
    def forward(hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[:-1] != targets.shape:
            raise ChunkedLossError(
                f"the output head got hidden states of shape {tuple(hidden.shape)} for targets of shape "
                f"{tuple(targets.shape)}: the model does not compute one logit row per input token here")
        record["calls"] = record.get("calls", 0) + 1
        if "correct" in record:  # evaluation: the loss and the argmax hits, no gradients
            with torch.no_grad():
                chunk = chunk_size(head.weight.shape[0], max(1, targets.numel()), kwargs.get("chunk_tokens"),
                                   kwargs.get("budget_mib", DEFAULT_CHUNK_MIB))
                record["loss"] = _chunked_forward(hidden, head.weight, head.bias, targets, chunk,
                                                  kwargs.get("ignore_index", IGNORE_INDEX), (False, False, False),
                                                  "auto", record["correct"])[0]
                return record["loss"]
        record["loss"] = linear_cross_entropy(hidden, head.weight, targets, head.bias, reduction="sum", **kwargs)
        return record["loss"]

    previous = head.__dict__.get("forward")
    head.forward = forward
    try:
        yield
    finally:
        if previous is None:
            del head.forward
        else:
            head.forward = previous


def resolve(requested: bool, model: nn.Module, chunk_tokens: int | None = None) -> tuple[bool, str]:
    """(use the chunked loss?, one log line saying which loss runs and why) for a recipe's ``chunked_loss`` option."""
    if not requested:
        return False, "loss: the model's own (chunked_loss off: [tokens, vocab] logits are built)"
    ok, why = supported(model)
    if not ok:
        return False, f"loss: the model's own, not chunked: {why}"
    weight = unwrap(model).get_output_embeddings().weight
    vocab = getattr(weight, "ds_shape", weight.shape)[0]  # ZeRO-3 leaves a partitioned weight empty, its shape there
    chunk = chunk_size(vocab, ANY_TOKEN_COUNT, chunk_tokens)
    return True, (f"loss: chunked linear + cross-entropy, chunks of up to {chunk:,} tokens x {vocab:,} words (no whole "
                  "[tokens, vocab] logits)")


def causal_lm_loss_sum(model: nn.Module, inputs: dict[str, torch.Tensor], targets: torch.Tensor, *,
                       chunk_tokens: int | None = None, budget_mib: float = DEFAULT_CHUNK_MIB,
                       ignore_index: int = IGNORE_INDEX,
                       _record: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the token losses, number of targets) of a transformers causal LM on ``inputs``, chunked.

    ``inputs``: the model's keyword inputs without labels (``input_ids``, ``position_ids``,
    ``attention_mask``...); ``targets``: ``[batch, seq]`` already shifted (:func:`shift_labels`).
    ``model`` may be wrapped (DDP, a DeepSpeed engine): it is called as it is, and its output head
    returns the loss in place of the logits (see the module doc).
    """
    ok, why = supported(model)
    if not ok:
        raise ChunkedLossError(f"chunked loss: {why}; turn it off (chunked_loss: false / --no-chunked-loss)")
    head = unwrap(model).get_output_embeddings()
    record: dict = {} if _record is None else _record
    kwargs = dict(inputs)
    kwargs.setdefault("use_cache", False)
    with _head_computes_loss(head, targets, record, chunk_tokens=chunk_tokens, budget_mib=budget_mib,
                             ignore_index=ignore_index):
        out = model(**kwargs)
    logits = out.logits if hasattr(out, "logits") else out[0]
    # what the model returns as logits must be the head's loss, unchanged in value (wrappers such as ZeRO-3's
    # backward hooks may hand on another tensor object of the same value); one comparison of two scalars
    loss = record.get("loss")
    # the same tensor object (no wrapper in between) needs no value comparison: comparing values reads the GPU,
    # which stalls the host between forward and backward on every step
    same = logits is loss
    if record.get("calls") != 1 or not isinstance(logits, torch.Tensor) or logits.shape != () or not (same or \
            bool(torch.isclose(logits.detach().to(loss.dtype), loss.detach(), rtol=0.0, atol=0.0, equal_nan=True))):
        raise ChunkedLossError(
            f"chunked loss: {type(unwrap(model)).__name__} called its output head {record.get('calls', 0)} time(s) "
            "and/or changed what it returned; its logits are not one head call on the last hidden states: turn the "
            "chunked loss off (chunked_loss: false / --no-chunked-loss)")
    return logits, (targets != ignore_index).sum()


def causal_lm_loss(model: nn.Module, batch: dict[str, torch.Tensor], *, chunk_tokens: int | None = None,
                   budget_mib: float = DEFAULT_CHUNK_MIB) -> torch.Tensor:
    """Mean token loss of a causal-LM batch (``labels`` unshifted, as for ``model(**batch).loss``), chunked.

    Equal to transformers' ``model(**batch).loss`` within fp32 rounding (0 instead of nan when no token
    is a target).
    """
    if "labels" not in batch:
        raise ChunkedLossError("causal_lm_loss: the batch has no 'labels'")
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    total, count = causal_lm_loss_sum(model, inputs, shift_labels(batch["labels"]), chunk_tokens=chunk_tokens,
                                      budget_mib=budget_mib)
    return total / count.clamp_min(1).to(total.dtype)


@torch.no_grad()
def causal_lm_eval_sums(model: nn.Module, inputs: dict[str, torch.Tensor], targets: torch.Tensor, *,
                        chunk_tokens: int | None = None,
                        budget_mib: float = DEFAULT_CHUNK_MIB) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss sum, number of targets, targets that are their row's argmax) of shifted ``targets``, chunked, no grad."""
    record: dict = {"correct": torch.zeros((), dtype=torch.long, device=targets.device)}
    total, count = causal_lm_loss_sum(model, inputs, targets, chunk_tokens=chunk_tokens, budget_mib=budget_mib,
                                      _record=record)
    return total, count, record["correct"]

"""``S_dmask``, what flash-attn returns for ``return_attn_probs=True``: unnormalised attention probabilities whose sign carries the dropout mask, a testing aid.

flash-attn 2.8.3 returns, with ``dropout_p > 0``, a ``[batch, heads, round_up(seqlen_q, 128), round_up(seqlen_k, 128)]``
tensor in q's dtype (varlen: ``max_seqlen_q``/``max_seqlen_k``, sequence ``b`` in ``[b, :, :len_q, :len_k]``), and an
empty ``(0,)`` tensor with ``dropout_p == 0``. Element ``(i, j)`` holds the probability as its forward kernel has it
when it processes key block ``J = j // block_n`` (``block_n = _get_block_size_n(...)``), walking the key blocks from
the last to the first::

    S_dmask[b, h, i, j] = ±exp(s_ij - m_i(J)),   m_i(J) = max over keys j' >= J * block_n of s_ij'

where ``s_ij`` is the final score (``softmax_scale * q.k``, soft-capped, plus ALiBi; ``-inf`` where a causal mask,
a window or a sequence end hides the key) and the sign is negative where dropout drops the element. The normalised
probability is ``|S_dmask| * exp(m_i(J) - lse_i)`` with the returned log-sum-exp: flash-attn's tests
(``normalize_flash_attn_S``) recompute ``m_i(J)`` from ``_get_block_size_n`` for exactly this, and read the dropout mask
as ``S_dmask >= 0``.

volta_train computes the same tensor in PyTorch for either backend, from q, k and the call's options: the scores as
the reference backend forms them (:func:`volta_train.reference.scores`: the kernels' masks, ALiBi and softcap) and
the keep bits from :func:`volta_train.philox.dropout_keep_mask` with the call's Philox seed and offset, the function
the kernels evaluate (csrc/philox.cuh). Every element of the unpadded part carries its dropout bit in the sign, the
masked ones too (``-0.0`` where dropped), so ``torch.signbit`` recovers the whole mask even where a probability
underflows; the padding is ``+0.0``. Memory: the result (``batch x heads x seqlen_q x seqlen_k`` elements, rounded
up) plus fp32 work space for one block of ``block_n`` keys: a testing aid, not for training runs.
"""

from __future__ import annotations

import torch

from . import reference
from .options import AttentionOptions, compute_dtype
from .philox import dropout_keep_mask
from .validation import MAX_HEAD_DIM, MIN_HEAD_DIM, as_int

SEQLEN_MULTIPLE = 128  # flash-attn rounds both sequence axes of S_dmask up to this
BLOCK_N = 128  # key-block width of S_dmask's running maximum, what _get_block_size_n reports


def round_multiple(x: int, m: int) -> int:
    """x rounded up to a multiple of m."""
    return (x + m - 1) // m * m


def get_block_size_n(device: torch.device | str | None, head_dim: int, is_dropout: bool, is_causal: bool) -> int:
    """flash-attn's ``flash_attn_interface._get_block_size_n``: the key-block width of ``S_dmask``'s running maximum.

    flash-attn's depends on the GPU, head_dim and the options (its kernels' tile); volta_train builds S_dmask itself,
    with one width for every call (:data:`BLOCK_N`), so this is what S_dmask was computed with. ``device``,
    ``is_dropout`` and ``is_causal`` are accepted for flash-attn's signature; ``head_dim`` must be one the API accepts.
    """
    head_dim = as_int("head_dim", head_dim)
    if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim is {head_dim}; accepted: {MIN_HEAD_DIM} to {MAX_HEAD_DIM}")
    return BLOCK_N


def _fill_dense(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    options: AttentionOptions,
    alibi_slopes: torch.Tensor | None,
    batch_index: torch.Tensor,
) -> None:
    """Writes S_dmask of q [B, Nq, H, D], k [B, Nk, Hkv, D] into out[:, :, :Nq, :Nk] (out: [B, H, >=Nq, >=Nk]).

    ``batch_index`` holds the batch coordinate of each of the B entries in the dropout function (varlen: the sequence).
    """
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    group = nheads // nheads_kv
    cdt = compute_dtype(q.dtype)
    device = q.device
    # the reference backend's layout: query heads as [Hkv, G] so that K is never repeated
    qh = q.to(cdt).permute(0, 2, 1, 3).reshape(batch, nheads_kv, group, seqlen_q, head_dim)
    kh = k.to(cdt).permute(0, 2, 1, 3).unsqueeze(2)
    slopes = reference.shape_alibi(alibi_slopes, nheads_kv)
    rows = torch.arange(seqlen_q, device=device)
    batch_head = (batch_index.view(-1, 1) * nheads + torch.arange(nheads, device=device).view(1, -1)).reshape(-1)
    running_max = torch.full((batch, nheads_kv, group, seqlen_q, 1), float("-inf"), dtype=cdt, device=device)
    last_block = (seqlen_k - 1) // BLOCK_N * BLOCK_N
    # from the last key block to the first, as flash-attn's forward walks them: m_i(J) is a running maximum
    for col0 in range(last_block, -1, -BLOCK_N):
        col1 = min(col0 + BLOCK_N, seqlen_k)
        cols = torch.arange(col0, col1, device=device)
        s, _ = reference.scores(qh, kh[..., col0:col1, :], options, rows, cols, seqlen_q, seqlen_k, slopes)
        running_max = torch.maximum(running_max, s.amax(dim=-1, keepdim=True))
        # a row that has seen no visible key yet: every s is -inf, exp(-inf - 0) = 0
        safe_max = torch.where(torch.isneginf(running_max), torch.zeros_like(running_max), running_max)
        p = torch.exp(s - safe_max).reshape(batch, nheads, seqlen_q, col1 - col0)
        if options.dropout_p > 0.0:
            keep = dropout_keep_mask(options.seed, options.offset, options.dropout_p, batch_head, rows, cols)
            p = torch.where(keep.view(p.shape), p, -p)  # -0.0 where a dropped element's probability is 0
        out[:, :, :seqlen_q, col0:col1] = p.to(out.dtype)


def _check_options(options: AttentionOptions) -> None:
    if not isinstance(options, AttentionOptions):
        raise TypeError(f"options must be a volta_train.options.AttentionOptions, got {type(options).__name__}")


@torch.no_grad()
def s_dmask(
    q: torch.Tensor,
    k: torch.Tensor,
    options: AttentionOptions,
    alibi_slopes: torch.Tensor | None = None,
    *,
    always: bool = False,
) -> torch.Tensor:
    """S_dmask of a dense call (q [B, Nq, H, D], k [B, Nk, Hkv, D]), as flash-attn returns it (module docstring):
    [B, H, round_up(Nq, 128), round_up(Nk, 128)].

    ``options`` must be the call's own (its Philox seed and offset pick the dropout mask). Without dropout it is the
    empty ``(0,)`` tensor, as flash-attn returns it, unless ``always`` (then every sign is +).
    """
    _check_options(options)
    if options.dropout_p == 0.0 and not always:
        return q.new_empty((0,))
    batch, seqlen_q, nheads = q.shape[0], q.shape[1], q.shape[2]
    seqlen_k = k.shape[1]
    out = q.new_zeros((batch, nheads, round_multiple(seqlen_q, SEQLEN_MULTIPLE), round_multiple(seqlen_k, SEQLEN_MULTIPLE)))
    if out.numel() == 0 or seqlen_q == 0 or seqlen_k == 0 or k.shape[2] == 0:
        return out
    _fill_dense(out, q.detach(), k.detach(), options, alibi_slopes, torch.arange(batch, device=q.device))
    return out


@torch.no_grad()
def s_dmask_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    options: AttentionOptions,
    alibi_slopes: torch.Tensor | None = None,
    *,
    always: bool = False,
) -> torch.Tensor:
    """S_dmask of a varlen call (q [total_q, H, D], k [total_k, Hkv, D]), as flash-attn returns it.

    [B, H, round_up(max_seqlen_q, 128), round_up(max_seqlen_k, 128)], B = len(cu_seqlens_q) - 1; sequence b's block
    is ``[b, :, :len_q, :len_k]`` (its dropout mask is the dense one of batch entry b), the rest is 0. Without
    dropout the empty ``(0,)`` tensor unless ``always``, as in :func:`s_dmask`.
    """
    _check_options(options)
    if options.dropout_p == 0.0 and not always:
        return q.new_empty((0,))
    batch = cu_seqlens_q.numel() - 1
    shape = (batch, q.shape[1], round_multiple(int(max_seqlen_q), SEQLEN_MULTIPLE),
             round_multiple(int(max_seqlen_k), SEQLEN_MULTIPLE))
    out = q.new_zeros(shape)
    if out.numel() == 0 or k.shape[1] == 0:
        return out
    q, k = q.detach(), k.detach()
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(batch):
        q0, q1, k0, k1 = starts_q[b], starts_q[b + 1], starts_k[b], starts_k[b + 1]
        if q1 == q0 or k1 == k0:
            continue
        slopes = alibi_slopes[b : b + 1] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
        _fill_dense(out[b : b + 1], q[None, q0:q1], k[None, k0:k1], options, slopes,
                    torch.tensor([b], device=q.device))
    return out

"""The chunked linear + cross-entropy (volta_train/training/chunked_loss.py) against the unchunked loss.

Every comparison measures both the chunked and the unchunked fp32 (or fp16-autocast) computation
against a float64 reference and asks the chunked error to be within a small multiple of the
unchunked one (fp32 rounding), on odd sizes with ignored targets. CPU fp16: ``torch.autocast('cpu',
dtype=torch.float16)`` runs fp16 matmuls on CPU in torch 2.13, so fp16 is tested as it is (the
"scaled" accumulation; CUDA builds use fp32-accumulating fp16 matmuls, covered by the gpu test).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from volta_train.training import chunked_loss as cl
from volta_train.training import sequence_parallel
from checkout import ROOT

EPS32 = torch.finfo(torch.float32).eps


def _inputs(gen, n=53, width=24, vocab=131, ignored=0.2, bias=True, dtype=torch.float64):
    hidden = torch.randn(n, width, generator=gen, dtype=dtype)
    weight = torch.randn(vocab, width, generator=gen, dtype=dtype) * 0.4
    b = torch.randn(vocab, generator=gen, dtype=dtype) * 0.1 if bias else None
    targets = torch.randint(0, vocab, (n,), generator=gen)
    targets[torch.rand(n, generator=gen) < ignored] = -100
    return hidden, weight, b, targets


def _loss_and_grads(fn, tensors, dtype, scale=1.0):
    leaves = [None if t is None else t.detach().to(dtype).requires_grad_() for t in tensors]
    loss = fn(*leaves)
    grads = torch.autograd.grad(loss * scale, [t for t in leaves if t is not None])
    return loss.detach().double(), [g.double() for g in grads], leaves


def _err(a, b):
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)


def _assert_as_close_as_unchunked(chunked, unchunked, reference, factor=2.0, floor=8 * EPS32):
    """chunked and unchunked: (loss, grads); each error relative to the reference's largest magnitude."""
    for c, u, r in zip([chunked[0], *chunked[1]], [unchunked[0], *unchunked[1]], [reference[0], *reference[1]]):
        ec, eu = _err(c, r), _err(u, r)
        assert ec <= factor * eu + floor, (ec, eu)


def _reference(fn_args, reduction="mean"):
    hidden, weight, bias, targets = fn_args
    def loss(h, w, b=None):
        return F.cross_entropy(F.linear(h, w, b).double(), targets, reduction=reduction)

    return _loss_and_grads(loss, [hidden, weight, bias], torch.float64)[:2]


@pytest.mark.parametrize("chunk", [1, 7, 64, None])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_fp32_matches_unchunked_within_rounding(rng, chunk, bias, reduction):
    hidden, weight, b, targets = _inputs(rng, bias=bias)
    ref = _reference((hidden, weight, b, targets), reduction)

    def chunked(h, w, bb=None):
        return cl.linear_cross_entropy(h, w, targets, bb, reduction=reduction, chunk_tokens=chunk)

    def unchunked(h, w, bb=None):
        return F.cross_entropy(F.linear(h, w, bb).float(), targets, reduction=reduction)

    got = _loss_and_grads(chunked, [hidden, weight, b], torch.float32)
    base = _loss_and_grads(unchunked, [hidden, weight, b], torch.float32)
    assert got[0].dtype == torch.float64 and got[2][0].dtype == torch.float32
    _assert_as_close_as_unchunked(got[:2], base[:2], ref)
    exact = _loss_and_grads(chunked, [hidden, weight, b], torch.float64)  # fp64 in: fp64 throughout
    for g, r in zip([exact[0], *exact[1]], [ref[0], *ref[1]]):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)


def test_batched_hidden_and_grad_output_scaling(rng):
    """[batch, seq, H] inputs, and a backward through loss * c (accumulation / loss scale) scales every gradient."""
    hidden, weight, _, targets = _inputs(rng, n=3 * 17, bias=False)
    hidden, targets = hidden.view(3, 17, -1), targets.view(3, 17)
    ref = _loss_and_grads(lambda h, w: F.cross_entropy(F.linear(h, w).flatten(0, 1), targets.flatten()),
                          [hidden, weight], torch.float64, scale=0.37)
    got = _loss_and_grads(lambda h, w: cl.linear_cross_entropy(h, w, targets, chunk_tokens=5), [hidden, weight],
                          torch.float64, scale=0.37)
    assert got[1][0].shape == hidden.shape
    for g, r in zip([got[0], *got[1]], [ref[0], *ref[1]]):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)


def test_no_targets_gives_zero_loss_and_gradients(rng):
    hidden, weight, b, targets = _inputs(rng, ignored=1.1)
    loss, grads, _ = _loss_and_grads(lambda h, w, bb: cl.linear_cross_entropy(h, w, targets, bb, chunk_tokens=9),
                                     [hidden, weight, b], torch.float32)
    assert loss.item() == 0.0 and all(g.abs().max().item() == 0.0 for g in grads)


def test_frozen_head_and_no_grad(rng):
    hidden, weight, _, targets = _inputs(rng, bias=False)
    h = hidden.float().requires_grad_()
    loss = cl.linear_cross_entropy(h, weight.float(), targets, chunk_tokens=8)
    (grad,) = torch.autograd.grad(loss, h)
    h2 = hidden.float().requires_grad_()
    (expected,) = torch.autograd.grad(F.cross_entropy(F.linear(h2, weight.float()), targets), h2)
    torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-7)
    with torch.no_grad():
        value = cl.linear_cross_entropy(h, weight.float(), targets, chunk_tokens=8)
    assert not value.requires_grad
    torch.testing.assert_close(value, loss.detach())


@pytest.mark.parametrize("bias", [True, False])
def test_fp16_autocast_matches_unchunked_within_rounding(rng, bias):
    hidden, weight, b, targets = _inputs(rng, n=77, vocab=293, bias=bias)
    ref = _reference((hidden, weight, b, targets))

    def chunked(h, w, bb=None):
        with torch.autocast("cpu", dtype=torch.float16):
            return cl.linear_cross_entropy(h, w, targets, bb, chunk_tokens=16)

    def unchunked(h, w, bb=None):
        with torch.autocast("cpu", dtype=torch.float16):
            logits = F.linear(h, w, bb)
        assert logits.dtype == torch.float16  # CPU autocast does run the matmul in fp16
        return F.cross_entropy(logits.float(), targets)

    got = _loss_and_grads(chunked, [hidden, weight, b], torch.float32)
    base = _loss_and_grads(unchunked, [hidden, weight, b], torch.float32)
    assert all(t.dtype == torch.float32 for t in got[2] if t is not None)
    _assert_as_close_as_unchunked(got[:2], base[:2], ref, factor=2.0, floor=1e-3)
    assert _err(got[0], ref[0]) < 1e-3  # fp16 logits; the softmax in fp32


def test_fp16_weights_without_autocast_give_fp16_gradients(rng):
    """A model cast to fp16 (DeepSpeed fp16): fp16 in, fp16 gradients out, as close to fp64 as unchunked fp16."""
    hidden, weight, _, targets = _inputs(rng, n=40, vocab=97, bias=False)
    ref = _reference((hidden, weight, None, targets))
    got = _loss_and_grads(lambda h, w: cl.linear_cross_entropy(h, w, targets, chunk_tokens=16), [hidden, weight],
                          torch.float16)
    base = _loss_and_grads(lambda h, w: F.cross_entropy(F.linear(h, w).float(), targets), [hidden, weight],
                           torch.float16)
    assert [t.dtype for t in got[2]] == [torch.float16, torch.float16]
    _assert_as_close_as_unchunked(got[:2], base[:2], ref, factor=2.0, floor=2e-3)


def test_fp16_weight_gradient_cannot_overflow(rng):
    """Sum reduction over many tokens with one target and large hidden states: the weight gradient's target row is
    ~ -tokens * |h| (beyond fp16's 65504). The unchunked fp16 product overflows; the chunked one stays exact to
    fp16 rounding (the product is accumulated in fp32, the fp16 operand scaled so nothing overflows)."""
    n, width, vocab = 512, 16, 50
    hidden = (torch.randn(n, width, generator=rng, dtype=torch.float64) + 3.0) * 100.0
    weight = torch.randn(vocab, width, generator=rng, dtype=torch.float64) * 0.01
    weight[7] = -weight[7].abs()  # the target's logit well below the others: p ~ 0, its gradient row ~ -sum(h)
    targets = torch.full((n,), 7)
    ref = _reference((hidden, weight, None, targets), "sum")
    assert ref[1][1].abs().max().item() > 1.5 * 65504

    def chunked(h, w):
        with torch.autocast("cpu", dtype=torch.float16):
            return cl.linear_cross_entropy(h, w, targets, reduction="sum", chunk_tokens=128, matmul="scaled")

    loss, grads, _ = _loss_and_grads(chunked, [hidden, weight], torch.float32)
    assert all(torch.isfinite(g).all() for g in grads)
    assert _err(grads[1], ref[1][1]) < 2e-3

    def unchunked(h, w):
        with torch.autocast("cpu", dtype=torch.float16):
            return F.cross_entropy(F.linear(h, w).float(), targets, reduction="sum")

    base_loss, base, _ = _loss_and_grads(unchunked, [hidden, weight], torch.float32)
    assert not torch.isfinite(base[1]).all()  # the case is real
    # the rest as close as fp16 logits allow (|logits| ~ 12 here: rounding ~ 4e-3 of them)
    assert _err(grads[0], ref[1][0]) <= 2 * _err(base[0], ref[1][0]) + 1e-3
    assert _err(loss, ref[0]) <= 2 * _err(base_loss, ref[0]) + 1e-4


def test_chunk_size_budget():
    assert cl.chunk_size(131072, 100000) == 2048  # 1 GiB of fp32 logits
    assert cl.chunk_size(50304, 100000) == 5312
    assert cl.chunk_size(50304, 100) == 100
    assert cl.chunk_size(10**9, 100) == 1
    assert cl.chunk_size(50304, 100000, chunk_tokens=300) == 300
    assert cl.chunk_size(32000, 10**6, budget_mib=64) == 512
    with pytest.raises(cl.ChunkedLossError, match="chunk_tokens must be a positive integer"):
        cl.chunk_size(100, 10, chunk_tokens=0)


def test_bad_inputs_are_named(rng):
    hidden, weight, _, targets = _inputs(rng, bias=False)
    with pytest.raises(cl.ChunkedLossError, match=r"outside \[0, 131\)"):
        cl.linear_cross_entropy(hidden, weight, torch.where(targets == -100, 131, targets))
    with pytest.raises(cl.ChunkedLossError, match="targets must have hidden's shape"):
        cl.linear_cross_entropy(hidden, weight, targets[:-1])
    with pytest.raises(cl.ChunkedLossError, match=r"hidden must be \[\.\.\., 24\]"):
        cl.linear_cross_entropy(hidden[:, :-1], weight, targets)
    with pytest.raises(cl.ChunkedLossError, match="reduction must be"):
        cl.linear_cross_entropy(hidden, weight, targets, reduction="none")
    with pytest.raises(cl.ChunkedLossError, match="int64"):
        cl.linear_cross_entropy(hidden, weight, targets.int())


def test_backward_twice_is_refused(rng):
    hidden, weight, _, targets = _inputs(rng, bias=False)
    h = hidden.requires_grad_()
    loss = cl.linear_cross_entropy(h, weight, targets)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


# --------------------------------------------------------------------------------------------------
# causal LMs
# --------------------------------------------------------------------------------------------------


def _model(kind: str, vocab: int = 389, seq: int = 64):
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    if kind == "gpt2":  # tied (GPT-2's default)
        config = GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)
    else:
        config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq,
                             tie_word_embeddings=kind == "llama_tied", use_cache=False, bos_token_id=0,
                             eos_token_id=0, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.loss_type = "ForCausalLM"
    return model


def _batch(gen, vocab: int, kind: str, rows: int = 2, seq: int = 45):
    ids = torch.randint(1, vocab, (rows, seq), generator=gen)
    labels = ids.clone()
    batch = {"input_ids": ids, "labels": labels}
    if kind == "padded":  # right padding: a mask, no targets on the padding
        mask = torch.ones_like(ids)
        mask[0, 30:] = 0
        labels[0, 30:] = -100
        labels[1, :6] = -100  # a prompt that is no target
        batch["attention_mask"] = mask
    elif kind == "packed":  # documents of 20 and 25 tokens in each row; no target across documents
        positions = torch.cat([torch.arange(20), torch.arange(seq - 20)]).expand(rows, seq).contiguous()
        labels[:, 20] = -100
        batch["position_ids"] = positions
    return batch


def _grads(model):
    return {n: p.grad.double().clone() for n, p in model.named_parameters() if p.grad is not None}


def _run(model, fn, batches):
    model.zero_grad(set_to_none=True)
    losses = []
    for batch in batches:
        loss = fn(model, batch) / len(batches)
        loss.backward()
        losses.append(loss.detach().double())
    return torch.stack(losses).sum(), _grads(model)


def _compare_to_unchunked(model, batches, chunk_tokens=16, floor=16 * EPS32):
    import copy

    reference = copy.deepcopy(model).double()
    ref = _run(reference, lambda m, b: m(**b).loss, batches)
    base = _run(model, lambda m, b: m(**b).loss, batches)
    got = _run(model, lambda m, b: cl.causal_lm_loss(m, b, chunk_tokens=chunk_tokens), batches)
    assert set(got[1]) == set(ref[1])
    _assert_as_close_as_unchunked((got[0], list(got[1].values())), (base[0], list(base[1].values())),
                                  (ref[0], list(ref[1].values())), floor=floor)
    return got


@pytest.mark.parametrize("arch", ["gpt2", "llama", "llama_tied"])
@pytest.mark.parametrize("kind", ["padded", "packed"])
def test_causal_lm_loss_matches_transformers(rng, arch, kind):
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=rng)))
    model = _model(arch)
    tied = model.lm_head.weight is model.get_input_embeddings().weight
    assert tied == (arch != "llama")
    _compare_to_unchunked(model, [_batch(rng, 389, kind)])


def test_tied_embedding_gets_both_gradients(rng):
    """Tied head: the one Parameter's gradient is the embedding's plus the head's, as without chunking."""
    torch.manual_seed(3)
    model = _model("gpt2")
    batch = _batch(rng, 389, "packed")
    got = _compare_to_unchunked(model, [batch])
    assert "lm_head.weight" not in got[1] and "transformer.wte.weight" in got[1]  # one Parameter, named once
    assert model.lm_head.weight is model.transformer.wte.weight
    assert "forward" not in model.lm_head.__dict__  # the head is itself again


def test_gradient_accumulation_two_micro_batches(rng):
    torch.manual_seed(5)
    model = _model("llama")
    _compare_to_unchunked(model, [_batch(rng, 389, "padded"), _batch(rng, 389, "packed", rows=3, seq=33)])


def test_fp16_autocast_model(rng):
    """A whole model under CPU fp16 autocast: chunked and unchunked equally close to the fp64 model."""
    torch.manual_seed(7)
    model = _model("gpt2")
    batch = _batch(rng, 389, "padded")

    def autocast(fn):
        def run(m, b):
            with torch.autocast("cpu", dtype=torch.float16, enabled=next(m.parameters()).dtype == torch.float32):
                return fn(m, b)
        return run

    import copy

    ref = _run(copy.deepcopy(model).double(), lambda m, b: m(**b).loss, [batch])
    base = _run(model, autocast(lambda m, b: m(**b).loss), [batch])
    got = _run(model, autocast(lambda m, b: cl.causal_lm_loss(m, b, chunk_tokens=16)), [batch])
    ec = max(_err(got[1][n], ref[1][n]) for n in ref[1])
    eu = max(_err(base[1][n], ref[1][n]) for n in ref[1])
    assert ec <= 2 * eu + 1e-3, (ec, eu)
    assert _err(got[0], ref[0]) <= 2 * _err(base[0], ref[0]) + 1e-4


def test_sequence_parallel_shards_add_up(rng):
    """Two simulated ranks: each takes the chunked loss sum of its shard of the (shifted, padded) sequence; the sum
    over ranks over the total target count is the full loss, and the gradients of hidden and head are the
    full loss's."""
    torch.manual_seed(11)
    model = _model("llama")
    batch = {"input_ids": torch.randint(1, 389, (2, 47), generator=rng)}
    batch["labels"] = batch["input_ids"].clone()
    batch["labels"][:, :5] = -100
    shards = [sequence_parallel.shard_batch(batch, 2, r) for r in range(2)]
    ids = torch.cat([s["input_ids"] for s in shards], 1)
    positions = torch.cat([s["position_ids"] for s in shards], 1)
    with torch.no_grad():
        hidden = model.model(input_ids=ids, position_ids=positions).last_hidden_state
    weight = model.lm_head.weight

    def sharded(h, w):
        total = 0.0
        count = sum(int((s["shift_labels"] != -100).sum()) for s in shards)
        width = ids.shape[1] // 2
        for r, s in enumerate(shards):
            total = total + cl.linear_cross_entropy(h[:, r * width:(r + 1) * width], w, s["shift_labels"],
                                                    reduction="sum", chunk_tokens=13)
        return total / count

    full_targets = torch.cat([s["shift_labels"] for s in shards], 1)

    def full(h, w):
        return F.cross_entropy(F.linear(h, w).flatten(0, 1), full_targets.flatten())

    ref = _loss_and_grads(full, [hidden, weight], torch.float64)
    base = _loss_and_grads(full, [hidden, weight], torch.float32)
    got = _loss_and_grads(sharded, [hidden, weight], torch.float32)
    _assert_as_close_as_unchunked(got[:2], base[:2], ref[:2])
    with torch.no_grad():  # and that is transformers' loss of the unsharded batch
        torch.testing.assert_close(got[0].float(), model(**batch).loss, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("factor", [1.0, 4.0])
def test_sharded_loss_chunked_equals_unchunked(rng, factor):
    torch.manual_seed(13)
    model = _model("gpt2")
    batch = sequence_parallel.shard_batch(_batch(rng, 389, "packed"), 1, 0)
    results = []
    for chunked in (False, True):
        model.zero_grad(set_to_none=True)
        loss = sequence_parallel.sharded_loss(model, batch, grad_factor=factor, chunked=chunked, chunk_tokens=10)
        loss.backward()
        results.append((loss.detach(), _grads(model)))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-6, atol=1e-6)
    for name, g in results[0][1].items():  # fp32 rounding, relative to each gradient's largest entry
        assert _err(results[1][1][name], g) < 1e-5, name


def test_eval_sums_count_argmax_hits(rng):
    torch.manual_seed(17)
    model = _model("llama").eval()
    batch = _batch(rng, 389, "padded")
    targets = cl.shift_labels(batch.pop("labels"))
    total, count, correct = cl.causal_lm_eval_sums(model, batch, targets, chunk_tokens=7)
    with torch.no_grad():
        logits = model(**batch).logits.float()
    valid = targets != -100
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-5)
    assert int(count) == int(valid.sum())
    assert int(correct) == int(((logits.argmax(-1) == targets) & valid).sum())


def test_models_that_change_their_logits_are_refused(rng):
    model = _model("llama")
    model.config.final_logit_softcapping = 30.0
    ok, why = cl.supported(model)
    assert not ok and "final_logit_softcapping" in why
    on, note = cl.resolve(True, model)
    assert not on and "not chunked" in note
    with pytest.raises(cl.ChunkedLossError, match="chunked_loss: false"):
        cl.causal_lm_loss(model, _batch(rng, 389, "packed"))
    del model.config.final_logit_softcapping

    class Scaled(torch.nn.Module):  # a forward that rescales the logits after the head
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def get_output_embeddings(self):
            return self.inner.get_output_embeddings()

        def forward(self, **kw):
            out = self.inner(**kw)
            out.logits = out.logits * 2.0
            return out

    with pytest.raises(cl.ChunkedLossError, match="changed what it returned"):
        cl.causal_lm_loss(Scaled(model), _batch(rng, 389, "packed"))
    assert "forward" not in model.lm_head.__dict__


class _LargestOutput(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_tensor_of_tokens_times_vocab(rng):
    """Forward + backward of a tiny GPT-2 with 1,024 tokens and 4,000 words: no op output (logits, softmax, their
    gradients, anything else in the model) is larger than one chunk x vocab; the unchunked loss makes tokens x
    vocab tensors."""
    torch.manual_seed(19)
    vocab, tokens, chunk = 4000, 1024, 64
    model = _model("gpt2", vocab=vocab, seq=128)
    batch = _batch(rng, vocab, "packed", rows=8, seq=128)
    largest = {}
    for name, fn in (("chunked", lambda: cl.causal_lm_loss(model, batch, chunk_tokens=chunk)),
                     ("unchunked", lambda: model(**batch).loss)):
        model.zero_grad(set_to_none=True)
        with _LargestOutput() as mode:
            fn().backward()
        largest[name] = mode.largest
    assert largest["unchunked"] >= tokens * vocab
    assert largest["chunked"] <= chunk * vocab < tokens * vocab // 8, largest


@pytest.mark.gpu
@pytest.mark.parametrize("matmul", ["auto", "scaled"])
def test_gpu_fp16_autocast_matches_unchunked(matmul):
    """On the GPU: fp16 autocast, a 32k vocabulary, 3,000 tokens with some ignored; both fp16 accumulations (the
    fp32-accumulating fp16 matmul that "auto" picks where the build has it, and the scaled one) are as close to fp64
    as the unchunked loss, and the chunked peak memory is far below the unchunked one."""
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(int.from_bytes(__import__("os").urandom(4), "little"))
    hidden, weight, _, targets = _inputs(gen, n=3000, width=256, vocab=32000, bias=False)
    hidden, weight, targets = hidden.to(device), weight.to(device) * 0.1, targets.to(device)
    if matmul == "auto":
        assert cl._out_dtype_works(device, torch.float16), "no fp16 -> fp32 matmul on this GPU"
    ref = _reference((hidden, weight, None, targets))
    peaks = {}

    def run(fn, name):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        result = _loss_and_grads(fn, [hidden, weight], torch.float32)
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - before
        return result

    def chunked(h, w):
        with torch.autocast("cuda", dtype=torch.float16):
            return cl.linear_cross_entropy(h, w, targets, chunk_tokens=512, matmul=matmul)

    def unchunked(h, w):
        with torch.autocast("cuda", dtype=torch.float16):
            return F.cross_entropy(F.linear(h, w).float(), targets)

    got = run(chunked, "chunked")
    base = run(unchunked, "unchunked")
    _assert_as_close_as_unchunked(got[:2], base[:2], ref, factor=2.0, floor=1e-3)
    assert peaks["chunked"] < peaks["unchunked"] / 3, peaks


# --------------------------------------------------------------------------------------------------
# recipes
# --------------------------------------------------------------------------------------------------


def _losses(out_dir: Path) -> list[float]:
    import csv

    with (out_dir / "train.csv").open() as f:
        return [float(row["loss"]) for row in csv.DictReader(f) if row.get("split", "train") == "train"]


@pytest.mark.slow
def test_gpt_long_chunked_and_unchunked_train_alike(tmp_path):
    """The recipe, 6 steps of a Llama-style model with 2 micro-batches per step and packed documents: the chunked
    run's loss curve is the unchunked run's (fp32 rounding, amplified by 6 AdamW steps)."""
    curves, summaries = {}, {}
    for flag in ("--chunked-loss", "--no-chunked-loss"):
        out = tmp_path / flag
        cmd = [sys.executable, str(ROOT / "recipes" / "gpt_long.py"), "--cpu", "--arch", "llama", "--model", "nano",
               "--seq-len", "96", "--batch-size", "2", "--grad-accum", "2", "--steps", "6", "--log-interval", "1",
               "--eval-batches", "1", "--checkpoint-interval", "0", "--no-save", "--no-progress", "--no-tensorboard",
               "--synthetic-mb", "1", "--cache-dir", str(tmp_path / "cache"), "--out-dir", str(out),
               "--loss-chunk-tokens", "40", flag]
        proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
        curves[flag] = _losses(out)
        summaries[flag] = json.loads((out / "summary.json").read_text())
        assert ("loss: chunked" in proc.stderr) == (flag == "--chunked-loss"), proc.stderr[-3000:]
    assert summaries["--chunked-loss"]["chunked_loss"] and not summaries["--no-chunked-loss"]["chunked_loss"]
    a, b = curves["--chunked-loss"], curves["--no-chunked-loss"]
    assert len(a) == len(b) == 6
    for x, y in zip(a, b):
        assert math.isclose(x, y, rel_tol=2e-5), (a, b)
    assert math.isclose(summaries["--chunked-loss"]["val_loss"], summaries["--no-chunked-loss"]["val_loss"],
                        rel_tol=2e-5)


@pytest.mark.slow
def test_finetune_chunked_and_unchunked_train_and_evaluate_alike(tmp_path):
    """recipes/finetune.py on the shipped instruction config (padded batches, prompts masked): the chunked run's
    training loss, evaluation loss and token accuracy are the unchunked run's."""
    summaries = {}
    for flag in ("--train.chunked-loss", "--train.no-chunked-loss"):
        out = tmp_path / flag
        cmd = [sys.executable, str(ROOT / "recipes" / "finetune.py"), "--config", "configs/finetune/gpt2_instruct.yaml",
               "--train.steps", "3", "--train.cpu", "--logging.log-interval", "1", "--logging.out-dir", str(out),
               "--data.cache-dir", str(tmp_path / "cache"), "--logging.no-progress", "--logging.no-tensorboard",
               "--eval.batches", "2", "--checkpoint.no-save-final", "--train.loss-chunk-tokens", "50", flag]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert ("loss: chunked" in proc.stderr) == (flag == "--train.chunked-loss"), proc.stderr[-3000:]
        summaries[flag] = json.loads((out / "summary.json").read_text())
    a, b = summaries["--train.chunked-loss"], summaries["--train.no-chunked-loss"]
    for key in ("train_loss", "eval_loss", "eval_token_accuracy"):
        assert math.isclose(a[key], b[key], rel_tol=2e-5, abs_tol=1e-7), (key, a[key], b[key])


@pytest.mark.gpu
def test_gpu_out_dtype_matmul_found_under_autocast(monkeypatch):
    """The recipes first reach the chunked loss inside fp16 autocast: the check for the fp16 -> fp32 matmul must not
    be fooled by it (it was: every chunk then took the slower scaled path, 1.5x GPT-2 small's step time)."""
    device = torch.device("cuda")
    monkeypatch.setattr(cl, "_OUT_DTYPE_WORKS", {})
    with torch.autocast("cuda", dtype=torch.float16):
        assert cl._out_dtype_works(device, torch.float16)


@pytest.mark.gpu
def test_gpu_out_of_range_targets_make_loss_and_gradients_nan_and_are_named():
    device = torch.device("cuda")
    hidden = torch.randn(37, 16, device=device, requires_grad=True)
    weight = torch.randn(50, 16, device=device, requires_grad=True)
    targets = torch.randint(0, 50, (37,), device=device)
    loss = cl.linear_cross_entropy(hidden, weight, targets)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(hidden.grad).all() and cl.describe_bad_targets() is None
    hidden.grad = weight.grad = None
    targets[5], targets[9] = 50, -3
    loss = cl.linear_cross_entropy(hidden, weight, targets)
    loss.backward()
    assert torch.isnan(loss) and torch.isnan(hidden.grad).all() and torch.isnan(weight.grad).all()
    assert cl.describe_bad_targets() == ("targets: 2 id(s) outside [0, 50) (the head's vocabulary) that are not "
                                         "ignore_index (-100), e.g. 50")

"""Longest sequence that trains full optimizer steps on one GPU under a memory cap, with the long-context features
(tiled MLP, activation offload) off and on, next to what the memory model of docs/long_context.md predicts.

    python lab/long_context_probe.py                       # Llama-3.2-1B shape, 128k words, 32 GiB: before/after
    python lab/long_context_probe.py --variants baseline,tiled,offload,tiled+offload --memory-gb 16
    python lab/long_context_probe.py --smoke               # CPU, tiny model, seconds: the code path only

The training step is scripts/bench_train.py's (imported, not copied): fp32 weights, fp16 autocast with GradScaler,
gradient clipping, fused AdamW, the chunked loss, activation checkpointing; the process's CUDA memory is capped
with torch.cuda.set_per_process_memory_fraction (bench_train._set_cap). Each probe runs ``--probe-steps`` steps
(default 2): the first step allocates AdamW's state only in optimizer.step(), after the backward has freed the
activations, so a single step misses the steady state, where the backward runs next to that state.

Attention: full causal attention at 500k tokens costs minutes a step while its memory (flash/SDPA: O(tokens)) does
not depend on how many keys a query sees, so by default the search runs causal SDPA within blocks of
``--attention-block`` tokens (same tensors, O(tokens x block) work); ``--attention sdpa`` runs the full attention.

Variants: ``baseline`` or features joined by ``+`` (in this order): ``tiled`` (tiled MLP), ``offload`` (activation
offload), ``optim_offload``: the optimizer state in host memory (:class:`HostAdamW`): 16-bit weights and gradients
on the GPU (bf16 on sm_80+, fp16 with loss scaling on a V100), fp32 master weights, their gradients and AdamW's
moments in host memory, the step on the CPU (torch's foreach AdamW). It stands in, for what stays in GPU memory, for
DeepSpeed's ``offload_optimizer: {device: cpu}`` with 16-bit training (ZeRO-Offload), which this one-GPU probe does
not need installed; not for its speed (DeepSpeed's CPU Adam is compiled, and it streams gradients to the host during
the backward, so it holds at most what this holds on the GPU). ``lean_norm``: the RMSNorms swapped for the lean one
(``volta_train/training/rms_norm.py``, what the recipes' ``lean_norm: auto`` does with the tiled MLP).

Search per variant: doubling from ``--start`` until a length fails (out of memory) or reaches ``--max-len``, then
bisection until the bracket is within ``--granularity`` tokens; ``--time-budget-min`` stops starting probes (the
bracket so far is reported). Output: ``<out>/long_context_probe.md`` (table) and ``.json`` (every probe).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import statistics
import time
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # less fragmentation at the cap
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from volta_train.training import activation_offload, chunked_loss, rms_norm, tiled_mlp  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FEATURES = ("tiled", "offload", "optim_offload", "lean_norm")
VARIANTS = ("baseline", "tiled", "offload", "tiled+offload", "optim_offload", "tiled+offload+optim_offload",
            "tiled+offload+optim_offload+lean_norm")


def parse_variant(name: str) -> dict:
    """``baseline`` or FEATURES joined by ``+`` in that order -> {feature: on?}."""
    parts = [] if name == "baseline" else name.split("+")
    if name != "baseline" and (any(p not in FEATURES for p in parts) or len(set(parts)) != len(parts)
                               or parts != sorted(parts, key=FEATURES.index)):
        raise ValueError(f"--variants: unknown variant {name!r}; accepted: baseline, or {', '.join(FEATURES)} joined "
                         f"by '+' in that order (e.g. {VARIANTS[-1]})")
    return {f: f in parts for f in FEATURES}
ATTENTION = "long_context_probe_block_local"


def _bench_train():
    """scripts/bench_train.py as a module."""
    path = ROOT / "scripts" / "bench_train.py"
    spec = importlib.util.spec_from_file_location("bench_train", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_train"] = module
    spec.loader.exec_module(module)
    return module


bench = _bench_train()

# ---- memory model (docs/long_context.md, "Memory model") --------------------------------------------------------

# The caching allocator reserves more than the live tensors: reserved minus the model's live bytes at the three
# measured 32 GiB points (docs/long_context.md) is 0.98, 1.98 and 0.36 GiB; the model counts 1 GiB.
OVERHEAD_GIB = 1.0


def model_shape(name: str, vocab: int) -> dict:
    """Shape figures of a bench_train model: layers, width, key/value width, MLP width, heads, head width, words,
    parameters (all, one layer's, one layer's matmul weights)."""
    s = bench.LLAMA[name]
    return llama_shape(s["n_layer"], s["n_embd"], s["n_head"], s["n_kv_head"], s["intermediate"], vocab)


def llama_shape(layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int, vocab: int) -> dict:
    """model_shape's figures for a Llama of these widths with tied embeddings (gated MLP, no biases)."""
    h, kv_width = hidden, hidden // heads * kv_heads
    linear = h * (2 * h + 2 * kv_width) + 3 * h * intermediate
    per_layer = linear + 2 * h
    return {"layers": layers, "hidden": h, "kv_width": kv_width, "intermediate": intermediate,
            "heads": heads, "head_dim": h // heads, "vocab": vocab,
            "parameters": layers * per_layer + vocab * h + h, "layer_parameters": per_layer,
            "layer_linear_parameters": linear}


def _layer_working_set(shape: dict, tiled: bool, amp: bool, lean_norm: bool = False) -> dict:
    """Bytes per token of one block's backward at its peak, beyond the checkpointed inputs (lab/memory_inventory.py
    lists them): what the block's recompute saved and is still alive, the gradient flowing in, and the temporaries
    of the backward op running then. amp: fp32 residual stream under fp16 autocast; else a 16-bit model. lean_norm
    (volta_train/training/rms_norm.py) is counted with the tiled MLP only (untiled, the MLP's own peak is kept)."""
    h, kv, inter, heads = shape["hidden"], shape["kv_width"], shape["intermediate"], shape["heads"]
    if lean_norm and tiled:
        # no norm temporaries: the peak moves to attention's backward, where flash's saved q and output, its fp32
        # dq accumulator and 16-bit dq, dk and dv over all query heads and their per-group sums, the input norm's
        # output (amp: the q, k and v projections' fp16 copies of it) and the gradients flowing in and out
        # (fp32 under amp) are alive
        return {"attention_backward": (28 if amp else 22) * h + 8 * kv + 8 * heads}
    # flash attention saves its 16-bit q, k, v, output and an fp32 log-sum-exp per head
    sdpa = 2 * h + 2 * kv + 2 * kv + 2 * h + 4 * heads
    if amp:
        # input norm's fp32 x * rsqrt (saved for its weight's gradient), the q, k and v projections' fp16 copies of
        # its output (autocast casts for each), the residual sum and the post-attention norm's x * rsqrt (fp32)
        saved = 4 * h + 3 * 2 * h + sdpa + 4 * h + 4 * h
        gradient = 4 * h
        if tiled:  # peak at the post-attention norm's backward: the MLP input's gradient and two fp32 temporaries
            mlp = 4 * h + 2 * 4 * h
        else:  # peak at the backward of act(gate) * up: the two fp16 input copies, gate, up, act(gate), and the
            mlp = 2 * 2 * h + 6 * 2 * inter  # gradients of the product, of act(gate) and of up ([tokens, I] each)
    else:
        # the input norm's fp32 upcast and its 16-bit x * rsqrt and output (shared by q, k, v); the post-attention
        # norm's fp32 upcast
        saved = 4 * h + 2 * h + 2 * h + sdpa + 4 * h
        gradient = 2 * h
        if tiled:  # peak at the post-attention norm's backward: five fp32 temporaries
            mlp = 5 * 4 * h
        else:
            mlp = 2 * 2 * h + 6 * 2 * inter
    return {"saved": saved, "gradient": gradient, "mlp": mlp}


def memory_moments(shape: dict, tiled: bool, offload: bool, tile_tokens: int | None = None,
                   loss_chunk_mib: float = chunked_loss.DEFAULT_CHUNK_MIB, gpus: int = 1,
                   state_bytes_per_parameter: float = 16.0, overhead_gib: float = OVERHEAD_GIB,
                   hidden_bytes: int = 4, all_to_all: bool = False, lean_norm: bool = False) -> dict:
    """The moments of a training step where the peak can fall, each {fixed bytes, bytes per local token, terms}
    (docs/long_context.md, "Memory model"). tile_tokens does not enter: a tile's [tile, intermediate] tensors are
    freed before its block's peak, and the moment they are alive holds less at these lengths. all_to_all: Ulysses
    (sp > 1) adds to each block's backward the 16-bit query, key and value gradients on both sides of their
    all-to-all (an upper bound: they are alive at the attention's backward, not at the MLP's)."""
    h, inter, layers, d = shape["hidden"], shape["intermediate"], shape["layers"], shape["head_dim"]
    vh = shape["vocab"] * h
    amp = hidden_bytes == 4
    b = hidden_bytes
    state = state_bytes_per_parameter
    grad = min(state, 4.0 if amp else 2.0)  # gradients accumulate during the backward: fp32 (amp) or 16-bit
    params = shape["parameters"] / gpus
    layer, linear = shape["layer_parameters"] / gpus, shape["layer_linear_parameters"]
    attention_linear = linear - 3 * h * inter
    kept = (state - grad) * params  # weights and optimizer state, all step long
    overhead = overhead_gib * 2**30
    if gpus > 1:  # ZeRO-3: the layers gathered ahead (~2 at a time, 16-bit) and the head for the loss
        overhead += 2 * 2 * shape["layer_linear_parameters"] + 2 * vh
    small = 2 * b * d + 16  # rotary cos and sin (the residual's dtype), position ids and targets (int64)
    work = _layer_working_set(shape, tiled, amp, lean_norm)
    if all_to_all:
        work["all_to_all"] = 2 * 2 * (h + 2 * shape["kv_width"])
    work_bytes = sum(work.values())
    if tiled:  # the MLP's gradients are complete; autocast's fp16 copies of the attention weights are cached
        in_layer = grad * 3 * h * inter / gpus + (2 * attention_linear if amp else 0)
    else:  # the down projection's gradient is complete; fp16 copies of the other weights cached
        in_layer = grad * h * inter / gpus + (2 * (linear - h * inter) if amp else 0)
    head_grad = grad * vh if state else 0.0  # the chunked loss's head gradient, from the loss's forward on
    chunk = chunked_loss.chunk_size(shape["vocab"], 1 << 40, budget_mib=loss_chunk_mib)
    # offload: the block's input copied back, the next one prefetched, and the last block's input, which the
    # offload holds on the GPU from the forward's last copy out until the next step's first (activation_offload.py)
    offloaded = 3 * b * h
    checkpoints_last = offloaded if offload else layers * b * h
    moments = {
        "backward, last block": {
            "fixed": kept + head_grad + in_layer + overhead,
            "terms": {"checkpointed_hidden": checkpoints_last, **work, "small": small}},
        "backward, first block": {
            "fixed": kept + head_grad + grad * (layers - 1) * layer + in_layer + overhead,
            "terms": {"checkpointed_hidden": offloaded if offload else b * h, **work, "small": small}},
        "forward, loss": {  # all checkpoints (offload: the last block's output and one copy in flight), the final
            # norm's saved tensors, the loss's fp32 gradient of the hidden states; autocast's fp16 weight copies,
            # the fp16 head weight, the fp32 head gradient and one chunk's fp16 + fp32 logits
            "fixed": kept + (2 * layers * linear + 2 * vh if amp else 0) + 4 * vh + 6 * chunk * shape["vocab"]
                     + overhead,
            "terms": {"checkpointed_hidden": (2 if offload else layers + 1) * b * h,
                      "final_norm": 0 if lean_norm else 8 * h,
                      "loss_gradient": 4 * h, "small": small}},
        "backward, embedding": {  # all gradients, and the embedding's own gradient and its sum with the head's
            "fixed": kept + grad * params + 2 * grad * vh + overhead,
            "terms": {"gradient": b * h}},
    }
    for m in moments.values():
        m["bytes_per_token"] = sum(m["terms"].values())
    return moments


def memory_model(shape: dict, tokens: int, tiled: bool, offload: bool, tile_tokens: int | None = None,
                 loss_chunk_mib: float = chunked_loss.DEFAULT_CHUNK_MIB, gpus: int = 1, sp: int = 1,
                 state_bytes_per_parameter: float = 16.0, overhead_gib: float = OVERHEAD_GIB,
                 hidden_bytes: int = 4, lean_norm: bool = False) -> dict:
    """Predicted peak bytes per GPU of a training step at ``tokens`` tokens per sequence (``tokens / sp`` on each
    GPU): the largest of memory_moments' fixed + bytes per token x local tokens. state_bytes_per_parameter: GPU bytes
    per parameter at the end of the backward (16: fp32 weights, gradients and AdamW, as bench_train; 4: 16-bit
    weights and gradients with the optimizer in host memory; 0: ZeRO-3 with weights and optimizer in host memory);
    hidden_bytes: 4 for fp32 weights under fp16 autocast (fp32 residual stream), 2 for a 16-bit model."""
    moments = memory_moments(shape, tiled, offload, tile_tokens, loss_chunk_mib, gpus, state_bytes_per_parameter,
                             overhead_gib, hidden_bytes, lean_norm=lean_norm)
    local = math.ceil(tokens / sp)
    name = max(moments, key=lambda k: moments[k]["fixed"] + moments[k]["bytes_per_token"] * local)
    m = moments[name]
    return {"moment": name, "fixed_bytes": m["fixed"], "bytes_per_token": m["bytes_per_token"],
            "peak_bytes": m["fixed"] + m["bytes_per_token"] * local, "terms_per_token": m["terms"],
            "moments": moments}


def variant_memory(features: dict) -> dict:
    """memory_model's keyword arguments for a probe variant: bench_train's fp32 weights under autocast keep 16 bytes
    per parameter on the GPU and an fp32 residual stream; optim_offload keeps 16-bit weights and gradients (4) and a
    16-bit residual stream."""
    state = {"state_bytes_per_parameter": 4.0, "hidden_bytes": 2} if features["optim_offload"] else \
        {"state_bytes_per_parameter": 16.0, "hidden_bytes": 4}
    return {**state, "lean_norm": features.get("lean_norm", False)}


def predicted_max_tokens(shape: dict, cap_gib: float, tiled: bool, offload: bool, **kw) -> int:
    """The longest sequence the memory model fits in ``cap_gib`` GiB per GPU (multiple of 1024 x sp)."""
    sp = kw.pop("sp", 1)
    moments = memory_moments(shape, tiled, offload, **kw)
    tokens = min((cap_gib * 2**30 - m["fixed"]) / m["bytes_per_token"] for m in moments.values()) * sp
    return max(0, int(tokens) // (1024 * sp) * 1024 * sp)


# ---- optimizer state in host memory (optim_offload) --------------------------------------------------------------


def low_precision(device: torch.device) -> torch.dtype:
    """The 16-bit type of the optim_offload variant: bf16 where the GPU computes in it (sm_80+) and on the CPU, fp16
    on a V100 (sm_70), as DeepSpeed's bf16 / fp16 settings would be chosen there."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 8:
        return torch.float16
    return torch.bfloat16


class HostAdamW:
    """AdamW with its state in host memory for a model whose weights and gradients are 16-bit on the GPU (what
    DeepSpeed's offload_optimizer keeps there; the module docstring says what it does not imitate).

    Built from the fp32 model, which it converts to ``dtype``: fp32 master weights, their gradients and AdamW's
    moments on the host; pinned 16-bit staging tensors for the copies (on CUDA). :meth:`step`, after the backward:
    gradients to the host (the GPU's freed), unscaled (fp16: the loss was multiplied by :attr:`scale`), clipped,
    AdamW on the CPU, the updated weights back to the GPU in 16 bits. An fp16 overflow skips the step and halves the
    scale.
    """

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, lr: float = 1e-4, clip: float = 1.0):
        device = next(model.parameters()).device
        pin = device.type == "cuda"
        params = [p for p in model.parameters() if p.requires_grad]
        self.master = [torch.empty(p.shape, dtype=torch.float32, pin_memory=pin).copy_(p.detach()) for p in params]
        for m in self.master:
            m.grad = torch.zeros_like(m)
        model.to(dtype)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.staging = [torch.empty(p.shape, dtype=dtype, pin_memory=pin) for p in self.params]
        self.optimizer = torch.optim.AdamW(self.master, lr=lr, foreach=True)
        self.clip, self.dtype, self.device = clip, dtype, device
        self.scale = 2.0**16 if dtype == torch.float16 else 1.0
        self.skipped = 0

    def step(self) -> bool:
        """One optimizer step from the 16-bit gradients on the model; False when an fp16 overflow skipped it."""
        for p, s in zip(self.params, self.staging):
            if p.grad is None:
                s.zero_()
            else:
                s.copy_(p.grad, non_blocking=True)
            p.grad = None  # the allocator reuses the memory only after the copy, on the same stream
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        grads = [m.grad for m in self.master]
        torch._foreach_copy_(grads, self.staging)
        if self.scale != 1.0:
            torch._foreach_div_(grads, self.scale)
        norm = torch.nn.utils.clip_grad_norm_(self.master, self.clip, foreach=True)
        if not torch.isfinite(norm):
            self.scale /= 2
            self.skipped += 1
            return False
        self.optimizer.step()
        torch._foreach_copy_(self.staging, self.master)
        with torch.no_grad():
            for p, s in zip(self.params, self.staging):
                p.copy_(s, non_blocking=True)
        return True

    def host_bytes(self) -> int:
        """Host memory it holds: master weights and gradients, AdamW's moments, the staging tensors."""
        state = [t for st in self.optimizer.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in [*self.master, *(m.grad for m in self.master), *state,
                                                            *self.staging])


def training_step(model, length: int, vocab: int, device: torch.device):
    """(optimizer, scaler, step) as bench_train.training_step; with optim_offload (a HostAdamW on the model) a step
    without autocast (the weights are 16-bit) whose optimizer step runs on the host."""
    host: HostAdamW | None = getattr(model, "_probe_host_adamw", None)
    if host is None:
        return bench.training_step(model, 1, length, vocab, device)
    ids = torch.randint(0, vocab, (1, length), device=device)

    def step(loss_impl: str):
        if loss_impl == "chunked":
            loss = chunked_loss.causal_lm_loss(model, {"input_ids": ids, "labels": ids})
        else:
            loss = model(input_ids=ids, labels=ids).loss
        (loss * host.scale).backward()
        host.step()
        return loss

    return host, None, step


# ---- attention for the search ------------------------------------------------------------------------------------


def block_local_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers attention function: causal SDPA within blocks of BLOCK tokens (memory of full flash attention,
    work O(tokens x block)); whole rows only."""
    if attention_mask is not None:
        raise ValueError("the long-context probe runs whole rows: attention_mask must be None")
    b, heads, n, d = query.shape
    block = min(BLOCK["tokens"], n)
    pad = -n % block

    def blocks(t):
        t = torch.nn.functional.pad(t, (0, 0, 0, pad))
        return t.reshape(b, t.shape[1], -1, block, d).transpose(1, 2).reshape(-1, t.shape[1], block, d)

    out = torch.nn.functional.scaled_dot_product_attention(blocks(query), blocks(key), blocks(value), is_causal=True,
                                                           scale=scaling, enable_gqa=key.shape[1] != heads)
    out = out.reshape(b, -1, heads, block, d).transpose(1, 2).reshape(b, heads, n + pad, d)[:, :, :n]
    return out.transpose(1, 2), None


BLOCK = {"tokens": 4096}


def register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from volta_train.integrations import hf

    AttentionInterface.register(ATTENTION, block_local_attention)
    AttentionMaskInterface.register(ATTENTION, hf.padding_mask)  # None for unpadded rows: no O(n^2) mask


# ---- search ------------------------------------------------------------------------------------------------------


def probe(model, length: int, steps: int, vocab: int, device: torch.device) -> dict:
    """``steps`` bench_train training steps at ``length`` tokens (batch 1): status and peak memory."""
    optimizer = scaler = None
    if device.type == "cuda":
        bench._cleanup(device)
        torch.cuda.reset_peak_memory_stats(device)
    began = time.perf_counter()
    try:
        optimizer, scaler, step = training_step(model, length, vocab, device)
        for _ in range(steps):
            loss = step("chunked").detach()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        row = {"length": length, "status": "ok", "loss": loss.item()}
    except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
        if not bench._is_oom(e):
            raise
        row = {"length": length, "status": "oom"}
    finally:
        del optimizer, scaler
        model.zero_grad(set_to_none=True)  # after an out-of-memory error mid-step too
    row["seconds"] = round(time.perf_counter() - began, 2)
    if device.type == "cuda":
        row["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        row["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
        bench._cleanup(device)
    return row


def search(model, args, device: torch.device, bar, deadline: float) -> dict:
    """Doubling then bisection; the longest length that trained, the shortest that did not, every probe."""
    good, bad, probes = 0, None, []

    def fits(n: int) -> bool | None:
        if time.perf_counter() > deadline:
            return None
        row = probe(model, n, args.probe_steps, args.vocab, device)
        probes.append(row)
        bar.update(1)
        bar.set_postfix_str(f"{n:,} {row['status']}, bracket [{max(good, n if row['status'] == 'ok' else good):,}, "
                            f"{bad if row['status'] == 'ok' else n}]")
        return row["status"] == "ok"

    n, stopped = args.start, False
    while bad is None:
        ok = fits(n)
        if ok is None:
            stopped = True
            break
        if not ok:
            bad = n
        else:
            good = n
            if n >= args.max_len:
                break
            n = min(2 * n, args.max_len)
    while not stopped and bad is not None and bad - good > args.granularity:
        mid = (good + bad) // 2 // args.granularity * args.granularity
        if mid <= good:
            break
        ok = fits(mid)
        if ok is None:
            stopped = True
        elif ok:
            good = mid
        else:
            bad = mid
    return {"longest": good, "first_fail": bad, "stopped_by_time": stopped, "probes": probes}


def step_time(model, length: int, warmup: int, steps: int, vocab: int, device: torch.device) -> float:
    """Median seconds of ``steps`` synchronised training steps at ``length`` tokens, after ``warmup`` steps."""
    optimizer, scaler, step = training_step(model, length, vocab, device)
    times = []
    for i in range(warmup + steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        began = time.perf_counter()
        step("chunked")
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - began)
    del optimizer, scaler
    model.zero_grad(set_to_none=True)
    return statistics.median(times)


def plot(summaries: list[dict], path: Path) -> None:
    """Longest trained sequence per variant and cap (bars), the first length that failed (x) and the memory model's
    prediction (+); step time against the first variant where measured (a second panel)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(f"{r['variant']}\n{s['memory_gb']:g} GiB", r, s) for s in summaries for r in s["results"]]
    timed = [(label, r, s) for label, r, s in rows if r.get("step_seconds")]
    fig, axes = plt.subplots(1, 2 if timed else 1, figsize=(11 if timed else 7, 4), squeeze=False)
    ax = axes[0][0]
    xs = range(len(rows))
    ax.bar(xs, [r["longest"] for _, r, _ in rows], color="tab:blue", label="longest trained")
    ax.scatter([x for x, (_, r, _) in zip(xs, rows) if r.get("first_fail")],
               [r["first_fail"] for _, r, _ in rows if r.get("first_fail")], marker="x", color="tab:red",
               label="first failing", zorder=3)
    ax.scatter([x for x, (_, r, _) in zip(xs, rows) if r.get("predicted")],
               [r["predicted"] for _, r, _ in rows if r.get("predicted")], marker="+", s=120, color="black",
               label="memory model", zorder=3)
    ax.set_xticks(list(xs), [label for label, _, _ in rows], fontsize=7)
    ax.set_ylabel("tokens per sequence")
    ax.set_title(f"{summaries[0]['model']}, {summaries[0]['device']}", fontsize=9)
    ax.legend(fontsize=7)
    if timed:
        axes[0][1].bar([label for label, _, _ in timed], [r["step_seconds"] for _, r, _ in timed], color="tab:orange")
        axes[0][1].set_ylabel(f"s/step at {timed[0][2]['args']['step_time']:,} tokens")
        axes[0][1].tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama1b", choices=list(bench.LLAMA), help="bench_train's Llama shapes")
    p.add_argument("--vocab", type=int, default=128256, help="vocabulary (Llama-3: 128256)")
    p.add_argument("--memory-gb", type=float, default=32.0, help="CUDA memory cap in GiB (0: none)")
    p.add_argument("--variants", default="baseline,tiled+offload",
                   help=f"comma-separated: baseline or {', '.join(FEATURES)} joined by '+' "
                        f"(e.g. {', '.join(VARIANTS)})")
    p.add_argument("--start", type=int, default=65536, help="first length tried")
    p.add_argument("--max-len", type=int, default=1048576, help="longest length tried")
    p.add_argument("--granularity", type=int, default=8192, help="bisection stops at this bracket (tokens)")
    p.add_argument("--probe-steps", type=int, default=2, help="optimizer steps per probe (2: AdamW state resident)")
    p.add_argument("--tile-tokens", type=int, default=None, help="tiled MLP: tokens per tile (auto: ~256 MiB)")
    p.add_argument("--attention", default="block", choices=["block", "sdpa"],
                   help="block: causal SDPA within --attention-block tokens (same memory); sdpa: full attention")
    p.add_argument("--attention-block", type=int, default=4096)
    p.add_argument("--time-budget-min", type=float, default=7.0, help="start no probe after this many minutes")
    p.add_argument("--step-time", type=int, default=0,
                   help="also time a training step at this many tokens per variant (median of --timed-steps)")
    p.add_argument("--timed-steps", type=int, default=5)
    p.add_argument("--search", action=argparse.BooleanOptionalAction, default=True,
                   help="search the longest sequence (--no-search: step time only)")
    p.add_argument("--smoke", action="store_true", help="CPU, llama-nano, 64-512 tokens: the code path only")
    p.add_argument("--out", default="out/long_context_probe")
    p.add_argument("--replot", nargs="+", metavar="PATH",
                   help="PNG then the long_context_probe.json of earlier runs: one figure of them, nothing run")
    args = p.parse_args(argv)
    if args.replot:
        if len(args.replot) < 2:
            p.error("--replot takes the PNG to write and at least one long_context_probe.json")
        plot([json.loads(Path(f).read_text()) for f in args.replot[1:]], Path(args.replot[0]))
        return {}
    try:
        variants = {v: parse_variant(v) for v in args.variants.split(",")}
    except ValueError as e:
        p.error(str(e))
    if args.smoke:
        args.model, args.vocab, args.start, args.max_len, args.granularity = "llama-nano", 320, 64, 512, 64
        args.memory_gb, args.attention_block, args.tile_tokens = 0.0, 32, 48
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() and not args.smoke \
        else torch.device("cpu")
    BLOCK["tokens"] = args.attention_block
    register_attention()
    attention = ATTENTION if args.attention == "block" else "sdpa"
    bench._set_cap(device, args.memory_gb)
    shape = model_shape(args.model, args.vocab)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    began = time.perf_counter()
    deadline = began + args.time_budget_min * 60
    results = []
    bar = tqdm(desc="long_context_probe", unit="probe")
    for variant, features in variants.items():
        tiled, offload = features["tiled"], features["offload"]
        torch.manual_seed(0)
        model = bench.build(args.model, args.max_len, attention, device, True, args.vocab)
        host = None
        if features["optim_offload"]:
            host = model._probe_host_adamw = HostAdamW(model, low_precision(device))
        tiled_mlp.tile_mlps(model, args.tile_tokens, "on" if tiled else "off")
        if features["lean_norm"]:
            rms_norm.swap_rms_norms(model)
        offloader = activation_offload.enable(model, min_bytes=1 if args.smoke else None) if offload else None
        bar.set_description(f"long_context_probe {variant}")
        found = search(model, args, device, bar, deadline) if args.search else {
            "longest": 0, "first_fail": None, "stopped_by_time": False, "probes": []}
        if args.step_time:
            found["step_seconds"] = step_time(model, args.step_time, 2, args.timed_steps, args.vocab, device)
        cap = args.memory_gb or (torch.cuda.get_device_properties(device).total_memory / 2**30
                                 if device.type == "cuda" else 0.0)
        found.update(variant=variant, tiled_mlp=tiled, activation_offload=offload,
                     optim_offload=features["optim_offload"],
                     weights_dtype=str(host.dtype).removeprefix("torch.") if host else "float32",
                     predicted=predicted_max_tokens(shape, cap, tiled, offload, tile_tokens=args.tile_tokens,
                                                    **variant_memory(features)) if cap else None,
                     offloaded_bytes=offloader.stats.packed_bytes if offloader else 0,
                     host_optimizer_bytes=host.host_bytes() if host else 0,
                     skipped_steps=host.skipped if host else 0)
        results.append(found)
        del model, offloader, host
        bench._cleanup(device)
    bar.close()
    summary = {"device": device_name, "torch": torch.__version__, "model": args.model, "vocab": args.vocab,
               "shape": shape, "memory_gb": args.memory_gb, "attention": attention, "probe_steps": args.probe_steps,
               "seconds": round(time.perf_counter() - began, 1), "args": vars(args), "results": results}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "long_context_probe.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    md = table(summary)
    (out / "long_context_probe.md").write_text(md, encoding="utf-8")
    plot([summary], out / "long_context_probe.png")
    print(md, flush=True)
    return summary


def table(summary: dict) -> str:
    lines = [f"# long_context_probe: {summary['model']} ({summary['shape']['parameters'] / 1e9:.2f} B parameters, "
             f"{summary['vocab']} words), {summary['device']}, cap {summary['memory_gb']:g} GiB", "",
             f"{summary['probe_steps']} training steps per probe (bench_train: fp16 autocast, fp32 AdamW, chunked "
             f"loss, activation checkpointing; optim_offload: 16-bit weights and gradients on the GPU, fp32 master "
             f"weights and AdamW on the host, DeepSpeed offload_optimizer's GPU memory), attention "
             f"{summary['attention']}; predicted = docs/long_context.md's memory model", "",
             *([f"step time: median of {summary['args']['timed_steps']} steps after 2 warm-up steps at "
                f"{summary['args']['step_time']:,} tokens, and its ratio to the first variant's", ""]
               if summary["args"]["step_time"] else []),
             "| variant | longest trained | first failing | peak reserved GiB at longest | predicted | probes | s | "
             "s/step | vs first |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    first = summary["results"][0].get("step_seconds") if summary["results"] else None
    for r in summary["results"]:
        at = next((p for p in r["probes"] if p["length"] == r["longest"] and p["status"] == "ok"), {})
        peak = at.get("peak_reserved_gib")
        lines.append(f"| {r['variant']} | {r['longest']:,}{' (time budget)' if r['stopped_by_time'] else ''} | "
                     f"{'-' if r['first_fail'] is None else format(r['first_fail'], ',')} | "
                     f"{'-' if peak is None else format(peak, '.2f')} | "
                     f"{'-' if r['predicted'] is None else format(r['predicted'], ',')} | {len(r['probes'])} | "
                     f"{sum(p['seconds'] for p in r['probes']):.0f} | "
                     + (f"{r['step_seconds']:.3f} | {r['step_seconds'] / first:.3f} |" if r.get("step_seconds") and first
                        else "- | - |"))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

"""``volta-train bench``: attention speed and accuracy of volta_train against PyTorch's attention on this GPU.

    volta-train bench                               # fwd and bwd, head_dim 64/128, N 1k-16k, causal and not
    volta-train bench --passes fwd --seqlens 4096 --head-dims 64 --causal true
    volta-train bench --baselines sdpa-efficient    # fewer PyTorch backends
    volta-train bench --workload llama3-8b          # a model's attention as it trains (below)

Backends: volta_train's kernel with fp32 and fp16 accumulation (``volta-fp32acc``, ``volta-fp16acc``; for the
backward pass the accumulation named is ``bwd_accum``), and each PyTorch SDPA backend that runs here
(``sdpa-flash``, ``sdpa-efficient``, ``sdpa-cudnn``, ``sdpa-math``) plus plain ``eager`` attention. A backend that
cannot run a case (no kernel for this GPU, out of memory) gets an empty row with the reason.

Speed: FLOPs are counted as forward 4*B*H*N^2*D (two matmuls of 2*N^2*D per head), half of it under a causal
mask, and backward 2.5x the forward (five matmuls, the recomputed QK^T included); TFLOP/s = FLOPs / median time.
Times are medians of ``--repeats`` CUDA-event timings after ``--warmup`` runs, cycling through ``--input-sets``
input sets so the L2 cache does not hold them. Batch x N is kept at ``--tokens`` (16384) and heads x head_dim at
``--hidden`` (2048). The backward timing runs the backward only (each input set's forward graph is built first).

Accuracy: on a slice of each case (the first sequence, ``--accuracy-heads`` heads) every backend's output (fwd)
and dQ/dK/dV (bwd) are compared with volta_train's float64 reference; the table gives the largest absolute error
and the relative error ||x - ref|| / ||ref||.

Workloads (``--workload``): one model's attention as it trains, instead of the grid: ``llama3-8b`` is 32 query and
8 key/value heads of 128, causal, over one packed row of 32,768 and one of 131,072 tokens whose documents
(log-uniform lengths in [1,024, row / 2], seeded) attend only within themselves (``flash_attn_varlen_func``). FLOPs
are the sum over documents of each one's causal count. PyTorch's backends, which have no packed call, run document
by document with K/V expanded to the query heads (what a model without varlen attention does); on a V100,
``sdpa-efficient`` is the CUTLASS Sm70 kernel. The accuracy slice is the first document's first 2,048 tokens, one
key/value group.

Writes ``bench.md`` (environment and table), ``bench.json`` and ``bench.png`` to ``--out``. Needs a CUDA GPU:
on a machine without one it stops with exit status 2 (CPU timings of the reference backend would measure
nothing this benchmark is about). ``scripts/bench_attention.py`` adds the varlen comparison; the tile sweeps are ``lab/tile_sweep.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

import volta_train

from .dispatch import BACKEND_ENV
from .kernels import nvrtc
from .options import AttentionOptions
from .reference import reference_backward, reference_forward

PASSES = ("fwd", "bwd", "fwdbwd")
SDPA_BACKENDS = ("sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "sdpa-math")


def flops(pass_name: str, batch: int, heads: int, sq: int, sk: int, d: int, causal: bool) -> float:
    """FLOPs of one attention call: forward 4*B*H*Nq*Nk*D (half under causal), backward 2.5x the forward."""
    forward = 4.0 * batch * heads * sq * sk * d * (0.5 if causal else 1.0)
    return {"fwd": forward, "bwd": 2.5 * forward, "fwdbwd": 3.5 * forward}[pass_name]


def time_ms(fn, input_sets, warmup: int, repeats: int, burst: int = 1) -> float:
    """Median of ``repeats`` CUDA-event timings of ``fn`` after ``warmup`` calls, cycling through the input sets.

    ``burst`` > 1: each timing spans that many calls queued back to back and is divided by it (the per-call time
    when the host runs ahead of the GPU, as in a decoding loop)."""
    for i in range(warmup):
        fn(*input_sets[i % len(input_sets)])
    torch.cuda.synchronize()
    times = []
    for i in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for j in range(burst):
            fn(*input_sets[(i * burst + j) % len(input_sets)])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / burst)
    return statistics.median(times)


def make_inputs(batch, seqlen, heads, d, sets, requires_grad, device="cuda", dtype=torch.float16):
    out = []
    for _ in range(sets):
        q, k, v = (torch.randn(batch, seqlen, heads, d, device=device, dtype=dtype) for _ in range(3))
        out.append(tuple(t.requires_grad_(requires_grad) for t in (q, k, v)))
    return out


def volta_fn(pass_name, causal, accum):
    """Forward: accum is the forward accumulation; backward passes: the backward's (bwd_accum)."""
    def run(q, k, v):
        if pass_name == "fwd":
            return volta_train.flash_attn_func(q, k, v, causal=causal, accum=accum)
        return volta_train.flash_attn_func(q, k, v, causal=causal, bwd_accum=accum)
    return run


def sdpa_fn(causal, backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
              "sdpa-math": SDPBackend.MATH, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION}[backend]

    def run(q, k, v):
        with sdpa_kernel([chosen]):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=causal).transpose(1, 2)
    return run


def eager_fn(causal):
    def run(q, k, v):
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        s = qt @ kt.transpose(-1, -2) * qt.shape[-1] ** -0.5
        if causal:
            n = s.shape[-1]
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
        return (torch.softmax(s.float(), dim=-1).to(vt.dtype) @ vt).transpose(1, 2)
    return run


def backward_only(forward):
    """Times only the backward: the forward runs once per input set, its graph is kept and differentiated."""
    graphs = {}

    def run(q, k, v):
        if id(q) not in graphs:
            out = forward(q, k, v)
            graphs[id(q)] = (out, torch.randn_like(out))
        out, grad = graphs[id(q)]
        return torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)
    return run


def with_backward(forward):
    def run(q, k, v):
        out = forward(q, k, v)
        return torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    return run


WRAP = {"fwd": lambda f: f, "bwd": backward_only, "fwdbwd": with_backward}


def measure(fn, batch, seqlen, heads, d, pass_name, args):
    """(median ms, peak extra MiB, note); ms None with the reason when the backend cannot run the case."""
    return _measure(fn, lambda: make_inputs(batch, seqlen, heads, d, args.input_sets, pass_name != "fwd"), pass_name,
                    args)


def _measure(fn, build_inputs, pass_name, args):
    """measure() on the input sets ``build_inputs()`` makes (inside the try: they can run out of memory too)."""
    torch.cuda.empty_cache()
    try:
        inputs = build_inputs()
        if pass_name == "bwd":  # build each input set's graph before the memory baseline
            for q, k, v in inputs:
                fn(q, k, v)
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        ms = time_ms(fn, inputs, args.warmup, args.repeats)
    except (RuntimeError, NotImplementedError) as error:  # unsupported backend / out of memory
        return None, None, str(error).splitlines()[0][:100]
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return ms, peak, ""


def accuracy(forward, pass_name, seqlen, heads, d, causal, seed: int = 0, device="cuda") -> dict[str, float]:
    """Errors of ``forward`` (fp16 in) against volta_train's float64 reference on a [1, seqlen, heads, d] slice."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v, dout = (torch.randn(1, seqlen, heads, d, device=device, generator=gen).half() for _ in range(4))
    return _reference_errors(forward, pass_name, q, k, v, dout, causal)


def _reference_errors(forward, pass_name, q, k, v, dout, causal) -> dict[str, float]:
    """Errors of ``forward(q, k, v)`` (out, or dQ/dK/dV for ``dout``) against the float64 reference; the tensors are
    [B, N, H, D], or one packed sequence [N, H, D]."""
    packed = q.dim() == 3
    params = AttentionOptions(softmax_scale=q.shape[-1] ** -0.5, causal=causal)
    q64, k64, v64, dout64 = (t.double()[None] if packed else t.double() for t in (q, k, v, dout))
    with torch.no_grad():
        ref_out, lse = reference_forward(q64, k64, v64, params)
    test_in = [t.clone().requires_grad_(pass_name != "fwd") for t in (q, k, v)]
    out = forward(*test_in)
    if pass_name == "fwd":
        wanted = {"out": ref_out}
        got = {"out": out}
    else:
        with torch.no_grad():
            want = reference_backward(dout64, q64, k64, v64, ref_out, lse, params)
        wanted = dict(zip(("dq", "dk", "dv"), want))
        got = dict(zip(("dq", "dk", "dv"), torch.autograd.grad(out, test_in, dout)))
    return _errors({name: (got[name], w[0] if packed else w) for name, w in wanted.items()})


def _errors(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, float]:
    """Max-abs and relative (norm) error of each (result, float64 reference) pair, and the worst of each."""
    result = {}
    for name, (got_t, want_t) in pairs.items():
        diff = got_t.detach().double() - want_t
        result[f"{name}_max_abs"] = diff.abs().max().item()
        result[f"{name}_rel"] = (diff.norm() / want_t.norm().clamp_min(1e-300)).item()
    result["max_abs"] = max(value for key, value in result.items() if key.endswith("_max_abs"))
    result["rel"] = max(value for key, value in result.items() if key.endswith("_rel"))
    return result


def backends(args, pass_name, causal) -> list[tuple[str, object]]:
    chosen = [(f"volta-{accum}acc", volta_fn(pass_name, causal, accum)) for accum in args.accum]
    for name in args.baselines:
        chosen.append((name, eager_fn(causal) if name == "eager" else sdpa_fn(causal, name)))
    return chosen


def run_benchmark(args) -> list[dict]:
    """One row per (pass, head_dim, seqlen, causal, backend): time, TFLOP/s, memory and, unless off, errors."""
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = lambda x, **_: x  # noqa: E731
    rows = []
    cases = [(p, d, n, c) for p in args.passes for d in args.head_dims for n in args.seqlens for c in args.causal]
    for pass_name, d, n, causal in tqdm(cases, desc="benchmark"):
        heads = args.hidden // d
        batch = max(1, args.tokens // n)
        fl = flops(pass_name, batch, heads, n, n, d, causal)
        for name, forward in backends(args, pass_name, causal):
            row = dict(pass_name=pass_name, backend=name, head_dim=d, seqlen=n, causal=causal, batch=batch,
                       heads=heads, flops=fl, ms=None, tflops=None, peak_mib=None, note="")
            if name == "eager" and batch * heads * n * n * 6 > args.eager_limit_gb * 2**30:
                rows.append(dict(row, note=f"skipped: scores over --eager-limit-gb {args.eager_limit_gb:g}"))
                continue
            ms, peak, note = measure(WRAP[pass_name](forward), batch, n, heads, d, pass_name, args)
            row.update(ms=ms, tflops=(fl / ms / 1e9) if ms else None, peak_mib=peak, note=note)
            if ms and args.accuracy_heads > 0:
                try:
                    row.update(accuracy(forward, pass_name, n, min(heads, args.accuracy_heads), d, causal))
                except (RuntimeError, NotImplementedError) as error:
                    row["note"] = f"accuracy: {str(error).splitlines()[0][:80]}"
            rows.append(row)
    return rows


@dataclass(frozen=True)
class Workload:
    """One model's attention as it trains: causal, GQA, packed documents in one row per length."""

    heads: int
    kv_heads: int
    head_dim: int
    rows: tuple[int, ...]  # tokens of each packed row timed
    shortest_document: int = 1024


WORKLOADS = {"llama3-8b": Workload(heads=32, kv_heads=8, head_dim=128, rows=(32768, 131072))}


def document_lengths(total: int, shortest: int, longest: int, seed: int = 0) -> list[int]:
    """Lengths of the documents packed into a row of ``total`` tokens: log-uniform in [shortest, longest], seeded,
    the last one cut to fill the row."""
    gen = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        u = torch.rand((), generator=gen).item()
        length = int(round(shortest * (longest / shortest) ** u))
        lengths.append(min(length, total - sum(lengths)))
    return lengths


def packed_flops(pass_name: str, lengths: list[int], heads: int, d: int) -> float:
    """FLOPs of causal attention over packed documents: each document's own causal count (flops())."""
    return sum(flops(pass_name, 1, heads, n, n, d, True) for n in lengths)


def packed_fn(backend: str, lengths: list[int], pass_name: str, accum: str = "fp32"):
    """Causal attention over the packed documents ``lengths`` of q [T, H, D], k/v [T, Hkv, D]: volta_train's varlen
    call, or a PyTorch backend document by document with K/V expanded to the query heads."""
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    if backend.startswith("volta-"):
        state: dict = {}

        def run_volta(q, k, v):
            if state.get("device") != q.device:
                state["device"] = q.device
                state["cu"] = torch.tensor(bounds, dtype=torch.int32, device=q.device)
            key = "accum" if pass_name == "fwd" else "bwd_accum"
            return volta_train.flash_attn_varlen_func(q, k, v, state["cu"], state["cu"], max(lengths), max(lengths),
                                                      causal=True, **{key: accum})
        return run_volta
    per_document = eager_fn(True) if backend == "eager" else sdpa_fn(True, backend)

    def run_documents(q, k, v):
        group = q.shape[1] // k.shape[1]
        outs = [per_document(q[None, a:b], k[None, a:b].repeat_interleave(group, dim=2),
                             v[None, a:b].repeat_interleave(group, dim=2))[0] for a, b in zip(bounds, bounds[1:])]
        return torch.cat(outs)
    return run_documents


def packed_accuracy(forward_for, pass_name: str, workload: Workload, length: int, seed: int = 0,
                    device="cuda") -> dict[str, float]:
    """Errors against the float64 reference on one document of ``length`` tokens, one key/value group;
    ``forward_for(lengths)`` builds the backend's call for those packed lengths."""
    group = workload.heads // workload.kv_heads
    gen = torch.Generator(device=device).manual_seed(seed)
    d = workload.head_dim
    q, dout = (torch.randn(length, group, d, device=device, generator=gen).half() for _ in range(2))
    k, v = (torch.randn(length, 1, d, device=device, generator=gen).half() for _ in range(2))
    return _reference_errors(forward_for([length]), pass_name, q, k, v, dout, causal=True)


def run_workload(args) -> list[dict]:
    """One row per (pass, packed row length, backend) of the workload ``args.workload``."""
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = lambda x, **_: x  # noqa: E731
    work = WORKLOADS[args.workload]
    names = [f"volta-{accum}acc" for accum in args.accum] + list(args.baselines)
    rows = []
    for pass_name, total in tqdm([(p, t) for p in args.passes for t in work.rows], desc=args.workload):
        lengths = document_lengths(total, work.shortest_document, total // 2)
        fl = packed_flops(pass_name, lengths, work.heads, work.head_dim)
        for name in names:
            accum = name[len("volta-"):-len("acc")] if name.startswith("volta-") else "fp32"
            row = dict(pass_name=pass_name, backend=name, head_dim=work.head_dim, seqlen=total, causal=True, batch=1,
                       heads=work.heads, kv_heads=work.kv_heads, documents=len(lengths), flops=fl, ms=None,
                       tflops=None, peak_mib=None, note=f"{args.workload}: {len(lengths)} documents")
            scores_bytes = work.heads * max(lengths) ** 2 * 6
            if name == "eager" and scores_bytes > args.eager_limit_gb * 2**30:
                skipped = f"; skipped: scores over --eager-limit-gb {args.eager_limit_gb:g}"
                rows.append(dict(row, note=row["note"] + skipped))
                continue
            fn = WRAP[pass_name](packed_fn(name, lengths, pass_name, accum))
            ms, peak, note = _measure(fn, lambda: _packed_inputs(total, work, args.input_sets, pass_name != "fwd"),
                                      pass_name, args)
            row.update(ms=ms, tflops=(fl / ms / 1e9) if ms else None, peak_mib=peak,
                       note=row["note"] + (f"; {note}" if note else ""))
            if ms and args.accuracy_heads > 0:
                try:
                    row.update(packed_accuracy(lambda ls: packed_fn(name, ls, pass_name, accum), pass_name, work,
                                               min(lengths[0], 2048)))
                except (RuntimeError, NotImplementedError) as error:
                    row["note"] += f"; accuracy: {str(error).splitlines()[0][:80]}"
            rows.append(row)
    return rows


def _packed_inputs(total: int, work: Workload, sets: int, requires_grad: bool) -> list[tuple]:
    """Input sets of one packed row: q [total, heads, D], k/v [total, kv_heads, D], fp16 on the GPU."""
    out = []
    for _ in range(sets):
        q = torch.randn(total, work.heads, work.head_dim, device="cuda", dtype=torch.float16)
        k, v = (torch.randn(total, work.kv_heads, work.head_dim, device="cuda", dtype=torch.float16) for _ in range(2))
        out.append(tuple(t.requires_grad_(requires_grad) for t in (q, k, v)))
    return out


def environment() -> dict[str, str]:
    """What the numbers were measured on."""
    info = {"volta_train": volta_train.__version__, "python": platform.python_version(), "torch": torch.__version__,
            "torch_cuda": str(torch.version.cuda), "cudnn": str(torch.backends.cudnn.version())}
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        info["gpu"] = f"{torch.cuda.get_device_name()} (sm_{major}{minor}), {torch.cuda.device_count()} visible"
        try:
            library = nvrtc.find_nvrtc(10 * major + minor)
            info["nvrtc"] = f"{library.version_string} ({library.path})"
        except Exception as error:  # noqa: BLE001 - report, the kernel rows say what failed
            info["nvrtc"] = f"not found: {error}"
    info[BACKEND_ENV] = os.environ.get(BACKEND_ENV, "")
    return info


def _cell(row: dict, column: str) -> str:
    value = row.get(column)
    if value is None:
        return ""
    if isinstance(value, float):
        if column == "ms":
            return f"{value:.3f}"
        if column in ("tflops", "peak_mib"):
            return f"{value:.1f}" if column == "tflops" else f"{value:.0f}"
        return f"{value:.1e}"
    return str(value)


def markdown(rows: list[dict], args, env: dict[str, str]) -> str:
    columns = ["pass_name", "backend", "head_dim", "seqlen", "causal", "ms", "tflops", "peak_mib", "max_abs", "rel",
               "note"]
    if getattr(args, "workload", None):
        work = WORKLOADS[args.workload]
        shape = (f"workload {args.workload}: {work.heads} query and {work.kv_heads} key/value heads of "
                 f"{work.head_dim}, causal, one packed row of seqlen tokens (documents log-uniform in [{work.shortest_document}, "
                 f"seqlen/2]); FLOPs: the sum over documents of 2*H*L^2*D forward, 2.5x that backward; PyTorch "
                 f"backends document by document with K/V expanded")
        slice_text = "the first document's first 2,048 tokens x one key/value group"
    else:
        shape = (f"FLOPs: forward 4*B*H*N^2*D, backward 2.5x that, half under causal; B*N = {args.tokens}, "
                 f"H = {args.hidden}/head_dim")
        slice_text = f"1 sequence x {args.accuracy_heads} heads"
    lines = ["environment: " + "; ".join(f"{k} {v}" for k, v in env.items() if v), "",
             f"{shape}; median of {args.repeats} CUDA-event timings after {args.warmup} warm-up "
             f"runs over {args.input_sets} input sets; errors (max_abs, rel = ||x-ref||/||ref||, worst of out or "
             f"dQ/dK/dV) against the float64 reference on {slice_text}", "",
             "| " + " | ".join("pass" if c == "pass_name" else c for c in columns) + " |",
             "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(r, c) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def plot_panels(rows: list[dict], path: Path, title: str, panels: list, panel, x: str, y: str, panel_title,
                xlabel: str, ylabel: str) -> Path | None:
    """`y` against `x` (log2 axis), one panel per key of `panels` (the rows whose panel(row) is that key), one line
    per backend; panel_title(key) names a panel. None when `panels` is empty."""
    from matplotlib.figure import Figure

    keys = panels
    if not keys:
        return None
    cols = min(4, len(keys))
    n_rows = (len(keys) + cols - 1) // cols
    fig = Figure(figsize=(4.5 * cols, 3.6 * n_rows))
    axes = fig.subplots(n_rows, cols, squeeze=False).ravel()
    for ax, key in zip(axes, keys):
        for name in sorted({r["backend"] for r in rows}):
            pts = sorted((r[x], r[y]) for r in rows if r["backend"] == name and r.get(y) and panel(r) == key)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_title(panel_title(key))
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in axes[len(keys):]:
        ax.set_visible(False)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def plot(rows: list[dict], path: Path, title: str) -> Path | None:
    """TFLOP/s against N, one panel per (pass, head_dim, causal), one line per backend."""
    panel = lambda r: (r["pass_name"], r["head_dim"], r["causal"])  # noqa: E731
    return plot_panels(rows, path, title, sorted({panel(r) for r in rows}), panel, "seqlen", "tflops",
                       lambda k: f"{k[0]}, head_dim {k[1]}, {'causal' if k[2] else 'full'}", "N (seqlen)", "TFLOP/s")


def _bool(text: str) -> bool:
    value = text.lower()
    if value in ("1", "true", "yes", "causal"):
        return True
    if value in ("0", "false", "no", "full"):
        return False
    raise argparse.ArgumentTypeError(f"--causal takes true or false, not {text!r}")


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--passes", nargs="+", choices=PASSES, default=["fwd", "bwd"],
                        help="fwd, bwd (backward only), fwdbwd (default: fwd bwd)")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--causal", type=_bool, nargs="+", default=[False, True], help="true, false or both")
    parser.add_argument("--accum", nargs="+", default=["fp32", "fp16"], choices=["fp32", "fp16"],
                        help="volta_train accumulation modes to time (fwd: accum, bwd: bwd_accum)")
    parser.add_argument("--baselines", nargs="*", default=["sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "eager"],
                        choices=[*SDPA_BACKENDS, "eager"], help="PyTorch backends to compare with")
    parser.add_argument("--tokens", type=int, default=16384, help="batch * seqlen (default 16384)")
    parser.add_argument("--hidden", type=int, default=2048, help="heads * head_dim (default 2048)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--input-sets", type=int, default=3)
    parser.add_argument("--accuracy-heads", type=int, default=2, help="heads of the accuracy slice (0: no accuracy)")
    parser.add_argument("--eager-limit-gb", type=float, default=24.0, help="skip eager when its scores exceed this")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default=None,
                        help="time one model's attention as it trains (packed causal rows) instead of the grid")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench_out")),
                        help="directory for bench.md, bench.json, bench.png (default: $OUT or bench_out)")
    return parser


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    return add_arguments(parser)


def write_results(rows: list[dict], args, stem: str = "bench") -> str:
    env = environment()
    args.out.mkdir(parents=True, exist_ok=True)
    table = markdown(rows, args, env)
    (args.out / f"{stem}.md").write_text(table + "\n", encoding="utf-8")
    (args.out / f"{stem}.json").write_text(json.dumps({"environment": env, "settings": {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if not callable(v)},
        "rows": rows}, indent=1) + "\n", encoding="utf-8")
    plot(rows, args.out / f"{stem}.png", f"attention on {env.get('gpu', 'CPU')}")
    return table


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    args = build_parser(prog).parse_args(argv)
    if not torch.cuda.is_available():
        print(f"{prog or 'volta-train bench'}: error: needs a CUDA GPU, and torch sees none "
              f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); on CPU volta_train runs its "
              "reference backend, whose speed this benchmark does not measure", file=sys.stderr)
        return 2
    for name, values in (("--head-dims", args.head_dims), ("--seqlens", args.seqlens)):
        if any(v <= 0 for v in values):
            print(f"error: {name} must be positive, got {values}", file=sys.stderr)
            return 2
    os.environ.setdefault(BACKEND_ENV, "kernel")  # a kernel that cannot run says why in its row
    rows = run_workload(args) if args.workload else run_benchmark(args)
    table = write_results(rows, args)
    print(table)
    print(f"wrote {args.out / 'bench.md'}, {args.out / 'bench.json'}, {args.out / 'bench.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

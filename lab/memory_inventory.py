"""What is alive at the peak of a long-context probe training step, measured on the CPU with the probe's own model
code, to check the per-token terms of the memory model in lab/long_context_probe.py.

    PYTHONPATH=. python lab/memory_inventory.py --tokens 1280,2560 --layers 3 --variants baseline,tiled+offload

A TorchDispatchMode sees every tensor an operator creates and follows each storage until it is freed (storages
shared by views count once); the largest sum of live bytes during the second training step (AdamW's state then
exists) is the peak, and its contents are listed by where they were created. The step is the probe's (Llama shape of
bench_train, activation checkpointing, the chunked loss, block-local attention, the variant's features) with two
stand-ins for what a CPU does differently from the GPU the probe runs on:

* autocast runs in bf16 (2 bytes, like the GPU's fp16, and fast on CPUs with bf16 instructions); 16-bit weights are
  bf16 as the probe's optim_offload on sm_80+;
* attention is a function with the memory of CUDA's flash attention, not the CPU's SDPA: the forward saves the
  16-bit q, k, v, the output and an fp32 log-sum-exp per head and token; the backward allocates what flash's does
  (dq, dk, dv, dk and dv over all heads for grouped-query attention, an fp32 dq accumulator, an fp32 row sum) and
  returns arbitrary gradients (only their sizes matter here);
* AdamW is torch's fused one (the probe's on CUDA), without GradScaler (its state is a few scalars).

Fewer layers, tokens and words than the real shape: each storage is listed with its shape, so what grows with the
tokens is read off directly (``n`` in the table) and the rest is checked against the parameter and vocabulary
counts. Writes a markdown table per variant and token count to stdout (and ``--json``).
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import sys
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
# the lean RMSNorm's backward chunk here: fixed, so that its temporaries do not grow with the tokens (as at the real
# scale, where a 64 MiB chunk is 8,192 rows of 2048 against ~10^5 tokens)
LEAN_NORM_CHUNK_ROWS = 64


def _probe():
    spec = importlib.util.spec_from_file_location("long_context_probe", ROOT / "lab" / "long_context_probe.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["long_context_probe"] = module
    spec.loader.exec_module(module)
    return module


class FlashMemory(torch.autograd.Function):
    """Causal attention with CUDA flash attention's memory (module docstring); inputs [b, heads, n, d]."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        with torch.no_grad():
            out = torch.empty(q.shape[0], q.shape[2], q.shape[1], q.shape[3], dtype=q.dtype).transpose(1, 2)
            out.copy_(q)  # the values do not matter, the sizes do
        lse = torch.zeros(q.shape[:3], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        b, heads, n, d = q.shape
        grad = grad.contiguous()
        dq_accum = torch.zeros(b, n, heads, d, dtype=torch.float32)
        softmax_d = torch.zeros(b, heads, n, dtype=torch.float32)
        dq = torch.empty_like(q)
        dk_all = torch.empty(b, heads, n, d, dtype=k.dtype)  # grouped-query: dk, dv per query head, then summed
        dv_all = torch.empty(b, heads, n, d, dtype=v.dtype)
        dq.copy_(dq_accum.transpose(1, 2))
        dk = dk_all.view(b, k.shape[1], heads // k.shape[1], n, d).sum(2)
        dv = dv_all.view(b, v.shape[1], heads // v.shape[1], n, d).sum(2)
        del dq_accum, softmax_d, dk_all, dv_all
        return dq, dk.zero_(), dv.zero_(), None


def flash_memory_sdpa(q, k, v, is_causal=True, scale=None, enable_gqa=False, **_):
    """scaled_dot_product_attention with flash attention's memory; casts as CUDA autocast casts SDPA's inputs."""
    if torch.is_autocast_enabled("cpu"):
        low = torch.get_autocast_dtype("cpu")
        q, k, v = (t.to(low) for t in (q, k, v))
    with torch.autocast("cpu", enabled=False):
        return FlashMemory.apply(q, k, v, scale)


class LiveBytes(TorchDispatchMode):
    """Every storage an operator creates, until freed; the peak of their sum and what was alive at it."""

    def __init__(self, label):
        super().__init__()
        self.live: dict[int, tuple] = {}
        self.total = 0
        self.tokens = 0  # a storage with a dimension of this size grows with the sequence
        self.tile = 0  # ... with the tiled MLP's tile
        self.part = [0, 0, 0]  # live bytes: fixed, growing with the tokens, with the tile
        self.project = (1.0, 1.0)  # token and tile factors to the real scale
        self.token_peaks: dict[str, tuple[float, list, str, list]] = {}  # phase -> (projected, part, op, live)
        self.excluded: set[int] = set()  # storages that live in host memory on a GPU (offloaded, optimizer)
        self.peaks: dict[str, tuple[int, str, list]] = {}  # phase -> (peak bytes, operator, live storages)
        self.label = label  # callable: (phase of the step, where in it)
        self.recording = False

    def track(self, t: torch.Tensor, origin: str) -> None:
        st = t.untyped_storage()
        key, size = st.data_ptr(), st.nbytes()
        if size == 0 or key in self.live or key in self.excluded:
            return
        grows = 1 if self.tokens in t.shape else 2 if self.tile in t.shape else 0
        self.live[key] = (size, origin, tuple(t.shape), str(t.dtype).removeprefix("torch."), self.label()[1], grows)
        self.total += size
        self.part[grows] += size
        weakref.finalize(st, self._free, key)

    def exclude(self, t: torch.Tensor) -> None:
        """t lives in host memory on a GPU: not counted from here on."""
        key = t.untyped_storage().data_ptr()
        self._free(key)
        self.excluded.add(key)
        weakref.finalize(t.untyped_storage(), self.excluded.discard, key)

    def _free(self, key: int) -> None:
        entry = self.live.pop(key, None)
        if entry is not None:
            self.total -= entry[0]
            self.part[entry[-1]] -= entry[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.track(t, func.overloadpacket.__name__)
        if self.recording:
            phase, where = self.label()
            if self.total > self.peaks.get(phase, (-1,))[0]:
                self.peaks[phase] = (self.total, f"{func.overloadpacket.__name__} in {where}", list(self.live.values()))
            projected = self.part[0] + self.part[1] * self.project[0] + self.part[2] * self.project[1]
            if projected > self.token_peaks.get(phase, (-1,))[0]:
                self.token_peaks[phase] = (projected, list(self.part), f"{func.overloadpacket.__name__} in {where}",
                                           list(self.live.values()))
        return out


def run(variant: str, tokens: int, layers: int, vocab: int, chunk_tokens: int, tile_tokens: int,
        project: tuple[int, int] = (0, 0), lean_norm: bool = False) -> dict:
    """Peaks per phase of the second training step; ``project`` (tokens, tile tokens): the moment of each phase
    listed in detail is the one with the most bytes at that scale (the parts growing with the tokens and with the
    tile scaled up), where the peak of the real shape falls. ``lean_norm``: the RMSNorms swapped for
    volta_train/training/rms_norm.py's, its backward over chunks of LEAN_NORM_CHUNK_ROWS rows."""
    probe = _probe()
    from volta_train.training import activation_offload, chunked_loss, rms_norm, tiled_mlp

    features = probe.parse_variant(variant)
    probe.BLOCK["tokens"] = 4096
    probe.register_attention()
    probe.bench.LLAMA["inventory"] = dict(probe.bench.LLAMA["llama1b"], n_layer=layers)
    torch.manual_seed(0)
    device = torch.device("cpu")
    model = probe.bench.build("inventory", tokens, probe.ATTENTION, device, True, vocab)
    host = None
    if features["optim_offload"]:
        host = model._probe_host_adamw = probe.HostAdamW(model, torch.bfloat16)
    tiled_mlp.tile_mlps(model, tile_tokens, "on" if features["tiled"] else "off")
    chunk_bytes = rms_norm.CHUNK_BYTES
    if lean_norm:
        rms_norm.swap_rms_norms(model)
        rms_norm.CHUNK_BYTES = 4 * model.config.hidden_size * LEAN_NORM_CHUNK_ROWS
    mode = LiveBytes(lambda: label())
    mode.tokens, mode.tile = tokens, tile_tokens if features["tiled"] else -1
    mode.project = ((project[0] or tokens) / tokens, (project[1] or tile_tokens) / tile_tokens)
    if features["offload"]:
        offloader = activation_offload.enable(model)
        pack = offloader._pack

        def pack_to_host(t):  # the copy is host memory on a GPU (what stays on the GPU: docs/long_context.md)
            stash = pack(t)
            if not isinstance(stash, torch.Tensor):
                mode.exclude(stash.host)
            return stash

        offloader._pack = pack_to_host
    names = {m: n for n, m in model.named_modules()}
    stack: list[str] = []
    state = {"stage": "forward", "layer": None}

    def pre(m, *_):
        stack.append(names[m] or "model")
        if names[m].startswith("model.layers."):  # (a block's recompute runs its forward: its parts' hooks only)
            state["layer"] = int(names[m].split(".")[2])
        elif names[m] == "lm_head":
            state["layer"] = "loss"

    def post(m, *_):
        stack.pop()

    for m in model.modules():
        m.register_forward_pre_hook(pre)
        m.register_forward_hook(post)

    def label() -> tuple[str, str]:
        node = torch._C._current_autograd_node()
        where = (f"{node.name()} / " if node is not None else "") + (stack[-1] if stack else "-")
        if state["stage"] == "backward" and node is not None and node.name() == "EmbeddingBackward0":
            return "backward embedding", where
        layer = state["layer"]
        if state["stage"] == "forward":
            return ("forward loss" if layer == "loss" else f"forward layer {layer}" if layer is not None
                    else "forward embedding"), where
        if state["stage"] == "backward":
            return ("backward loss and final norm" if layer is None else f"backward layer {layer}"), where
        return state["stage"], where

    ids = torch.randint(0, vocab, (1, tokens))
    budget = chunk_tokens * 4 * vocab / 2**20
    if host is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step():
        state.update(stage="forward", layer=None)
        stack.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=host is None):
            loss = chunked_loss.causal_lm_loss(model, {"input_ids": ids, "labels": ids}, budget_mib=budget)
        state.update(stage="backward", layer=None)
        loss.backward()
        state["stage"] = "optimizer"
        if host is None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        else:
            host.step()

    sdpa = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = flash_memory_sdpa
    try:
        step()  # AdamW's state exists from here on
        with mode:
            for p in model.parameters():
                mode.track(p, "parameter")
            if host is None:
                for s in optimizer.state.values():
                    for name, t in s.items():
                        if t.numel() > 1:
                            mode.track(t, f"adamw {name}")
            mode.recording = True
            step()
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa
        rms_norm.CHUNK_BYTES = chunk_bytes
    def table(live):
        inventory = collections.defaultdict(lambda: [0, 0])
        for size, origin, shape, dtype, created, grows in live:
            shape_text = "x".join("n" if s == tokens else str(s) for s in shape)
            module = created.split(" / ")[-1] if not origin.startswith(("parameter", "adamw")) else ""
            node = created.split(" / ")[0] if " / " in created else ""
            key = (origin, shape_text, dtype, f"{node} {module}".strip())
            inventory[key][0] += 1
            inventory[key][1] += size
        return sorted(([*k, *v] for k, v in inventory.items()), key=lambda r: -r[-1])

    phases = {}
    for phase, (peak, where, live) in mode.peaks.items():
        _, parts, token_where, token_live = mode.token_peaks[phase]
        phases[phase] = {"peak_bytes": peak, "where": where, "inventory": table(live),
                         "token_bytes": parts[1], "tile_bytes": parts[2], "other_bytes_then": parts[0],
                         "token_where": token_where, "token_inventory": table([e for e in token_live if e[-1]])}
    return {"variant": variant, "lean_norm": lean_norm, "tokens": tokens, "layers": layers, "vocab": vocab,
            "chunk_tokens": chunk_tokens, "tile_tokens": tile_tokens,
            "parameters": sum(p.numel() for p in model.parameters()), "phases": phases}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="baseline,tiled+offload,tiled+offload+optim_offload")
    p.add_argument("--tokens", default="1280,2560", help="token counts (comma-separated)")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--vocab", type=int, default=4000)
    p.add_argument("--chunk-tokens", type=int, default=256, help="the chunked loss's tokens per chunk")
    p.add_argument("--tile-tokens", type=int, default=256, help="the tiled MLP's tokens per tile")
    p.add_argument("--project", default="114688,4096",
                   help="tokens,tile tokens of the real run: the moment listed per phase is its peak at that scale")
    p.add_argument("--lean-norm", action="store_true", help="RMSNorms swapped for volta_train's lean RMSNorm")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    results = []
    for variant in args.variants.split(","):
        for n in (int(t) for t in args.tokens.split(",")):
            r = run(variant, n, args.layers, args.vocab, args.chunk_tokens, args.tile_tokens,
                    tuple(int(x) for x in args.project.split(",")), args.lean_norm)
            results.append(r)
            for phase, ph in r["phases"].items():
                lean = ", lean RMSNorm" if args.lean_norm else ""
                print(f"\n## {variant}{lean}, {n} tokens, {args.layers} layers, vocab {args.vocab}, {phase}\n\npeak "
                      f"{ph['peak_bytes']:,} B at {ph['where']}; the peak at --project's scale at "
                      f"{ph['token_where']}: here {ph['token_bytes']:,} B growing with the tokens "
                      f"({ph['token_bytes'] / n:,.0f} per token), {ph['tile_bytes']:,} B with the tile, "
                      f"{ph['other_bytes_then']:,} B other\n\n| created by | shape | dtype | where | count | "
                      "bytes |\n| --- | --- | --- | --- | --- | --- |", flush=True)
                for row in ph["token_inventory"]:
                    print("| " + " | ".join(str(c) for c in row) + " |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    return results


if __name__ == "__main__":
    main()

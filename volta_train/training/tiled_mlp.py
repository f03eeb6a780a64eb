"""Sequence-tiled MLP: a block's MLP run over tiles of the tokens and recomputed per tile in the backward, so that no
[tokens, intermediate] activation exists beyond one tile.

An MLP (and a MoE block, which routes every token on its own) does not mix positions, so its output over a sequence
is the concatenation of its outputs over any split of the tokens. :func:`tile_mlps` replaces the ``forward`` of each
block's MLP with one that runs :class:`_TiledMLP`: the forward computes the tiles without autograd and saves only
the input; the backward recomputes each tile under ``enable_grad`` (same RNG and autocast state as the forward) and
backpropagates it at once, keeping one tile's activations at a time.

Gradients reach the parameters in one of two ways:

* plain parameters (one process, DDP, ZeRO-1/2): they are inputs of the autograd function; each tile's parameter
  gradients come from ``torch.autograd.grad``, are summed here and returned once, so the engine accumulates them
  into ``.grad`` once and gradient hooks (DDP's reducer, ZeRO's reduction) fire once, as without tiling;
* ZeRO-3 parameters (``ds_id``: partitioned between module calls): each tile is backpropagated with
  ``torch.autograd.backward`` into ``.grad`` through the MLP's own sub-module calls, so DeepSpeed's fetch hooks
  gather the weights for the recompute and its pre-/post-backward hooks for the tile's backward; ``ds_grad_is_ready``
  is False for all but the last tile, which is DeepSpeed's switch for a computation split in a loop: it reduces the
  gradient once, after the last tile has added its share.

With gradient checkpointing the tiled forward runs inside the checkpointed block. The input is saved (by an identity
function before the tiled one) before the MLP computes, so the non-reentrant checkpoint's recompute, which stops
once the last tensor the block saved is saved again, ends before the MLP when nothing after the MLP in the block
saves a tensor (Llama, GPT-2, MoE blocks): the tiles' recompute in this backward is then the MLP's only one. Where
something after it does (Gemma2/3's post_feedforward_layernorm) and under the reentrant checkpoint, the recompute
runs the tiled forward in full and the tiles are recomputed once more here. Dropout
inside an MLP draws per tile, so it gives other masks than the untiled module (the same ones in the forward and its
recompute); equality with the untiled MLP holds without dropout.
"""

from __future__ import annotations

import logging
import math
import types
from dataclasses import dataclass
from typing import Callable

import torch

log = logging.getLogger(__name__)

MODES = ("auto", "on", "off")
# auto: tile when one sequence's untiled MLP activations, ~4 tensors of [tokens, intermediate] in 16-bit
# (BYTES_PER_TOKEN_AND_WIDTH bytes per token and unit of intermediate width), reach AUTO_MIN_BYTES. Below that the
# MLP's working set is small next to the checkpointed hidden states and the weights, and the extra MLP forward in the
# backward (~1/4 of the MLP's step FLOPs with checkpointing) buys little.
BYTES_PER_TOKEN_AND_WIDTH = 8
AUTO_MIN_BYTES = 2 * 2**30
# auto tile length: about this many bytes of MLP activations per tile, in multiples of TILE_QUANTUM tokens
TILE_BYTES = 256 * 2**20
TILE_QUANTUM = 256
MIN_TILE_TOKENS = 1024

# Two sets of projection names that mark a module as an MLP (a block's feed-forward part).
_PROJECTIONS = (("gate_proj", "up_proj", "down_proj"), ("c_fc", "c_proj"), ("fc1", "fc2"), ("w1", "w2"),
                ("dense_h_to_4h", "dense_4h_to_h"), ("lin1", "lin2"), ("Wi", "Wo"))
_ATTR = "_volta_tiled_mlp"


class TiledMLPError(ValueError):
    """A model or an option that the tiled MLP cannot serve."""


@dataclass
class _Tiling:
    """What tile_mlps changed on one module: the attribute replaced, its original value, the tile length."""
    attr: str
    original: Callable
    tile_tokens: int


def intermediate_size(config) -> int | None:
    """The MLP width of a transformers config (GPT-2's n_inner, else 4 x n_embd), or None if it has none."""
    for name in ("intermediate_size", "n_inner", "ffn_dim", "d_ff"):
        value = getattr(config, name, None)
        if value:
            return int(value)
    width = getattr(config, "n_embd", None)
    return 4 * width if width and getattr(config, "model_type", "") in ("gpt2", "gpt_bigcode") else None


def auto_tile_tokens(intermediate: int) -> int:
    """Tokens per tile for an MLP ``intermediate`` wide: about TILE_BYTES of activations, at least MIN_TILE_TOKENS."""
    tokens = TILE_BYTES // max(1, intermediate * BYTES_PER_TOKEN_AND_WIDTH)
    return max(MIN_TILE_TOKENS, tokens // TILE_QUANTUM * TILE_QUANTUM)


def auto_min_tokens(intermediate: int) -> int:
    """The sequence length (tokens per process) from which ``auto`` tiles an MLP ``intermediate`` wide."""
    return math.ceil(AUTO_MIN_BYTES / (intermediate * BYTES_PER_TOKEN_AND_WIDTH))


def resolve(mode: str, model, tokens: int | None) -> tuple[bool, str]:
    """(tile?, one-line reason) for ``mode`` on ``model`` with ``tokens`` tokens per sequence and process."""
    if mode not in MODES:
        raise TiledMLPError(f"tiled_mlp must be one of {', '.join(MODES)}, got {mode!r}")
    if mode != "auto":
        return mode == "on", f"tiled MLP {mode}"
    width = intermediate_size(model.config)
    if width is None:
        return False, "tiled MLP auto -> off (the model config gives no MLP width)"
    if tokens is None:
        raise TiledMLPError("tiled_mlp auto needs the tokens per sequence (tokens=...) to decide")
    threshold = auto_min_tokens(width)
    on = tokens >= threshold
    return on, (f"tiled MLP auto -> {'on' if on else 'off'} ({tokens:,} tokens per sequence and process, "
                f"threshold {threshold:,} for MLP width {width})")


def tile_mlps(model: torch.nn.Module, tile_tokens: int | None = None, mode: str = "on",
              tokens: int | None = None) -> list[str]:
    """Run every block's MLP of ``model`` over tiles of ``tile_tokens`` tokens (None: from the MLP width, about
    256 MiB of activations a tile). ``mode``: "on", "off" (undo an earlier call) or "auto" (on when ``tokens``, the
    tokens per sequence and process, reach :func:`auto_min_tokens`). Returns the names of the tiled modules.

    Call it after building the model and before wrapping it (DeepSpeed, DDP); gradient checkpointing may be
    enabled before or after. Raises TiledMLPError when ``mode`` is "on" and the model has no MLP this can tile,
    or has a MoE block it cannot tile (router logits returned or recorded, router noise on the input).
    """
    if tile_tokens is not None and (isinstance(tile_tokens, bool) or not isinstance(tile_tokens, int)
                                    or tile_tokens <= 0):
        raise TiledMLPError(f"tile_tokens must be a positive int (or None: auto), got {tile_tokens!r}")
    on, _ = resolve(mode, model, tokens)
    if not on:
        return untile_mlps(model)
    targets = find_mlps(model)
    if not targets:
        raise TiledMLPError(f"tiled_mlp on: found no MLP to tile in {type(model).__name__} (looked for modules named "
                            "*MLP, MoE blocks, and gate/up/down, c_fc/c_proj, fc1/fc2 projections); use off")
    width = intermediate_size(getattr(model, "config", None)) or 4096
    tile = tile_tokens or auto_tile_tokens(width)
    names = []
    for name, module, attr in targets:
        _check_moe(model, name, module)
        previous = getattr(module, _ATTR, None)
        original = previous.original if previous else getattr(module, attr)
        setattr(module, attr, types.MethodType(_tiled_call(original, tile), module))
        setattr(module, _ATTR, _Tiling(attr, original, tile))
        names.append(name)
    return names


def untile_mlps(model: torch.nn.Module) -> list[str]:
    """Undo :func:`tile_mlps`; returns the names of the modules restored."""
    names = []
    for name, module in model.named_modules():
        tiling = getattr(module, _ATTR, None)
        if tiling is not None:
            if getattr(type(module), tiling.attr, None) is getattr(tiling.original, "__func__", None):
                delattr(module, tiling.attr)  # the class's own method again
            else:
                setattr(module, tiling.attr, tiling.original)
            delattr(module, _ATTR)
            names.append(name)
    return names


def find_mlps(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str]]:
    """(name, module, attribute to tile) of every outermost MLP or MoE block: a module named *MLP / *Moe*Block /
    *MoE, or holding a known pair of projections (and no attention); BERT-style layers, whose feed-forward is
    their ``feed_forward_chunk`` method over two sub-modules (intermediate, output), by that method."""
    found = []

    def walk(prefix: str, module: torch.nn.Module) -> None:
        for child_name, child in module.named_children():
            name = f"{prefix}.{child_name}" if prefix else child_name
            if _is_mlp(child) or _is_moe(child):
                found.append((name, child, "forward"))
            elif callable(getattr(child, "feed_forward_chunk", None)) and hasattr(child, "intermediate") \
                    and hasattr(child, "output"):
                found.append((name, child, "feed_forward_chunk"))
            else:
                walk(name, child)

    walk("", model)
    return found


def _has_attention(module: torch.nn.Module) -> bool:
    return any("attention" in type(m).__name__.lower() or "attn" in type(m).__name__.lower()
               for m in module.modules())


def _is_mlp(module: torch.nn.Module) -> bool:
    name = type(module).__name__
    if _has_attention(module):
        return False
    return name.lower().endswith("mlp") or any(all(hasattr(module, a) for a in pair) for pair in _PROJECTIONS)


def _is_moe(module: torch.nn.Module) -> bool:
    name = type(module).__name__.lower()
    if _has_attention(module):
        return False
    return name.endswith(("moeblock", "moe", "moelayer")) or (
        hasattr(module, "experts") and (hasattr(module, "gate") or hasattr(module, "router")))


def _check_moe(model, name: str, module: torch.nn.Module) -> None:
    if not _is_moe(module):
        return
    config = getattr(model, "config", None)
    if getattr(config, "output_router_logits", False):
        raise TiledMLPError(f"tiled_mlp: {name} ({type(module).__name__}) is a MoE block and the model records router "
                            "logits (output_router_logits: the auxiliary loss), which the tiled forward and its "
                            "recompute would record once per tile; set output_router_logits False or tiled_mlp off")
    if getattr(module, "jitter_noise", 0) or getattr(module, "router_jitter_noise", 0):
        raise TiledMLPError(f"tiled_mlp: {name} ({type(module).__name__}) multiplies its input by router noise in "
                            "place, which would change the input saved for the backward; set router_jitter_noise 0 "
                            "or tiled_mlp off")


def _tiled_call(original: Callable, tile: int) -> Callable:
    """The replacement method: tiles when the input is longer than one tile, else the original call."""

    def call(self, x):  # one argument, as the modules' forward (BERT's chunking helper counts them)
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            raise TiledMLPError(f"tiled {type(self).__name__}: expected one tensor [..., tokens, hidden], got "
                                f"{type(x).__name__} {tuple(getattr(x, 'shape', ()))}")
        tokens = x.numel() // x.shape[-1]
        if tokens <= tile:
            return original(x)
        params = [p for p in self.parameters() if p.requires_grad]
        if not torch.is_grad_enabled() or not (x.requires_grad or params):
            with torch.no_grad():
                return _forward_tiles(original, x, tile)
        link = _Link() if x.requires_grad else None  # no input that requires grad: _SaveInput would not save
        if link is not None:
            x = _SaveInput.apply(x, link)
        if any(hasattr(p, "ds_id") for p in params):  # ZeRO-3: gradients go to .grad tile by tile (module docstring)
            if link is None:
                return original(x)  # the function's output needs an input that requires grad to get a backward
            return _TiledMLP.apply(original, tile, params, link, x)
        return _TiledMLP.apply(original, tile, None, link, x, *params)

    return call


def _token_view(x: torch.Tensor) -> torch.Tensor:
    """x as [1, tokens, hidden] (3-D and more) or [tokens, hidden] (2-D): positions flattened, tiles on dim -2."""
    return x.reshape(1, -1, x.shape[-1]) if x.dim() >= 3 else x


def _check_output(y, x_tile: torch.Tensor, run: Callable) -> torch.Tensor:
    if not isinstance(y, torch.Tensor):
        raise TiledMLPError(f"tiled MLP: {getattr(run, '__qualname__', run)} returned {type(y).__name__}, not one "
                            "tensor (a MoE block returning router logits, as transformers < 5 does); update "
                            "transformers or set tiled_mlp off")
    if y.shape[:-1] != x_tile.shape[:-1]:
        raise TiledMLPError(f"tiled MLP: {getattr(run, '__qualname__', run)} maps {tuple(x_tile.shape)} to "
                            f"{tuple(y.shape)}; a tiled module must keep the token dimensions")
    return y


def _forward_tiles(run: Callable, x: torch.Tensor, tile: int) -> torch.Tensor:
    """run over tiles of x's tokens, written into one output (no list of tiles plus a concatenated copy)."""
    flat = _token_view(x)
    n = flat.shape[-2]
    out = None
    for start in range(0, n, tile):
        piece = flat[..., start:start + tile, :]
        y = _check_output(run(piece), piece, run)
        if out is None:
            out = y.new_empty(*flat.shape[:-1], y.shape[-1])
        out[..., start:start + tile, :] = y
    return out.reshape(*x.shape[:-1], out.shape[-1])


class _RngAndAutocast:
    """The CPU (and the input's CUDA device's) RNG state and the autocast state at the forward, to replay the tiles
    with the same dropout masks and the same precision in the backward."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        kind = device.type
        self.autocast = (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)) \
            if torch.amp.is_autocast_available(kind) else None

    def replay(self):
        """A context: the forward's RNG state (restored afterwards) and autocast state."""
        import contextlib

        stack = contextlib.ExitStack()
        devices = [self.device] if self.cuda_rng is not None else []
        stack.enter_context(torch.random.fork_rng(devices=devices))
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state(self.cuda_rng, self.device)
        if self.autocast is not None:
            kind, enabled, dtype = self.autocast
            stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled))
        return stack


class _Link:
    """Hands _SaveInput's context (which holds the saved input) to the _TiledMLP call that follows it."""

    __slots__ = ("ctx",)

    def __init__(self):
        self.ctx = None


class _SaveInput(torch.autograd.Function):
    """Identity that saves its input for the _TiledMLP call after it (see _TiledMLP)."""

    @staticmethod
    def forward(ctx, x, link):
        ctx.save_for_backward(x)
        link.ctx = ctx
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _TiledMLP(torch.autograd.Function):
    """y = run(x), computed and backpropagated over tiles of x's tokens.

    apply(run, tile, zero3_params, link, x, *params): ``params`` (plain parameters) get their gradients returned;
    ``zero3_params`` (ZeRO-3 parameters, not inputs) get them through ``.grad`` tile by tile.

    The input is saved by the :class:`_SaveInput` call just before this one (``link``), not here: a custom function's
    tensors are saved when its forward returns, so a checkpoint's recompute, which stops as soon as the last tensor
    the forward saved is saved again (non-reentrant checkpoint's early stop), would otherwise run the whole tiled
    forward only to save x and discard the output. Saved before the computation, x can be that last tensor (when
    nothing later in the checkpointed block saves one, as in Llama's or GPT-2's block) and the recompute ends before
    the MLP: the MLP then runs twice per step (forward, this backward), as an untiled MLP under checkpointing does.
    When a later operation saves a tensor (Gemma2/3's post_feedforward_layernorm saves the MLP output) the recompute
    runs this forward in full, as it must, and the MLP runs three times. ``link`` None (x needs no gradient):
    x is saved here.
    """

    @staticmethod
    def forward(ctx, run, tile, zero3_params, link, x, *params):
        ctx.run, ctx.tile, ctx.zero3_params, ctx.link = run, tile, zero3_params, link
        ctx.state = _RngAndAutocast(x.device)
        ctx.params = params  # parameters are leaves: held, not saved (nothing to recompute or offload)
        if link is None:
            ctx.save_for_backward(x)
        return _forward_tiles(run, x.detach(), tile)  # no autograd inside: plain tensors for the tiles

    @staticmethod
    def backward(ctx, grad_out):
        # unpacked once: a checkpoint hands each recomputed tensor out once (and recomputes the block here if needed)
        (x,) = ctx.link.ctx.saved_tensors if ctx.link is not None else ctx.saved_tensors
        params, zero3 = ctx.params, ctx.zero3_params
        wants_x = ctx.needs_input_grad[4]
        wanted = [i for i, p in enumerate(params) if ctx.needs_input_grad[5 + i]]
        flat_x, flat_g = _token_view(x.detach()), grad_out.reshape(*_token_view(x).shape[:-1], grad_out.shape[-1])
        grad_x = torch.empty_like(flat_x) if wants_x else None
        sums: list[torch.Tensor | None] = [None] * len(params)
        n = flat_x.shape[-2]
        starts = list(range(0, n, ctx.tile))
        with ctx.state.replay():
            for k, start in enumerate(starts):
                piece = flat_x[..., start:start + ctx.tile, :].detach().requires_grad_(wants_x)
                with torch.enable_grad():
                    y = ctx.run(piece)
                g = flat_g[..., start:start + ctx.tile, :]
                if zero3 is not None:
                    last = k == len(starts) - 1
                    for p in zero3:
                        p.ds_grad_is_ready = last
                    torch.autograd.backward(y, g)
                    if wants_x:
                        grad_x[..., start:start + ctx.tile, :] = piece.grad
                    continue
                inputs = ([piece] if wants_x else []) + [params[i] for i in wanted]
                grads = torch.autograd.grad(y, inputs, g, allow_unused=True)
                if wants_x:
                    grad_x[..., start:start + ctx.tile, :] = grads[0]
                for i, grad in zip(wanted, grads[1:] if wants_x else grads):
                    if grad is not None:
                        sums[i] = grad if sums[i] is None else sums[i].add_(grad)
        if zero3 is not None:
            for p in zero3:
                p.ds_grad_is_ready = True
        grad_x = grad_x.reshape(x.shape) if wants_x else None
        return (None, None, None, None, grad_x, *sums)


def configure(model: torch.nn.Module, mode: str, tokens: int | None, tile_tokens: int | None = None) -> list[str]:
    """The recipes' ``tiled_mlp`` option: :func:`tile_mlps` as ``mode`` resolves for ``tokens`` tokens per sequence
    and process, with one log line; "auto" on a model with nothing to tile stays off instead of failing."""
    on, why = resolve(mode, model, tokens)
    if on and mode == "auto" and not find_mlps(model):
        on, why = False, f"tiled MLP auto -> off (no MLP to tile in {type(model).__name__})"
    if not on:
        untile_mlps(model)
        log.info("%s", why)
        return []
    names = tile_mlps(model, tile_tokens, "on")
    log.info("%s: %d MLP modules over tiles of %s tokens", why, len(names),
             f"{getattr(model.get_submodule(names[0]), _ATTR).tile_tokens:,}")
    return names

"""Sequence-tiled MLP: a block's MLP run over tiles of the tokens and recomputed per tile in the backward, so that no
[tokens, intermediate] activation exists beyond one tile.

An MLP (and a MoE block, which routes every token on its own) does not mix positions, so its output over a sequence
is the concatenation of its outputs over any split of the tokens. :func:`tile_mlps` replaces the ``forward`` of each
block's MLP with one that runs each tile of the tokens as a non-reentrant ``torch.utils.checkpoint`` of its own:

* the forward computes the tiles one at a time with autograd recording, the tile's saved tensors discarded by its
  checkpoint, and writes them into one output; the MLP's input is saved once, by an identity function
  (:class:`_SaveInput`) *before* the tiles run;
* the backward reaches the tiles from the last to the first (the autograd engine runs a tile's nodes, all created
  after the previous tile's, before that tile's); each tile's checkpoint recomputes the tile from its rows of the
  saved input and stops, as non-reentrant checkpoints do, once the last tensor the tile saved is saved again: before
  the MLP's last matmul, as an untiled MLP's recompute under activation checkpointing stops;
* parameter gradients are accumulated by the autograd engine over the tiles, as for a module called once per tile,
  so gradient hooks (DDP's reducer, ZeRO's reduction) fire once; under ZeRO-3 the recompute calls the MLP's own
  sub-modules, so DeepSpeed's hooks gather the weights for each tile.

Inside an activation-checkpointed block, the input is the block's only tensor this saves in the block's checkpoint
(the tiles' checkpoints take their inputs from a Python object, and run under identity saved-tensor hooks), and it is
saved before the MLP computes. The block's recompute, which stops once the last tensor the block saved is saved
again, therefore ends before the MLP where nothing after the MLP in the block saves a tensor (Llama, GPT-2, MoE
blocks): the tiles' recompute is then the MLP's only recompute and a step does the MLP work of an untiled step.
Where something after the MLP saves a tensor (Gemma2/3's post_feedforward_layernorm needs the MLP output) the
block's recompute runs the tiled forward in full, and each tile is recomputed once more in the backward; the
reentrant checkpoint always recomputes the whole block (docs/long_context.md, "Cost").

An input that needs no gradient (layers below frozen) cannot be saved that way; :class:`_TiledMLP` then saves it
itself and recomputes each tile in its backward (a ZeRO-3 module runs untiled there).

The tiles' checkpoints restore the RNG and autocast state of the forward, so dropout inside an MLP draws the same
masks in a tile's forward and its recompute, but per tile: other masks than the untiled module; equality with the
untiled MLP holds without dropout.
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
# MLP's working set is small next to the checkpointed hidden states and the weights, and what tiling costs (a
# checkpoint call per tile; without non-reentrant checkpointing, a recompute of the MLP) buys little.
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
        if x.requires_grad:
            return _checkpointed_tiles(original, tile, x)
        if any(hasattr(p, "ds_id") for p in params):
            return original(x)  # ZeRO-3 without an input gradient: _TiledMLP's parameter inputs would be partitioned
        return _TiledMLP.apply(original, tile, x, *params)

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
    """Hands _SaveInput's context, which holds the saved input, to the tiles' recomputes."""

    __slots__ = ("ctx",)

    def __init__(self):
        self.ctx = None


class _SaveInput(torch.autograd.Function):
    """Identity that saves its input for the tiles' recomputes (module docstring): a custom function's tensors are
    saved when its forward returns, so this saves x before any tile computes."""

    @staticmethod
    def forward(ctx, x, link):
        ctx.save_for_backward(x)
        link.ctx = ctx
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Tiles:
    """The tiles of one tiled call. In its forward (and in the recompute of an enclosing checkpoint, which runs the
    call anew) each tile reads its rows from ``pieces``, views of the input in the autograd graph; in the backward,
    each tile's recompute reads them from the input _SaveInput saved, unpacked once for all tiles (an enclosing
    checkpoint hands a tensor out once) and released when the last tile has read its rows."""

    __slots__ = ("link", "tile", "pieces", "saved", "taken", "wants_x")

    def __init__(self, link: _Link, tile: int, pieces: tuple[torch.Tensor, ...], wants_x: bool):
        self.link, self.tile, self.pieces, self.wants_x = link, tile, pieces, wants_x
        self.saved: tuple[torch.Tensor, ...] | None = None
        self.taken = 0

    def piece(self, k: int) -> torch.Tensor:
        if self.pieces is not None:
            return self.pieces[k]
        if self.saved is None:
            (x,) = self.link.ctx.saved_tensors
            self.saved, self.taken = torch.split(_token_view(x.detach()), self.tile, dim=-2), 0
        piece = self.saved[k].detach().requires_grad_(self.wants_x)  # as in the forward: the same tensors saved
        self.taken += 1
        if self.taken == len(self.saved):
            self.saved = None
        return piece


def _run_tile(run: Callable, tiles: _Tiles, k: int, device_marker: torch.Tensor) -> torch.Tensor:
    return run(tiles.piece(k))


def _same(t):
    return t


class _Place(torch.autograd.Function):
    """out[..., start:start + rows, :] = y, in place; the backward hands out's gradient on and y its rows."""

    @staticmethod
    def forward(ctx, out, y, start):
        ctx.start, ctx.rows = start, y.shape[-2]
        out[..., start:start + ctx.rows, :] = y
        ctx.mark_dirty(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, grad[..., ctx.start:ctx.start + ctx.rows, :], None


def _checkpointed_tiles(run: Callable, tile: int, x: torch.Tensor) -> torch.Tensor:
    """run over tiles of x's tokens, each tile a non-reentrant checkpoint of its own (module docstring)."""
    from torch.utils.checkpoint import checkpoint

    link = _Link()
    x = _SaveInput.apply(x, link)
    flat = _token_view(x)
    tiles = _Tiles(link, tile, torch.split(flat, tile, dim=-2), x.requires_grad)
    # an empty tensor on x's device among the checkpoint's inputs: checkpoint stashes (and restores for the
    # recompute) the RNG state of its inputs' devices, CUDA's included (dropout in the MLP)
    marker = x.new_empty(0)
    out, start = None, 0
    for k, piece in enumerate(tiles.pieces):
        # identity hooks: what the tile's checkpoint saves of its own (the marker; older torch: a dummy) stays out of
        # an enclosing checkpoint, whose recompute must stop at _SaveInput
        with torch.autograd.graph.saved_tensors_hooks(_same, _same):
            y = checkpoint(_run_tile, run, tiles, k, marker, use_reentrant=False)
        y = _check_output(y, piece, run)
        if out is None:
            out = y.new_empty(*flat.shape[:-1], y.shape[-1])
        out = _Place.apply(out, y, start)
        start += piece.shape[-2]
    tiles.pieces = None  # the views would hold the input until the backward; the recomputes read the saved one
    return out.reshape(*x.shape[:-1], out.shape[-1])


class _TiledMLP(torch.autograd.Function):
    """y = run(x) over tiles of x's tokens for an input that needs no gradient (module docstring): the forward
    without autograd, saving x; the backward recomputes each tile (the forward's RNG and autocast state) and returns
    the parameters' gradients summed over the tiles. apply(run, tile, x, *params)."""

    @staticmethod
    def forward(ctx, run, tile, x, *params):
        ctx.run, ctx.tile = run, tile
        ctx.state = _RngAndAutocast(x.device)
        ctx.params = params  # parameters are leaves: held, not saved (nothing to recompute or offload)
        ctx.save_for_backward(x)
        return _forward_tiles(run, x.detach(), tile)

    @staticmethod
    def backward(ctx, grad_out):
        (x,), params = ctx.saved_tensors, ctx.params
        wanted = [i for i, p in enumerate(params) if ctx.needs_input_grad[3 + i]]
        flat_x, flat_g = _token_view(x.detach()), grad_out.reshape(*_token_view(x).shape[:-1], grad_out.shape[-1])
        sums: list[torch.Tensor | None] = [None] * len(params)
        with ctx.state.replay():
            for start in range(0, flat_x.shape[-2], ctx.tile):
                with torch.enable_grad():
                    y = ctx.run(flat_x[..., start:start + ctx.tile, :])
                grads = torch.autograd.grad(y, [params[i] for i in wanted], flat_g[..., start:start + ctx.tile, :],
                                            allow_unused=True)
                for i, grad in zip(wanted, grads):
                    if grad is not None:
                        sums[i] = grad if sums[i] is None else sums[i].add_(grad)
        return (None, None, None, *sums)


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

"""Activation-checkpoint offload: the inputs that activation checkpointing keeps of every block (the hidden states
between blocks) live in host memory between the forward and the backward.

:func:`enable` wraps each checkpointed block's checkpoint call (transformers' ``_gradient_checkpointing_func``) in
``torch.autograd.graph.saved_tensors_hooks``. torch.utils.checkpoint saves the block's tensor inputs through the
hooks active around the call, while the block's own saved tensors go to the checkpoint's inner hooks, so only the
checkpoint inputs pass through these: nothing inside a block is moved.

On CUDA (not exercised by the CPU tests):

* pack: the input is copied into pinned host memory on a side stream, after the compute stream's work up to that
  point (an event), so the copy overlaps the next blocks' forward; the GPU tensor is held until its copy has finished
  and released at a later pack (or returned directly if the backward reaches it first: the last block). The host
  buffers come from :class:`PinnedPool`: exact sizes (PyTorch's pinned allocator rounds each to a power of two and
  keeps every size it has seen), reused by the next step;
* unpack (the checkpoint's recompute in the backward): the block's input is copied back on the side stream unless it
  was prefetched, and the block before it (the next one the backward needs) is prefetched, so the host-to-device
  copy of one block overlaps the recompute and backward of the one after it; the compute stream waits on the copy's
  event before it uses the tensor.

On CPU the same bookkeeping runs (the host copy is a clone, prefetches are recorded, the original tensor is dropped)
without streams, events or pinning: the CPU tests check the bookkeeping and that losses and gradients are bitwise
those without offload, not the overlap.
"""

from __future__ import annotations

import functools
import logging
import mmap
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

MIN_BYTES = 1 << 20  # smaller checkpoint inputs (masks, position ids) stay where they are
_ATTR = "_volta_activation_offload"


class ActivationOffloadError(ValueError):
    """A model that activation offload cannot serve."""


@dataclass
class OffloadStats:
    """Counts since the offload was created: tensors moved to host memory and back."""
    packed: int = 0  # checkpoint inputs copied to host memory
    packed_bytes: int = 0
    kept: int = 0  # checkpoint inputs left where they were (small, or parameters)
    unpacked: int = 0  # inputs handed back to a recompute
    prefetched: int = 0  # host-to-device copies started a block ahead
    prefetch_hits: int = 0  # unpacks that found their input prefetched
    direct: int = 0  # unpacks served by the device tensor still held (its copy out not yet released)


def _page_aligned(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor over its own anonymous mapping: whole pages that no other allocation shares, since CUDA
    registers host memory by pages and refuses a page registered twice (two heap allocations can share one)."""
    return torch.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=torch.uint8, count=nbytes)


def _register(buf: torch.Tensor) -> None:
    err = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 1))  # 1: portable
    if err:
        raise RuntimeError(f"activation offload: cudaHostRegister of {buf.numel():,} bytes failed (CUDA error {err}); "
                           "the host may be out of memory or the process's locked-memory limit (ulimit -l) too low")


def _unregister(buf: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())


class PinnedPool:
    """Page-locked host buffers of exactly the sizes asked for, kept for reuse: a buffer returns to the pool when the
    stash that used it is freed, and a request that finds no free buffer of its size first releases the free
    buffers of sizes this step has not asked for (a change of sequence length), so the pool holds about one step's
    worth. ``register``/``unregister`` page-lock and unlock a uint8 CPU tensor (CUDA's host registration);
    ``drain`` waits for the copies that may still read or write the buffers (the offload's side stream) and runs
    before any buffer is unlocked and freed."""

    def __init__(self, register: Callable[[torch.Tensor], None] = _register,
                 unregister: Callable[[torch.Tensor], None] = _unregister,
                 drain: Callable[[], None] = lambda: None):
        self._register, self._unregister, self._drain = register, unregister, drain
        self._free: dict[int, list[torch.Tensor]] = {}
        self._asked: set[int] = set()
        self.held_bytes = 0  # registered: in use and free
        self.closed = False  # after release(): buffers given back are unlocked at once

    def new_step(self) -> None:
        """A new forward begins: sizes asked for from here on are this step's."""
        self._asked.clear()

    def take(self, nbytes: int) -> torch.Tensor:
        """A page-locked uint8 buffer of nbytes bytes."""
        self._asked.add(nbytes)
        free = self._free.get(nbytes)
        if free:
            return free.pop()
        self._release_sizes([size for size in self._free if size not in self._asked])
        buf = _page_aligned(nbytes)
        self._register(buf)
        self.held_bytes += nbytes
        return buf

    def give(self, buf: torch.Tensor) -> None:
        """Return a buffer taken earlier; the caller's copies from or into it are ordered before its next use."""
        if self.closed:  # the offload was replaced or disabled: nothing will take it again
            self._drain()
            self._drop(buf)
            return
        self._free.setdefault(buf.numel(), []).append(buf)

    def release(self, close: bool = False) -> int:
        """Unlock and free every free buffer (``close``: and each one given back from now on); returns the bytes
        released."""
        self.closed = self.closed or close
        return self._release_sizes(list(self._free))

    def _release_sizes(self, sizes: list[int]) -> int:
        """Unlock and free the free buffers of these sizes, once the copies are done; returns the bytes freed."""
        bufs = [buf for size in sizes for buf in self._free.pop(size)]
        if bufs:
            self._drain()
        for buf in bufs:
            self._drop(buf)
        return sum(buf.numel() for buf in bufs)

    def _drop(self, buf: torch.Tensor) -> None:
        self._unregister(buf)
        self.held_bytes -= buf.numel()


class _Stash:
    """One checkpoint input in host memory: its host copy, the device tensor until the copy out is done, and the
    copy back once started."""

    __slots__ = ("host", "device", "source", "copied", "back", "back_ready", "prev", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, prev: _Stash | None):
        self.host, self.device = host, device
        self.source = None  # the device tensor, held while its copy to the host may be running (CUDA)
        self.copied = None  # CUDA event: the copy to the host is done
        self.back = None  # the device copy made by a prefetch, until an unpack takes it
        self.back_ready = None  # CUDA event: that copy is done
        self.prev = weakref.ref(prev) if prev is not None else None  # the input saved before this one


class ActivationOffload:
    """saved_tensors_hooks that keep large device tensors in host memory (see the module docstring)."""

    def __init__(self, min_bytes: int = MIN_BYTES):
        self.min_bytes = min_bytes
        self.stats = OffloadStats()
        self._last: _Stash | None = None
        self._pending: list[_Stash] = []  # CUDA stashes whose device tensor is still held
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._pools: dict[torch.device, PinnedPool] = {}  # one per device: its copies share one side stream
        self._in_backward = False

    def release_host_memory(self, close: bool = False) -> int:
        """Unlock and free the host buffers that no saved activation still uses (they are otherwise kept for the next
        step; ``close``: also those still in use, once freed); returns the bytes freed."""
        for stash in self._pending:  # copies out still reading device tensors finish first
            if stash.copied is not None:
                stash.copied.synchronize()
            stash.source = None
        self._pending = []
        self._last = None  # the last stash is otherwise kept as the next one's predecessor
        return sum(pool.release(close) for pool in self._pools.values())

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The context under which a checkpoint call saves its inputs to host memory."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    # ---- forward -----------------------------------------------------------------------------------------------

    def _pack(self, t: torch.Tensor):
        if isinstance(t, torch.nn.Parameter) or t.layout != torch.strided or \
                t.numel() * t.element_size() < self.min_bytes:
            self.stats.kept += 1
            return t
        if self._in_backward:  # the first pack after a backward: a new step
            self._in_backward = False
            for pool in self._pools.values():
                pool.new_step()
        self.stats.packed += 1
        self.stats.packed_bytes += t.numel() * t.element_size()
        if t.device.type != "cuda":
            stash = _Stash(t.detach().clone(), t.device, self._last)  # CPU: a real copy, the original is dropped
        else:
            stash = self._copy_out(t)
        self._last = stash
        return stash

    def _copy_out(self, t: torch.Tensor) -> _Stash:
        self._release_finished()
        stream = self._stream(t.device)
        if t.is_contiguous():
            pool = self._pools.get(t.device)
            if pool is None:
                pool = self._pools[t.device] = PinnedPool(drain=stream.synchronize)
            buf = pool.take(t.numel() * t.element_size())
            host = buf.view(t.dtype).view(t.shape)
        else:
            pool = buf = None
            host = torch.empty_like(t, device="cpu", pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream(t.device))  # t is complete on the compute stream
        with torch.cuda.stream(stream):
            host.copy_(t.detach(), non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(stream)
        stash = _Stash(host, t.device, self._last)
        if pool is not None:  # back to the pool with the stash; its copies run on this one side stream, in order
            weakref.finalize(stash, pool.give, buf)
        stash.source, stash.copied = t, copied  # held: t's memory must outlive the copy reading it
        self._pending.append(stash)
        return stash

    def _release_finished(self) -> None:
        """Drop the device tensors whose copy to the host is done; at most one copy is left in flight."""
        keep = []
        for i, stash in enumerate(self._pending):
            if stash.source is None:
                continue
            if i < len(self._pending) - 1:
                stash.copied.synchronize()
            if stash.copied.query():
                stash.source = None
            else:
                keep.append(stash)
        self._pending = keep

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    # ---- backward ----------------------------------------------------------------------------------------------

    def _unpack(self, obj):
        if isinstance(obj, torch.Tensor):
            return obj
        stash: _Stash = obj
        self._in_backward = True
        self.stats.unpacked += 1
        if stash.source is not None:  # the copy out may still run (the last block): use the device tensor itself
            self.stats.direct += 1
            t = stash.source
        else:
            if stash.back is not None:
                self.stats.prefetch_hits += 1
            else:
                self._copy_back(stash)
            t, ready = stash.back, stash.back_ready
            stash.back = stash.back_ready = None
            if ready is not None:
                torch.cuda.current_stream(t.device).wait_event(ready)
        prev = stash.prev() if stash.prev is not None else None
        if prev is not None and prev.back is None and prev.source is None:
            self._copy_back(prev)  # the input the backward needs next
            self.stats.prefetched += 1
        return t

    def _copy_back(self, stash: _Stash) -> None:
        if stash.device.type != "cuda":
            stash.back = stash.host  # CPU: the host copy is the tensor
            return
        main = torch.cuda.current_stream(stash.device)
        back = torch.empty_like(stash.host, device=stash.device)  # allocated on the compute stream that uses it
        stream = self._stream(stash.device)
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            back.copy_(stash.host, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(stream)
        stash.back, stash.back_ready = back, ready


def checkpointed_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules that run their forward through a checkpoint function (transformers' gradient checkpointing)."""
    return [m for m in model.modules()
            if getattr(m, "gradient_checkpointing", False) and callable(getattr(m, "_gradient_checkpointing_func", None))]


def enable(model: torch.nn.Module, min_bytes: int | None = None, keep_last: int = 0) -> ActivationOffload:
    """Keep the checkpoint inputs of ``model``'s checkpointed blocks in host memory. Call it after
    ``gradient_checkpointing_enable()``; again, it replaces the earlier offload. ``keep_last`` blocks at the top of
    the model (the first the backward needs) keep theirs on the GPU: host memory for spare GPU memory. Raises
    ActivationOffloadError when no block is checkpointed or keep_last is not in [0, blocks)."""
    disable(model)
    modules = checkpointed_modules(model)
    if not modules:
        raise ActivationOffloadError(f"activation_offload: {type(model).__name__} has no checkpointed blocks; it "
                                     "offloads what activation checkpointing keeps, so turn gradient_checkpointing on")
    ids = {id(m) for m in modules}
    blocks = [m for m in modules if not any(id(c) in ids for c in m.modules() if c is not m)]  # innermost
    if not 0 <= keep_last < len(blocks):
        raise ActivationOffloadError(f"activation_offload: keep_last must be in [0, {len(blocks)}) for "
                                     f"{type(model).__name__}'s {len(blocks)} checkpointed blocks, got {keep_last}")
    kept = {id(m) for m in blocks[len(blocks) - keep_last:]}
    modules = [m for m in modules if id(m) not in kept]
    offload = ActivationOffload(MIN_BYTES if min_bytes is None else min_bytes)
    for module in modules:
        original = module._gradient_checkpointing_func
        module._gradient_checkpointing_func = functools.partial(_offloaded, offload, original)
        setattr(module, _ATTR, original)
    setattr(model, "_volta_activation_offloader", offload)
    log.info("activation offload: the inputs of %d checkpointed blocks (%s bytes or more) wait in host memory for the "
             "backward%s", len(blocks) - keep_last, f"{offload.min_bytes:,}",
             f"; the top {keep_last} keep theirs on the GPU" if keep_last else "")
    return offload


def disable(model: torch.nn.Module) -> int:
    """Undo :func:`enable`; returns how many blocks were restored."""
    n = 0
    for module in model.modules():
        original = getattr(module, _ATTR, None)
        if original is not None:
            module._gradient_checkpointing_func = original
            delattr(module, _ATTR)
            n += 1
    offload = getattr(model, "_volta_activation_offloader", None)
    if offload is not None:
        offload.release_host_memory(close=True)
        delattr(model, "_volta_activation_offloader")
    return n


def report(model: torch.nn.Module) -> dict | None:
    """What the model's offload moved in this process (for a run's summary), logged in one line; None without one."""
    offload = getattr(model, "_volta_activation_offloader", None)
    if offload is None:
        return None
    s = offload.stats
    log.info("activation offload: %d hidden states (%.2f GiB) went to host memory and back, %d of them prefetched",
             s.packed, s.packed_bytes / 2**30, s.prefetch_hits)
    return {"packed": s.packed, "packed_gib": s.packed_bytes / 2**30, "prefetch_hits": s.prefetch_hits}


def _offloaded(offload: ActivationOffload, checkpoint_fn, function, *args, **kwargs):
    with offload.hooks():
        return checkpoint_fn(function, *args, **kwargs)

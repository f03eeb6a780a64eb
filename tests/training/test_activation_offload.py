"""Activation-checkpoint offload (volta_train/training/activation_offload.py) on the CPU: only the checkpoint inputs
pass through its hooks, the bookkeeping (host copies, a prefetch a block ahead), and bitwise the same losses and
gradients as without it over several optimizer steps, with and without the tiled MLP; the pinned pool's reuse and
release with stand-ins for CUDA's host registration. The gpu-marked test runs the CUDA path (side stream, events,
page-locked pool) against plain checkpointing."""

from __future__ import annotations

import copy

import pytest
import torch

from volta_train.training import activation_offload, tiled_mlp


def _tiny_llama(layers: int = 3):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, use_cache=False)
    model = LlamaForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _train(model, steps: int = 4, lengths=(96,)) -> tuple[list[float], list[torch.Tensor]]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(5)
    losses = []
    device = next(model.parameters()).device
    for i in range(steps):
        ids = torch.randint(0, 64, (2, lengths[i % len(lengths)]), generator=gen).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("tiled", [False, True], ids=["mlp", "tiled_mlp"])
def test_losses_and_weights_bitwise_equal(tiled):
    reference = _tiny_llama()
    model = copy.deepcopy(reference)
    if tiled:
        for m in (reference, model):
            tiled_mlp.tile_mlps(m, tile_tokens=50, mode="on")
    offload = activation_offload.enable(model, min_bytes=1)
    want, want_weights = _train(reference)
    got, got_weights = _train(model)
    assert got == want  # bitwise: the same floats
    assert all(torch.equal(a, b) for a, b in zip(got_weights, want_weights))
    s = offload.stats
    # one hidden state per block and step went to host memory and came back; all but the last block's prefetched
    assert (s.packed, s.unpacked, s.prefetch_hits, s.prefetched) == (12, 12, 8, 8), s
    assert s.packed_bytes == 12 * 2 * 96 * 64 * 4 and s.direct == 0


def test_only_checkpoint_inputs_pass_through_the_hooks():
    model = _tiny_llama(layers=2)
    offload = activation_offload.enable(model, min_bytes=1)
    seen = []
    pack = offload._pack
    offload._pack = lambda t: seen.append(tuple(t.shape)) or pack(t)
    ids = torch.randint(0, 64, (1, 40))
    model(input_ids=ids, labels=ids).loss.backward()
    # each block's hidden states, and nothing saved inside the blocks
    assert seen == [(1, 40, 64), (1, 40, 64)], seen
    assert offload.stats.packed == 2 and offload.stats.kept == 0


def test_small_tensors_stay_and_errors():
    model = _tiny_llama(layers=2)
    offload = activation_offload.enable(model)  # default threshold: 1 MiB, more than these hidden states
    ids = torch.randint(0, 64, (1, 40))
    model(input_ids=ids, labels=ids).loss.backward()
    assert offload.stats.packed == 0 and offload.stats.kept == 2
    wrapped = activation_offload.checkpointed_modules(model)  # the blocks (and the model's own checkpoint function)
    assert len(wrapped) >= 2 and activation_offload.disable(model) == len(wrapped)
    assert not any(hasattr(m, "_volta_activation_offload") for m in model.modules())
    model.gradient_checkpointing_disable()
    with pytest.raises(activation_offload.ActivationOffloadError, match="turn gradient_checkpointing on"):
        activation_offload.enable(model)


def test_recipe_configs_refuse_offload_without_checkpointing():
    from volta_train.training import config, gpt
    from volta_train.training.memory import MemoryConfig

    with pytest.raises(config.ConfigError, match="memory.activation_offload .* set memory.gradient_checkpointing"):
        gpt.resolve(gpt.GPTTrainConfig(memory=MemoryConfig(activation_offload=True)), "cpu")
    with pytest.raises(config.ConfigError, match="memory.tiled_mlp_tokens must be positive"):
        gpt.resolve(gpt.GPTTrainConfig(memory=MemoryConfig(tiled_mlp_tokens=0)), "cpu")


class _Locks:
    """Stand-ins for CUDA's host registration: which buffers are page-locked now."""

    def __init__(self):
        self.locked: dict[int, int] = {}
        self.registered = 0

    def register(self, buf):
        assert buf.dtype == torch.uint8 and buf.data_ptr() not in self.locked
        self.locked[buf.data_ptr()] = buf.numel()
        self.registered += 1

    def unregister(self, buf):
        assert self.locked.pop(buf.data_ptr()) == buf.numel()


def test_pinned_pool_reuses_exact_sizes_and_drops_stale_ones():
    locks = _Locks()
    drained = []
    pool = activation_offload.PinnedPool(locks.register, locks.unregister, lambda: drained.append(len(locks.locked)))
    sizes = [3 * 2**20 + 5, 3 * 2**20 + 5, 40_000]  # not powers of two: held exactly
    bufs = [pool.take(n) for n in sizes]
    assert [b.numel() for b in bufs] == sizes and pool.held_bytes == sum(sizes) == sum(locks.locked.values())
    for b in bufs:
        pool.give(b)
    pool.new_step()
    again = [pool.take(n) for n in sizes]  # the same step shape: no new registration
    assert locks.registered == 3 and {b.data_ptr() for b in again} == {b.data_ptr() for b in bufs}
    for b in again:
        pool.give(b)
    pool.new_step()
    assert not drained
    longer = pool.take(5 * 2**20 + 1)  # the sequence grew: the free buffers of unasked sizes are released first
    assert pool.held_bytes == longer.numel() == sum(locks.locked.values())
    assert drained == [3]  # the copies were waited for while all three were still locked
    small = pool.take(40_000)  # released above: registered anew
    assert locks.registered == 5 and pool.held_bytes == longer.numel() + 40_000
    pool.give(longer)
    assert pool.release(close=True) == longer.numel() and pool.held_bytes == 40_000
    pool.give(small)  # given back after the pool closed: unlocked at once
    assert pool.held_bytes == 0 and not locks.locked


def test_pinned_pool_keeps_sizes_asked_for_in_the_same_step():
    locks = _Locks()
    pool = activation_offload.PinnedPool(locks.register, locks.unregister)
    a, b = pool.take(1000), pool.take(2000)
    pool.give(a)
    pool.give(b)
    pool.new_step()
    a2 = pool.take(1000)
    c = pool.take(3000)  # a miss: 2000 was not asked for this step yet and is released
    assert a2.data_ptr() == a.data_ptr() and pool.held_bytes == 4000 and len(locks.locked) == 2
    pool.give(a2)
    d = pool.take(3000)  # another miss: 1000 was asked for this step, so it stays
    assert pool.held_bytes == 7000 and d.data_ptr() != c.data_ptr()


@pytest.mark.gpu
def test_cuda_offload_bitwise_equal_and_pool_holds_one_step():
    reference = _tiny_llama().cuda()
    model = copy.deepcopy(reference)
    offload = activation_offload.enable(model, min_bytes=1)
    lengths = (96, 96, 160, 160, 96)  # the pool follows a change of length
    want, want_weights = _train(reference, steps=5, lengths=lengths)
    got, got_weights = _train(model, steps=5, lengths=lengths)
    torch.cuda.synchronize()
    assert got == want
    assert all(torch.equal(a, b) for a, b in zip(got_weights, want_weights))
    pool = offload._pools[torch.device("cuda", torch.cuda.current_device())]
    # the last step's buffers only: one hidden state per block, 2 x 96 tokens x 64 fp32, exact sizes
    assert pool.held_bytes == 3 * 2 * 96 * 64 * 4, pool.held_bytes
    assert offload.stats.prefetch_hits > 0
    wrapped = len(activation_offload.checkpointed_modules(model))  # the 3 blocks (and the model, if it has one)
    assert activation_offload.disable(model) == wrapped and pool.held_bytes == 0


def test_keep_last_leaves_the_top_blocks_on_the_device():
    reference = _tiny_llama(layers=4)
    model = copy.deepcopy(reference)
    offload = activation_offload.enable(model, min_bytes=1, keep_last=3)
    offload = activation_offload.enable(model, min_bytes=1, keep_last=1)  # replaces the first
    want, _ = _train(reference, steps=2)
    got, _ = _train(model, steps=2)
    assert got == want
    assert offload.stats.packed == 2 * 3 and offload.stats.unpacked == 2 * 3  # blocks 0-2 of 4, two steps
    for bad in (-1, 4):
        with pytest.raises(activation_offload.ActivationOffloadError, match=r"keep_last must be in \[0, 4\)"):
            activation_offload.enable(model, keep_last=bad)
    assert activation_offload.disable(model) == 0  # the failed enable left nothing behind

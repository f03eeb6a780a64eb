"""Activation-checkpoint offload (volta_train/training/activation_offload.py) on the CPU: only the checkpoint inputs
pass through its hooks, the bookkeeping (host copies, a prefetch a block ahead), and bitwise the same losses and
gradients as without it over several optimizer steps, with and without the tiled MLP. Streams, pinned memory and
the copy/compute overlap run on CUDA only and are not exercised here."""

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


def _train(model, steps: int = 4) -> tuple[list[float], list[torch.Tensor]]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 64, (2, 96), generator=gen)
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

    with pytest.raises(config.ConfigError, match="activation_offload .* set gradient_checkpointing"):
        gpt.resolve(gpt.GPTTrainConfig(activation_offload=True), "cpu")
    with pytest.raises(config.ConfigError, match="tiled_mlp_tokens must be positive"):
        gpt.resolve(gpt.GPTTrainConfig(tiled_mlp_tokens=0), "cpu")

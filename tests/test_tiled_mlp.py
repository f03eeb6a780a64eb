"""The sequence-tiled MLP (volta_train/training/tiled_mlp.py) against the untiled modules on the CPU: outputs and the
gradients of the input and of every parameter, fp32 and fp64, tiles that do not divide the tokens; the largest
[tokens, intermediate] tensor; gradient checkpointing; the options and their errors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from volta_train.training import tiled_mlp

TOL = {torch.float32: dict(rtol=2e-5, atol=2e-6), torch.float64: dict(rtol=1e-12, atol=1e-13)}


def _close(got, want, dtype, name=""):
    """Equal up to rounding: atol scaled by the tensor's largest entry (a summed gradient can cancel to near 0)."""
    tol = TOL[dtype]
    scale = max(1.0, want.abs().max().item())
    torch.testing.assert_close(got, want, rtol=tol["rtol"], atol=tol["atol"] * scale,
                               msg=lambda m: f"{name}: {m}" if name else m)


class Holder(torch.nn.Module):
    """A block stand-in holding one MLP-like module as ``mlp`` (tile_mlps looks below the root)."""

    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp


def _gpt2():
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

    config = GPT2Config(n_embd=24, n_head=2, resid_pdrop=0.0, activation_function="gelu_pytorch_tanh")
    return GPT2MLP(4 * 24, config), 24, 96


def _llama():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    return LlamaMLP(LlamaConfig(hidden_size=24, intermediate_size=40, num_attention_heads=2)), 24, 40


def _qwen2_moe():
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    config = Qwen2MoeConfig(hidden_size=24, num_attention_heads=2, moe_intermediate_size=16, shared_expert_intermediate_size=20,
                            num_experts=4, num_experts_per_tok=2)
    block = Qwen2MoeSparseMoeBlock(config)
    with torch.no_grad():
        for p in block.parameters():  # some are created empty or zero (router): give every expert a share
            p.normal_(0, 0.3)
    return block, 24, 16


def _mixtral():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    block = MixtralSparseMoeBlock(MixtralConfig(hidden_size=24, intermediate_size=16, num_local_experts=4, num_attention_heads=2,
                                                num_experts_per_tok=2))
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    return block, 24, 16


MODULES = {"gpt2": _gpt2, "llama": _llama, "qwen2_moe": _qwen2_moe, "mixtral": _mixtral}


def _grads(call, module, x, seed: int):
    torch.manual_seed(seed)
    x = x.clone().requires_grad_(True)
    y = call(x)
    weight = torch.randn_like(y)
    (y * weight).sum().backward()
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def _compare(ref, got, dtype):
    (y0, gx0, gp0), (y1, gx1, gp1) = ref, got
    _close(y1, y0, dtype, "output")
    _close(gx1, gx0, dtype, "input gradient")
    assert gp1.keys() == gp0.keys() and gp0, sorted(gp0)
    for name in gp0:
        _close(gp1[name], gp0[name], dtype, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("kind", list(MODULES))
@pytest.mark.parametrize("batch,seq,tile", [(2, 23, 7), (1, 37, 5), (3, 11, 64)])
def test_tiled_equals_untiled(kind, dtype, batch, seq, tile):
    torch.manual_seed(0)
    module, hidden, _ = MODULES[kind]()
    module = module.to(dtype)
    reference = copy.deepcopy(module)
    x = torch.randn(batch, seq, hidden, dtype=dtype)
    ref = _grads(reference, reference, x, 1)
    holder = Holder(module)
    assert tiled_mlp.tile_mlps(holder, tile_tokens=tile, mode="on") == ["mlp"]
    _compare(ref, _grads(holder.mlp, module, x, 1), dtype)


def test_bert_feed_forward_is_tiled():
    """BERT-style layers: the feed-forward is the layer's feed_forward_chunk over intermediate + output."""
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertLayer

    torch.manual_seed(0)
    config = BertConfig(hidden_size=24, num_attention_heads=2, intermediate_size=40, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    layer = BertLayer(config).double()
    reference = copy.deepcopy(layer)
    holder = Holder(layer)
    assert tiled_mlp.find_mlps(holder)[0][0] == "mlp" and tiled_mlp.tile_mlps(holder, 6, "on") == ["mlp"]
    x = torch.randn(2, 17, 24, dtype=torch.float64)
    ref = _grads(reference.feed_forward_chunk, reference, x, 2)
    _compare(ref, _grads(layer.feed_forward_chunk, layer, x, 2), torch.float64)
    with torch.no_grad():  # and the whole layer (attention untouched) gives the same output
        torch.testing.assert_close(layer(x)[0], reference(x)[0], **TOL[torch.float64])


class _LargestWide(TorchDispatchMode):
    """Records the largest number of rows of any op output whose last dimension is the MLP width."""

    def __init__(self, width: int, module: torch.nn.Module):
        super().__init__()
        self.width, self.rows = width, 0
        self.weights = {tuple(p.shape) for p in module.parameters()} | {tuple(p.shape[::-1]) for p in
                                                                         module.parameters()}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.width \
                    and tuple(t.shape) not in self.weights:  # activations, not a weight's gradient
                self.rows = max(self.rows, t.numel() // self.width)
        return out


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_no_intermediate_tensor_beyond_one_tile(kind):
    torch.manual_seed(0)
    module, hidden, width = MODULES[kind]()
    x = torch.randn(2, 50, hidden, requires_grad=True)
    for tile, most in ((None, 100), (8, 8)):
        if tile:
            tiled_mlp.tile_mlps(Holder(module), tile, "on")
        with _LargestWide(width, module) as seen:
            module(x).square().sum().backward()
        assert seen.rows == most, (tile, seen.rows)


def _tiny_llama(layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, use_cache=False)
    model = LlamaForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    return model


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_whole_model_gradients(checkpointing):
    """A Llama with its MLPs tiled (and gradient checkpointing): the loss and every gradient match."""
    reference = _tiny_llama().double()
    model = copy.deepcopy(reference)
    if checkpointing:
        for m in (model, reference):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    names = tiled_mlp.tile_mlps(model, tile_tokens=9, mode="on")
    assert names == ["model.layers.0.mlp", "model.layers.1.mlp"]
    ids = torch.randint(0, 64, (2, 45), generator=torch.Generator().manual_seed(3))
    losses = []
    for m in (reference, model):
        m.train()
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], **TOL[torch.float64])
    for (name, p0), p1 in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(p1.grad, p0.grad, **TOL[torch.float64], msg=lambda m, n=name: f"{n}: {m}")


def test_modes_auto_off_and_errors():
    model = _tiny_llama()
    width = model.config.intermediate_size
    threshold = tiled_mlp.auto_min_tokens(width)
    assert threshold * width * tiled_mlp.BYTES_PER_TOKEN_AND_WIDTH >= tiled_mlp.AUTO_MIN_BYTES
    assert tiled_mlp.resolve("auto", model, threshold - 1)[0] is False
    assert tiled_mlp.resolve("auto", model, threshold)[0] is True
    assert tiled_mlp.tile_mlps(model, mode="auto", tokens=threshold - 1) == []
    assert len(tiled_mlp.tile_mlps(model, mode="auto", tokens=threshold)) == 2
    assert isinstance(model.model.layers[0].mlp.__dict__["forward"], object)
    assert tiled_mlp.tile_mlps(model, mode="off") == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert "forward" not in model.model.layers[0].mlp.__dict__  # the class's method again
    assert tiled_mlp.auto_tile_tokens(8192) == 4096 and tiled_mlp.auto_tile_tokens(14336) == 2304
    with pytest.raises(tiled_mlp.TiledMLPError, match="tiled_mlp must be one of auto, on, off, got 'yes'"):
        tiled_mlp.tile_mlps(model, mode="yes")
    with pytest.raises(tiled_mlp.TiledMLPError, match="tile_tokens must be a positive int"):
        tiled_mlp.tile_mlps(model, tile_tokens=0)
    with pytest.raises(tiled_mlp.TiledMLPError, match="needs the tokens per sequence"):
        tiled_mlp.tile_mlps(model, mode="auto")
    with pytest.raises(tiled_mlp.TiledMLPError, match="found no MLP to tile"):
        tiled_mlp.tile_mlps(torch.nn.Sequential(torch.nn.Linear(4, 4)), mode="on")


def test_moe_router_logits_and_noise_are_refused():
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, num_local_experts=2, num_experts_per_tok=1,
                           output_router_logits=True)
    with pytest.raises(tiled_mlp.TiledMLPError, match="output_router_logits"):
        tiled_mlp.tile_mlps(MixtralForCausalLM(config), mode="on")
    config.output_router_logits, config.router_jitter_noise = False, 0.1
    with pytest.raises(tiled_mlp.TiledMLPError, match="router_jitter_noise"):
        tiled_mlp.tile_mlps(MixtralForCausalLM(config), mode="on")

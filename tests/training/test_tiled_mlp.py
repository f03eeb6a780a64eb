"""The sequence-tiled MLP (volta_train/training/tiled_mlp.py) against the untiled modules on the CPU: outputs and the
gradients of the input and of every parameter, fp32 and fp64, tiles that do not divide the tokens; the largest
[tokens, intermediate] tensor; gradient checkpointing; the options and their errors."""

from __future__ import annotations

import copy
from fractions import Fraction

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


def _family(kind: str, dtype):
    """A tiny whole model of ``kind`` (fresh weights, fixed seed) and the name of the sub-module of each MLP that
    every MLP forward calls once per token (its first projection or router)."""
    import transformers as tf

    torch.manual_seed(0)
    common = dict(vocab_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    if kind == "llama":
        model, first = tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=32, intermediate_size=48, **common)), "gate_proj"
    elif kind == "gemma2":  # post_feedforward_layernorm: saves the MLP output for its backward
        model = tf.Gemma2ForCausalLM(tf.Gemma2Config(hidden_size=32, intermediate_size=48, head_dim=8,
                                                     query_pre_attn_scalar=8, **common))
        first = "gate_proj"
    elif kind == "qwen2_moe":
        model = tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=4,
                                                         shared_expert_intermediate_size=20, num_experts_per_tok=2,
                                                         **common))
        with torch.no_grad():  # a router of zeros would send every token to the same experts
            for layer in model.model.layers:
                layer.mlp.gate.weight.normal_(0, 0.3)
        first = "gate"
    elif kind == "gpt2":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                                                 embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False))
        first = "c_fc"
    else:
        raise ValueError(kind)
    model.config._attn_implementation = "eager"
    model.config._experts_implementation = "eager"  # the grouped-matmul experts take no fp64
    return model.to(dtype), first


FAMILIES = ["llama", "gemma2", "qwen2_moe", "gpt2"]
SETUPS = ["plain", "checkpoint", "reentrant", "checkpoint+offload"]


class _Flops(TorchDispatchMode):
    """Matmul FLOPs of the ops dispatched under it (torch.utils.flop_counter's formulas; FlopCounterMode itself also
    tracks modules with gradient hooks, which autograd.grad inside a backward refuses)."""

    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils.flop_counter import flop_registry

        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        count = flop_registry.get(func._overloadpacket)
        if count is not None:
            self.total += count(*args, **kwargs, out_val=out)
        return out


def _step(model, first: str, setup: str, tile: int | None):
    """One forward and backward of ``model`` (tiled over ``tile`` tokens, or untiled for None) under ``setup``:
    the loss, the parameters' gradients, MLP forwards per token and layer, and the step's FLOPs."""
    from volta_train.training import activation_offload

    if setup != "plain":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": setup == "reentrant"})
    if setup.endswith("+offload"):
        activation_offload.enable(model, min_bytes=1)
    names = tiled_mlp.tile_mlps(model, tile_tokens=tile, mode="on") if tile else []
    mlps = [m for _, m, _ in tiled_mlp.find_mlps(model)]
    assert len(mlps) == 2 and (not tile or len(names) == 2)
    rows = [0]
    for mlp in mlps:
        mlp.get_submodule(first).register_forward_pre_hook(
            lambda m, a: rows.__setitem__(0, rows[0] + a[0].numel() // a[0].shape[-1]))
    ids = torch.randint(0, 64, (2, 45), generator=torch.Generator().manual_seed(3))
    model.train()
    with _Flops() as flops:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, rows[0] / (ids.numel() * len(mlps)), flops.total


# MLP forwards per token in one training step (rows through the MLP's first projection or router): untiled, tiled.
# Tiling adds the per-tile recompute; under the non-reentrant checkpoint it replaces the block's recompute of the MLP
# (which stops before the tiled MLP) unless an operation after the MLP saves a tensor (Gemma2's
# post_feedforward_layernorm); the reentrant checkpoint always recomputes the whole block.
FORWARDS = {"plain": (1, 2), "checkpoint": (2, 2), "reentrant": (2, 3), "checkpoint+offload": (2, 2)}
# FLOPs of a tile's recompute, in MLP forwards: each tile's checkpoint stops once the last tensor it saves is saved
# again, before the last projection's matmul (Llama: 2 of 3 matmuls, GPT-2: 1 of 2); Qwen2-MoE's block saves tensors
# after its last matmul. That is the tiled step's extra work without checkpointing and under the reentrant
# checkpoint; under the non-reentrant one none, except where the block's recompute runs the tiled MLP (Gemma2).
TILE_RECOMPUTE = {"llama": Fraction(2, 3), "gpt2": Fraction(1, 2), "qwen2_moe": Fraction(1), "gemma2": Fraction(2, 3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("kind", FAMILIES)
def test_families_gradients_and_mlp_forwards(kind, setup, dtype):
    """Whole models, tiled against untiled under each checkpointing setup: the loss and every gradient match; the
    MLP forwards per token (FORWARDS: with non-reentrant checkpointing the tiled MLP runs as many as the untiled
    one, except where a later operation needs the MLP output in the recompute) and the step's FLOPs beyond the
    untiled step's (TILE_RECOMPUTE)."""
    reference, first = _family(kind, dtype)
    model = copy.deepcopy(reference)
    width = reference.config.hidden_size
    with torch.no_grad(), _Flops() as one:  # one MLP forward over a step's tokens, all layers
        for _, mlp, _ in tiled_mlp.find_mlps(reference):
            mlp(torch.randn(2, 45, width, dtype=dtype))
    assert one.total > 0
    loss0, grads0, forwards0, flops0 = _step(reference, first, setup, None)
    loss1, grads1, forwards1, flops1 = _step(model, first, setup, 9)
    _close(loss1, loss0, dtype, "loss")
    assert grads1.keys() == grads0.keys() and len(grads0) == len(list(reference.parameters()))
    for name in grads0:
        _close(grads1[name], grads0[name], dtype, name)
    want = FORWARDS[setup]
    if kind == "gemma2" and setup.startswith("checkpoint"):
        want = (2, 3)
    assert (forwards0, forwards1) == want
    extra = TILE_RECOMPUTE[kind] if setup in ("plain", "reentrant") or kind == "gemma2" else 0
    assert flops1 - flops0 == extra * one.total, (flops1 - flops0) / one.total


@pytest.mark.parametrize("setup", ["plain", "checkpoint"])
def test_whole_model_no_intermediate_beyond_one_tile(setup):
    """A checkpointed (or plain) Llama step: no tensor of MLP width has more rows than one tile."""
    model, _ = _family("llama", torch.float32)
    if setup == "checkpoint":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    tiled_mlp.tile_mlps(model, tile_tokens=9, mode="on")
    ids = torch.randint(0, 64, (2, 45))
    with _LargestWide(48, model) as seen:
        model(input_ids=ids, labels=ids).loss.backward()
    assert seen.rows == 9


@pytest.mark.parametrize("kind", ["llama", "qwen2_moe"])
def test_input_without_gradient(kind):
    """An input that needs no gradient (frozen layers below): the parameters' gradients still match."""
    torch.manual_seed(0)
    module, hidden, _ = MODULES[kind]()
    module = module.double()
    reference = copy.deepcopy(module)
    tiled_mlp.tile_mlps(Holder(module), 7, "on")
    x = torch.randn(2, 19, hidden, dtype=torch.float64)
    weight = torch.randn(2, 19, hidden, dtype=torch.float64)
    for m in (reference, module):
        (m(x) * weight).sum().backward()
    for (name, p0), p1 in zip(reference.named_parameters(), module.parameters()):
        assert p0.grad is not None
        _close(p1.grad, p0.grad, torch.float64, name)


@pytest.mark.parametrize("setup", ["plain", "checkpoint"])
def test_backward_runs_one_tile_at_a_time(setup):
    """Each tile's recompute is followed by that tile's backward before the next tile is recomputed (last tile
    first), so one tile's activations are alive at a time."""
    model, _ = _family("llama", torch.float32)
    if setup == "checkpoint":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    tiled_mlp.tile_mlps(model, tile_tokens=20, mode="on")
    events = []
    piece = tiled_mlp._Tiles.piece

    def recorded(self, k):
        if self.pieces is None:
            events.append(f"recompute {k}")
        return piece(self, k)

    for layer in model.model.layers:
        layer.mlp.gate_proj.register_full_backward_hook(lambda *a: events.append("backward"))
    ids = torch.randint(0, 64, (2, 45))
    try:
        tiled_mlp._Tiles.piece = recorded
        model(input_ids=ids, labels=ids).loss.backward()
    finally:
        tiled_mlp._Tiles.piece = piece
    one_layer = [e for k in (4, 3, 2, 1, 0) for e in (f"recompute {k}", "backward")]  # 90 tokens in tiles of 20
    assert events == one_layer * 2


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("setup", ["plain", "checkpoint"])
def test_dropout_masks_of_forward_and_recompute_agree(device, setup):
    """GPT-2's MLP ends in dropout: each tile's recompute must draw the forward's mask (the tile checkpoints restore
    the CPU and the input's CUDA RNG state). The bias of the last projection gets sum(kept * w) / (1 - p), with the
    kept positions read off the output."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

    torch.manual_seed(0)
    p = 0.3
    mlp = GPT2MLP(96, GPT2Config(n_embd=24, n_head=2, resid_pdrop=p, activation_function="gelu_pytorch_tanh"))
    mlp = mlp.to(device).double().train()
    holder = Holder(mlp)
    tiled_mlp.tile_mlps(holder, 7, "on")
    x = torch.randn(2, 30, 24, dtype=torch.float64, device=device, requires_grad=True)
    weight = torch.randn(2, 30, 24, dtype=torch.float64, device=device)
    if setup == "checkpoint":
        from torch.utils.checkpoint import checkpoint

        y = checkpoint(lambda t: mlp(t * 1.0), x, use_reentrant=False)
    else:
        y = mlp(x)
    (y * weight).sum().backward()
    kept = (y != 0).double()
    assert 0.5 < kept.mean().item() < 0.9
    _close(mlp.c_proj.bias.grad, (kept * weight).sum((0, 1)) / (1 - p), torch.float64, "c_proj.bias")

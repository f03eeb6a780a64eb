"""The lean RMSNorm (volta_train/training/rms_norm.py) against transformers' norms of each form on the CPU
(LlamaRMSNorm; GemmaRMSNorm, Gemma2RMSNorm, Gemma3RMSNorm's 1 + weight; Gemma3nRMSNorm and Olmo2RMSNorm's fp32
weight): the output bit for bit (fp32, bf16, fp16, mixed, autocast), gradients against a float64 reference, chunk
boundaries, the tensors the forward saves and the backward creates, whole models swapped (loss bitwise, every
gradient), the modules left alone, restore, and the recipes' lean_norm option."""

from __future__ import annotations

import copy
import logging
import re

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from volta_train.training import rms_norm, tiled_mlp

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(3, 37, 96), (1, 1, 8), (2, 5, 3, 40)]


# transformers' norm classes by family, and the form each is swapped with
NORMS = {"llama": "llama", "gemma": "offset", "gemma2": "offset", "gemma3": "offset", "gemma3n": "fp32 weight",
         "olmo2": "fp32 weight"}


def _norm_class(family: str):
    import importlib

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    return next(getattr(module, n) for n in dir(module) if n.lower() == f"{family}rmsnorm")


def _norm(width: int, dtype, seed: int, eps: float = 1e-5, family: str = "llama"):
    module = _norm_class(family)(width, eps=eps)
    offset = 0.0 if NORMS[family] == "offset" else 1.0  # weights around 0 where the norm adds 1
    with torch.no_grad():
        module.weight.copy_(offset + 0.5 * torch.randn(width, generator=torch.Generator().manual_seed(seed)))
    return module.to(dtype)


def _lean(module):
    """The lean function standing in for ``module``: t -> its output for t."""
    eps = getattr(module, rms_norm._eps_name(module))
    form = NORMS[type(module).__name__.lower().removesuffix("rmsnorm")]
    return lambda t: rms_norm.rms_norm(t, module.weight, eps, form)


def _input(shape, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[-2], base=10.0).unsqueeze(-1)
    return x.to(dtype)


@pytest.mark.parametrize("family", NORMS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_is_bitwise_the_module(dtype, shape, family):
    module = _norm(shape[-1], dtype, 1, family=family)
    x = _input(shape, dtype, 2)
    assert torch.equal(_lean(module)(x), module(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # under autocast too, and with a grad-recording input
        x32 = _input(shape, torch.float32, 3).requires_grad_()
        w32 = _norm(shape[-1], torch.float32, 4, family=family)
        assert torch.equal(_lean(w32)(x32), w32(x32))
        assert torch.equal(_lean(module)(x), module(x))
    # an fp32 weight on a 16-bit input (the output is the module's dtype: fp32 for llama, x's for the others)
    w32 = _norm(shape[-1], torch.float32, 5, family=family)
    y, want = _lean(w32)(x), w32(x)
    assert y.dtype == want.dtype == (torch.float32 if family == "llama" else dtype) and torch.equal(y, want)
    assert rms_norm.probe(module) == (NORMS[family], "")


def _grads(fn, x, weight, grad):
    x = x.detach().requires_grad_()
    y = fn(x)
    return torch.autograd.grad(y, (x, weight), grad)


@pytest.mark.parametrize("family", NORMS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gradients_against_float64(dtype, shape, family):
    """Both gradients: the lean function's error against the module run in float64 is at most the eager module's
    (plus rounding of the output dtype), and within the dtype's rounding of the reference."""
    module = _norm(shape[-1], dtype, 6, family=family)
    x = _input(shape, dtype, 7)
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(8)).to(dtype)
    eager = _grads(module, x, module.weight, grad)
    lean = _grads(_lean(module), x, module.weight, grad)
    reference = copy.deepcopy(module).double()
    want = _grads(reference, x.double(), reference.weight, grad.double())
    ulp = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}[dtype]
    for name, got, base, ref in zip(("input", "weight"), lean, eager, want):
        assert got.dtype == base.dtype and got.shape == base.shape
        scale = ref.abs().max().item()
        err, err_eager = (got.double() - ref).abs().max().item(), (base.double() - ref).abs().max().item()
        assert err <= 1.5 * err_eager + 2 * ulp * scale, (name, err, err_eager)
        torch.testing.assert_close(got.double(), ref, rtol=8 * ulp, atol=8 * ulp * scale * (shape[-2] ** 0.5),
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("family", ["llama", "gemma2", "gemma3n"])
@pytest.mark.parametrize("rows_per_chunk", [1, 5, 37, 38, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_chunk_boundaries(monkeypatch, rows_per_chunk, dtype, family):
    """Chunks that do not divide the rows (37 rows of width 24), one row, exactly the rows, more than the rows:
    the gradients equal the single-chunk ones (the input's bit for bit: rows are independent)."""
    width, shape = 24, (1, 37, 24)
    module = _norm(width, dtype, 9, family=family)
    x = _input(shape, dtype, 10)
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(11)).to(dtype)
    run = _lean(module)
    whole = _grads(run, x, module.weight, grad)
    monkeypatch.setattr(rms_norm, "CHUNK_BYTES", 4 * width * rows_per_chunk)
    assert rms_norm.rows_per_chunk(width) == rows_per_chunk
    chunked = _grads(run, x, module.weight, grad)
    assert torch.equal(chunked[0], whole[0])
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # the weight's sum over rows, in another order
    torch.testing.assert_close(chunked[1], whole[1], rtol=tol, atol=tol * whole[1].abs().max().item())


class _Created(TorchDispatchMode):
    """Every tensor an op creates in new memory (views and in-place results left out): (op, dtype, elements)."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        known = {t.untyped_storage().data_ptr() for t in inputs}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in known:
                self.made.append((str(func), t.dtype, t.numel()))
        return out


@pytest.mark.parametrize("family", ["llama", "gemma", "gemma3n"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_backward_creates_no_full_fp32_tensor(monkeypatch, dtype, family):
    """With chunks of 8 rows over 3 x 37 rows the lean backward creates no fp32 tensor larger than a chunk except
    its fp32 input gradient (an fp32 input), where the module's backward creates several fp32 [rows, width]."""
    shape, chunk = (3, 37, 40), 8
    rows, width = shape[0] * shape[1], shape[2]
    monkeypatch.setattr(rms_norm, "CHUNK_BYTES", 4 * width * chunk)
    module = _norm(width, dtype, 12, family=family)
    x = _input(shape, dtype, 13).requires_grad_()
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(14)).to(dtype)
    full = []
    for fn in (module, _lean(module)):
        y = fn(x)
        with _Created() as seen:
            torch.autograd.grad(y, (x, module.weight), grad)
        full.append([(op, dt) for op, dt, n in seen.made if n >= rows * width and dt == torch.float32])
        largest = max(n for _, dt, n in seen.made if dt == torch.float32 and n < rows * width)
    eager, lean = full
    assert len(eager) >= 3, eager
    assert lean == ([("aten.empty.memory_format", torch.float32)] if dtype == torch.float32 else []), lean
    assert largest == chunk * width


def _saved_bytes(fn, x, weight) -> int:
    """Bytes of the tensors the graph of fn(x) saves, beyond the storages of x and the weight (counted once)."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fn(x)
    own = {x.untyped_storage().data_ptr(), weight.untyped_storage().data_ptr()}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    return sum(n for ptr, n in storages.items() if ptr not in own)


@pytest.mark.parametrize("family", ["llama", "gemma", "gemma3n"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_saves_only_the_row_scale(dtype, family):
    """Per token and norm of width h LlamaRMSNorm saves 4h + 4 bytes (fp32 input: its normalised rows and the row
    scale) or 6h + 4 (16-bit input: the fp32 upcast, its normalised 16-bit cast, the scale); the Gemma forms save
    the fp32 normalised rows instead of their cast, 8h + 4 for a 16-bit input (4 more for Gemma3n, whose pow also
    saves the mean square), and the weight's fp32 factor (4h once, 1 + weight; nothing more for an fp32 weight,
    weight.float() being the weight); the lean function 4."""
    shape = (2, 23, 48)
    tokens, width = shape[0] * shape[1], shape[2]
    module = _norm(width, dtype, 15, family=family)
    x = _input(shape, dtype, 16).requires_grad_()
    eager = _saved_bytes(module, x, module.weight)
    lean = _saved_bytes(_lean(module), x, module.weight)
    if family == "llama":
        assert eager == tokens * ((4 if dtype == torch.float32 else 6) * width + 4)
    else:
        factor = 4 * width if family == "gemma" or dtype != torch.float32 else 0
        per_row = 8 if family == "gemma3n" else 4
        assert eager == tokens * ((4 if dtype == torch.float32 else 8) * width + per_row) + factor
    assert lean == tokens * 4


def _tiny(family: str = "llama", layers: int = 2):
    import transformers

    torch.manual_seed(0)
    sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=layers, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128, use_cache=False)
    attention = "sdpa"
    if family == "gemma":
        model = transformers.GemmaForCausalLM(transformers.GemmaConfig(head_dim=8, **sizes))
    elif family == "gemma2":
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(head_dim=8, query_pre_attn_scalar=8,
                                                                         **sizes))
        attention = "eager"  # Gemma2's attention logit soft-capping
    elif family == "gemma3":  # also q_norm and k_norm over head_dim
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(head_dim=8, query_pre_attn_scalar=8,
                                                                             sliding_window=16, **sizes))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes))
    if family != "llama":  # Gemma's norm weights start at zero: give the 1 + weight a weight that matters
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(0.0, 0.5)
    model.config._attn_implementation = attention
    return model


def _step(model, ids):
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach()


# family: (the norms of a 2-layer model, its norm class)
WHOLE = {"llama": (5, "LlamaRMSNorm"), "gemma2": (9, "Gemma2RMSNorm"), "gemma3": (13, "Gemma3RMSNorm")}


@pytest.mark.parametrize("family", WHOLE)
@pytest.mark.parametrize("setup", ["plain", "checkpointing", "tiled", "offload"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_whole_model_swapped(dtype, setup, family):
    """Every norm of a tiny Llama, Gemma2, Gemma3 (text) swapped: the loss is bitwise the unswapped model's, every
    parameter gradient equal up to rounding (also with non-reentrant checkpointing, with the tiled MLP under
    checkpointing, and with the activation offload and the tiled MLP)."""
    reference = _tiny(family).to(dtype)
    model = copy.deepcopy(reference)
    if setup != "plain":
        for m in (model, reference):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if setup in ("tiled", "offload"):
        for m in (model, reference):
            tiled_mlp.tile_mlps(m, tile_tokens=9, mode="on")
    if setup == "offload":
        from volta_train.training import activation_offload

        for m in (model, reference):
            activation_offload.enable(m, min_bytes=1)
    count, name = WHOLE[family]  # 2 layers x 2 norms (Gemma2: 4, Gemma3: 4 and q_norm, k_norm), the final norm
    assert rms_norm.swap_rms_norms(model) == count
    norms = [m for m in model.modules() if type(m).__name__ == name]
    assert len(norms) == count and all("forward" in vars(m) for m in norms)
    if setup in ("tiled", "offload"):
        assert any(hasattr(m, tiled_mlp._ATTR) for m in model.modules())
    ids = torch.randint(0, 64, (2, 45), generator=torch.Generator().manual_seed(17))
    want, got = _step(reference, ids), _step(model, ids)
    assert torch.equal(got, want)
    # the norms compute in fp32 in an fp64 model too (and so their gradients): fp32 rounding either way
    rtol, atol = 1e-6, 1e-7
    for (name, p0), p1 in zip(reference.named_parameters(), model.parameters()):
        scale = max(1.0, p0.grad.abs().max().item())
        torch.testing.assert_close(p1.grad, p0.grad, rtol=rtol, atol=atol * scale, msg=lambda m, n=name: f"{n}: {m}")


def test_bf16_llama_loss_bitwise():
    reference = _tiny().to(torch.bfloat16)
    model = copy.deepcopy(reference)
    assert rms_norm.swap_rms_norms(model) == 5
    ids = torch.randint(0, 64, (1, 33), generator=torch.Generator().manual_seed(18))
    assert torch.equal(_step(model, ids), _step(reference, ids))
    for p0, p1 in zip(reference.parameters(), model.parameters()):
        torch.testing.assert_close(p1.grad.float(), p0.grad.float(), rtol=0.05, atol=0.02 * p0.grad.abs().max().item())


def test_log_line_differing_norms_left_alone_and_restore(caplog):
    """The log line names each class swapped with its form; a Gemma-like norm that casts to the input's dtype
    before the weight multiply, and a Gemma3n norm without a weight, stay as they are, named with why; restore
    undoes a swap."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.gemma3n.modeling_gemma3n import Gemma3nRMSNorm

    class CastFirstRMSNorm(GemmaRMSNorm):
        def forward(self, x):
            return self._norm(x.float()).type_as(x) * (1.0 + self.weight.float()).type_as(x)

    gemma = _tiny("gemma")
    gemma.model.extra = torch.nn.ModuleList([CastFirstRMSNorm(32), Gemma3nRMSNorm(32, with_scale=False),
                                             Gemma3nRMSNorm(32)])
    with caplog.at_level(logging.INFO, logger=rms_norm.__name__):
        assert rms_norm.swap_rms_norms(gemma) == 6
    assert ("lean RMSNorm: swapped 1 Gemma3nRMSNorm [fp32 weight], 5 GemmaRMSNorm [offset]; left as they are: "
            "CastFirstRMSNorm (output differs from the module's forward); "
            "Gemma3nRMSNorm (its parameters are not one 1-D weight)\n") in caplog.text + "\n"
    assert [hasattr(m, rms_norm._ATTR) for m in gemma.model.extra] == [False, False, True]
    assert rms_norm.probe(gemma.model.extra[0]) == ("", "output differs from the module's forward")
    assert rms_norm.restore_rms_norms(gemma) == 6
    assert not any("forward" in vars(m) for m in gemma.modules())

    model = _tiny()
    ids = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(19))
    with torch.no_grad():
        before = model(input_ids=ids).logits
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=rms_norm.__name__):
        assert rms_norm.swap_rms_norms(model) == 5
        assert rms_norm.swap_rms_norms(model) == 5  # again: nothing more changes
    assert "lean RMSNorm: swapped 5 LlamaRMSNorm [llama]\n" in caplog.text + "\n"
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, before)
    assert rms_norm.restore_rms_norms(model) == 5 and rms_norm.restore_rms_norms(model) == 0
    assert not any("forward" in vars(m) or hasattr(m, rms_norm._ATTR) for m in model.modules())


def test_partitioned_and_meta_weights_are_probed_without_their_values():
    """A ZeRO-3-partitioned weight (empty data, ds_shape) and a model on the meta device: the probe reads only the
    shape and dtype, so both are swapped; the module's weight is left untouched."""
    module = _norm(16, torch.float32, 20)
    module.weight.data = torch.empty(0)
    module.weight.ds_shape, module.weight.ds_numel, module.weight.ds_id = torch.Size([16]), 16, 0
    assert rms_norm.is_candidate(module) and rms_norm.probe(module) == ("llama", "")
    assert rms_norm.swap_rms_norms(module) == 1 and module.weight.numel() == 0
    with torch.device("meta"):
        model = _tiny()
    state = torch.get_rng_state()
    assert rms_norm.swap_rms_norms(model) == 5
    assert torch.equal(torch.get_rng_state(), state)  # the probe draws from its own generator


def test_a_norm_that_differs_only_in_16_bit_gets_its_form():
    """(weight * h).to(input dtype) instead of weight * h.to(input dtype): equal in fp32, not for a 16-bit input, so
    the probe passes over the llama form to the fp32 weight one."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    class CastLastRMSNorm(LlamaRMSNorm):
        def forward(self, hidden_states):
            input_dtype = hidden_states.dtype
            hidden_states = hidden_states.to(torch.float32)
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
            return (self.weight * hidden_states).to(input_dtype)

    assert rms_norm.probe(CastLastRMSNorm(24)) == ("fp32 weight", "")


def test_lean_norm_option(tmp_path):
    from volta_train.training import config, data, finetune_config, gpt, memory

    with pytest.raises(ValueError, match="lean_norm must be one of auto, on, off, got 'yes'"):
        rms_norm.resolve("yes", True)
    bad = tmp_path / "bad.yaml"
    bad.write_text("lean_norm: maybe\n")
    with pytest.raises(config.ConfigError, match=re.escape("lean_norm is 'maybe'; accepted: auto, on, off")):
        config.load_yaml(bad, gpt.GPTTrainConfig)
    bad.write_text("model: {lean_norm: maybe}\n")
    with pytest.raises(config.ConfigError, match=re.escape("model.lean_norm is 'maybe'; accepted: auto, on, off")):
        config.load_yaml(bad, finetune_config.FinetuneConfig)

    def swapped(**options):
        cfg = gpt.resolve(gpt.GPTTrainConfig(arch="llama", model="nano", n_kv_head=1, seq_len=64,
                                             memory=memory.MemoryConfig(**options)), "cpu")
        model = gpt.build_model(cfg, data.ByteTokenizer())
        memory.apply(model, cfg.memory, memory.tokens_per_process(cfg.batch_size, cfg.seq_len))
        tiled = any(hasattr(m, tiled_mlp._ATTR) for m in model.modules())
        return sum(hasattr(m, rms_norm._ATTR) for m in model.modules()), tiled

    assert swapped() == (0, False)  # auto at 64 tokens: the tiled MLP stays off, so does this
    assert swapped(tiled_mlp="on") == (5, True)  # auto follows the tiled MLP
    assert swapped(tiled_mlp="on", lean_norm="off") == (0, True)
    assert swapped(lean_norm="on") == (5, False)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_bitwise_and_memory(dtype):
    """On a GPU: the output bit for bit (also under fp16 autocast), gradients against float64, and the memory: what
    the forward keeps beyond its output and the backward's peak beyond its input gradient, against the module's."""
    device, shape = torch.device("cuda"), (2, 9, 256)
    module = _norm(shape[-1], dtype, 21).to(device)
    x = _input(shape, dtype, 22).to(device)
    assert torch.equal(rms_norm.rms_norm(x, module.weight, module.variance_epsilon), module(x))
    with torch.autocast("cuda", dtype=torch.float16):
        w32 = _norm(shape[-1], torch.float32, 23).to(device)
        x32 = _input(shape, torch.float32, 24).to(device).requires_grad_()
        assert torch.equal(rms_norm.rms_norm(x32, w32.weight, 1e-5), w32(x32))
    assert rms_norm.probe(module) == ("llama", "")
    grad = torch.randn(shape, device=device).to(dtype)
    lean = _grads(lambda t: rms_norm.rms_norm(t, module.weight, module.variance_epsilon), x, module.weight, grad)
    reference = copy.deepcopy(module).double()
    want = _grads(reference, x.double(), reference.weight, grad.double())
    eager = _grads(module, x, module.weight, grad)
    for got, base, ref in zip(lean, eager, want):
        assert (got.double() - ref).abs().max() <= 1.5 * (base.double() - ref).abs().max() + 1e-3 * ref.abs().max()

    tokens, width = 65536, 2048  # 512 MiB per fp32 [tokens, width]
    module = _norm(width, dtype, 25).to(device)
    x = torch.randn(tokens, width, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(tokens, width, device=device, dtype=dtype)
    kept, peak = [], []
    for fn in (module, lambda t: rms_norm.rms_norm(t, module.weight, module.variance_epsilon)):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        y = fn(x)
        kept.append(torch.cuda.memory_allocated() - base - y.nbytes)
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        dx, _ = torch.autograd.grad(y, (x, module.weight), grad)
        peak.append(torch.cuda.max_memory_allocated() - start - dx.nbytes)
        del y, dx
    per_token = (4 if dtype == torch.float32 else 6) * width + 4
    assert kept[0] >= tokens * per_token and kept[1] <= tokens * 4 + 2**20, kept
    assert peak[0] >= 2 * 4 * tokens * width and peak[1] <= 8 * rms_norm.CHUNK_BYTES, peak


@pytest.mark.gpu
@pytest.mark.parametrize("family", [f for f in NORMS if f != "llama"])
def test_cuda_other_forms_bitwise(family):
    """On a GPU the other forms too: the probe picks the form (its fp16 autocast case included; Gemma3n's
    pow(., -0.5) against rsqrt), the output bit for bit, gradients no further from float64 than the module's."""
    device, shape = torch.device("cuda"), (2, 9, 256)
    for dtype in DTYPES:
        module = _norm(shape[-1], dtype, 26, family=family).to(device)
        assert rms_norm.probe(module) == (NORMS[family], "")
        x = _input(shape, dtype, 27).to(device)
        assert torch.equal(_lean(module)(x), module(x))
        grad = torch.randn(shape, device=device).to(dtype)
        lean = _grads(_lean(module), x, module.weight, grad)
        reference = copy.deepcopy(module).double()
        want = _grads(reference, x.double(), reference.weight, grad.double())
        eager = _grads(module, x, module.weight, grad)
        for got, base, ref in zip(lean, eager, want):
            assert (got.double() - ref).abs().max() <= 1.5 * (base.double() - ref).abs().max() + 1e-3 * ref.abs().max()

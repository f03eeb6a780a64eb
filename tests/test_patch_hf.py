"""volta_train.patch / unpatch on HuggingFace models (tiny, random-init, CPU, no downloads).

Reference everywhere: the same weights with stock attn_implementation="sdpa" (or
"eager" where sdpa lacks the feature), float32, eval mode, compared on the
non-padded positions only. Spies on volta_train.flash_attn_func /
flash_attn_varlen_func prove the attention really ran through volta_train.
"""

from __future__ import annotations

import contextlib
import importlib
import re
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    BertConfig,
    GPT2Config,
    LlamaConfig,
    T5Config,
    T5ForConditionalGeneration,
)

import volta_train  # noqa: E402
from volta_train.integrations import hf  # noqa: E402

VOCAB, BATCH, SEQ, LAYERS, HEADS, HIDDEN = 97, 3, 9, 2, 4, 32
LENGTHS = (SEQ, 6, 3)  # tokens per row when padded
TOL = dict(rtol=1e-5, atol=1e-5)


def gpt2_config(**overrides) -> GPT2Config:
    settings = dict(
        vocab_size=VOCAB, n_positions=64, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.3, bos_token_id=1, eos_token_id=1, pad_token_id=0,
    )
    return GPT2Config(**{**settings, **overrides})


def bert_config(**overrides) -> BertConfig:
    settings = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_size=2 * HIDDEN, max_position_embeddings=64, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, initializer_range=0.3,
    )
    return BertConfig(**{**settings, **overrides})


ATTENTION = {"gpt2": "transformer.h.0.attn", "bert": "bert.encoder.layer.0.attention.self"}
FAMILIES = {
    "gpt2": (gpt2_config, AutoModelForCausalLM, "attn_pdrop"),
    "bert": (bert_config, AutoModelForMaskedLM, "attention_probs_dropout_prob"),
}


def supported_here(family: str) -> bool:
    """Whether the installed transformers is recent enough for this family (else patch() refuses it)."""
    return hf._release(hf._installed_transformers()) >= hf._release(hf.FAMILIES[family].min_transformers)


def register_or_skip() -> None:
    if not any(supported_here(family) for family in hf.FAMILIES):
        pytest.skip(f"transformers {transformers.__version__} is older than every supported family needs")
    hf.register()


def build(family: str, attn: str = "sdpa", seed: int = 0, auto=None, **overrides):
    if not supported_here(family):
        pytest.skip(f"transformers {transformers.__version__} is older than {family} needs")
    make_config, default_auto, _ = FAMILIES[family]
    torch.manual_seed(seed)  # same seed, same weights, whatever the attention implementation
    return (auto or default_auto).from_config(make_config(**overrides), attn_implementation=attn).eval()


def tokens(batch: int = BATCH, seqlen: int = SEQ) -> torch.Tensor:
    return torch.randint(2, VOCAB, (batch, seqlen), generator=torch.Generator().manual_seed(1))


def padding_mask(padding: str, batch: int = BATCH, seqlen: int = SEQ) -> torch.Tensor | None:
    if padding == "none":
        return None
    mask = torch.zeros(batch, seqlen, dtype=torch.long)
    for row, length in enumerate(LENGTHS[:batch]):
        if padding == "right":
            mask[row, :length] = 1
        else:
            mask[row, seqlen - length :] = 1
    return mask


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str = "", rtol: float = 1e-5) -> None:
    """Equal up to rtol relative to the largest magnitude in `expected` (fp32 sums in a different order)."""
    scale = expected.abs().max().clamp_min(1e-6)
    error = (actual - expected).abs().max()
    assert error <= rtol * scale, f"{what}: max |difference| {error:.3g} > {rtol:g} x max |expected| {scale:.3g}"


def assert_grads_close(grads: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert grads.keys() == expected.keys()
    scale = max(g.abs().max() for g in expected.values())
    for name, reference in expected.items():
        if name.endswith("attention.self.key.bias"):
            # zero in exact arithmetic (softmax ignores a per-query constant): both sides are rounding noise
            assert max(grads[name].abs().max(), reference.abs().max()) <= 1e-5 * scale, name
        else:
            assert_close(grads[name], reference, f"gradient of {name}")


def run(model, ids, mask, **kwargs):
    """Logits and parameter gradients of a loss over the non-padded positions only."""
    model.zero_grad(set_to_none=True)
    logits = model(ids, attention_mask=mask, **kwargs).logits
    keep = torch.ones(ids.shape, dtype=torch.bool) if mask is None else mask.bool()
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(2))
    (logits * weights)[keep].sum().backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return logits.detach()[keep], grads


@contextlib.contextmanager
def spies():
    """Wrap the public volta_train entry points the integration must call."""
    with mock.patch.object(volta_train, "flash_attn_func", wraps=volta_train.flash_attn_func) as dense, \
            mock.patch.object(volta_train, "flash_attn_varlen_func", wraps=volta_train.flash_attn_varlen_func) as varlen:
        yield dense, varlen


def option(call, name: str):
    return call.kwargs[name]


def shapes(dense, varlen) -> list[tuple[int, int]]:
    """(seqlen_q, seqlen_k) of every call: dense [b, s, h, d]; varlen max_seqlen_q/k."""
    return [(c.args[0].shape[1], c.args[1].shape[1]) for c in dense.call_args_list] + [
        (c.args[5], c.args[6]) for c in varlen.call_args_list
    ]


# ---------------------------------------------------------------------------------------------------------
# equality with stock attention
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("padding", ["none", "right", "left"])
@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_logits_and_grads_match_sdpa(family, padding):
    model = build(family)
    ids, mask = tokens(), padding_mask(padding)
    ref_logits, ref_grads = run(model, ids, mask)

    assert volta_train.patch(model) is model
    assert model.config._attn_implementation == hf.ATTN_IMPLEMENTATION
    with spies() as (dense, varlen):
        logits, grads = run(model, ids, mask)

    # the attention really ran through volta_train, on the path the padding calls for
    if mask is None:
        assert (dense.call_count, varlen.call_count) == (LAYERS, 0)
    else:
        assert (dense.call_count, varlen.call_count) == (0, LAYERS)
        assert varlen.call_args.args[3].tolist() == [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]
    calls = dense.call_args_list + varlen.call_args_list
    assert all(option(c, "causal") is (family == "gpt2") for c in calls)
    assert all(option(c, "dropout_p") == 0.0 for c in calls)

    torch.testing.assert_close(logits, ref_logits, **TOL)
    assert_grads_close(grads, ref_grads)


def test_padded_query_positions_are_zero():
    model = build("bert")
    mask = padding_mask("right")
    volta_train.patch(model)
    outputs = []
    handle = model.bert.encoder.layer[0].attention.self.register_forward_hook(lambda m, a, o: outputs.append(o[0]))
    model(tokens(), attention_mask=mask)
    handle.remove()
    attn = outputs[0].view(BATCH, SEQ, -1)
    assert attn[~mask.bool()].abs().max() == 0
    assert attn[mask.bool()].abs().min(dim=-1).values.gt(0).any()


def test_gpt2_scale_attn_by_inverse_layer_idx():
    layers = 3
    reference = build("gpt2", attn="eager", n_layer=layers, scale_attn_by_inverse_layer_idx=True)
    unscaled = build("gpt2", attn="eager", n_layer=layers)
    ids, mask = tokens(), padding_mask("left")
    ref_logits, ref_grads = run(reference, ids, mask)
    # the option matters for these weights: ignoring it would be caught
    assert (run(unscaled, ids, mask)[0] - ref_logits).abs().max() > 1e-2

    volta_train.patch(reference)
    with spies() as (dense, varlen):
        logits, grads = run(reference, ids, mask)
    head_dim = HIDDEN // HEADS
    assert [option(c, "softmax_scale") for c in varlen.call_args_list] == pytest.approx(
        [head_dim**-0.5 / (i + 1) for i in range(layers)]
    )
    torch.testing.assert_close(logits, ref_logits, **TOL)
    assert_grads_close(grads, ref_grads)


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_cross_attention_pads_keys_only(family):
    """Encoder padding must mask keys, never decoder queries (same lengths, so a mix-up would show)."""
    if family == "gpt2" and hf._release(hf._installed_transformers()) < hf._release(hf.GPT2_ENCODER_MASK_FIXED):
        pytest.skip("this transformers drops GPT-2's encoder_attention_mask (patch refuses, see the next test)")
    decoder = dict(is_decoder=True) if family == "bert" else {}
    model = build(family, auto=AutoModelForCausalLM, add_cross_attention=True, **decoder)
    ids = tokens()
    encoder = torch.randn(BATCH, SEQ, HIDDEN, generator=torch.Generator().manual_seed(3))
    encoder_mask = padding_mask("right")
    kwargs = dict(encoder_hidden_states=encoder, encoder_attention_mask=encoder_mask)
    ref = model(ids, **kwargs).logits
    volta_train.patch(model)
    with spies() as (dense, varlen):
        out = model(ids, **kwargs).logits
    assert varlen.call_count == LAYERS  # the cross-attentions; the self-attentions have no padding
    torch.testing.assert_close(out, ref, **TOL)  # every decoder position, padding is on the encoder side


def test_gpt2_cross_attention_refused_where_transformers_drops_the_encoder_mask(monkeypatch):
    model = build("gpt2", add_cross_attention=True)
    monkeypatch.setattr(hf, "_installed_transformers", lambda: "5.8.1")
    with pytest.raises(hf.TransformersVersionError, match="encoder_attention_mask.*5.16.0"):
        volta_train.patch(model)
    assert model.config._attn_implementation == "sdpa"
    volta_train.patch(build("gpt2"))  # without cross-attention that version is fine


# ---------------------------------------------------------------------------------------------------------
# KV cache, generation, dropout
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("padding", ["none", "left"])
def test_generate_greedy_matches_sdpa(padding, cache):
    model = build("gpt2")
    ids, mask = tokens(), padding_mask(padding)
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_scores=True)
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    if mask is not None:
        kwargs["attention_mask"] = mask
    ref = model.generate(ids, **kwargs)
    volta_train.patch(model)
    with spies() as (dense, varlen):
        out = model.generate(ids, **kwargs)
    assert torch.equal(out.sequences, ref.sequences)
    for score, ref_score in zip(out.scores, ref.scores):
        torch.testing.assert_close(score, ref_score, **TOL)
    # decoding ran one query against the cached keys (bottom-right causal)
    assert any(sq == 1 and sk > 1 for sq, sk in shapes(dense, varlen))


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_dropout_only_in_training(family):
    _, _, dropout_field = FAMILIES[family]
    model = build(family, **{dropout_field: 0.5})
    ids, mask = tokens(), padding_mask("right")
    keep = mask.bool()
    stock_eval = model(ids, attention_mask=mask).logits[keep]
    volta_train.patch(model)

    def logits(seed):
        torch.manual_seed(seed)
        return model(ids, attention_mask=mask).logits[keep]

    model.train()
    with spies() as (_, varlen):
        first, again, other = logits(0), logits(0), logits(1)
    assert all(option(c, "dropout_p") == 0.5 for c in varlen.call_args_list)
    assert torch.equal(first, again)
    assert (first - other).abs().max() > 1e-3
    assert (first - stock_eval).abs().max() > 1e-3

    model.eval()
    with spies() as (_, varlen):
        evaluated = logits(0)
    assert all(option(c, "dropout_p") == 0.0 for c in varlen.call_args_list)
    torch.testing.assert_close(evaluated, stock_eval, **TOL)


# ---------------------------------------------------------------------------------------------------------
# patch / unpatch / register
# ---------------------------------------------------------------------------------------------------------


def test_patch_is_idempotent():
    model = build("gpt2")
    volta_train.patch(model)
    record = model.__dict__[hf._PATCH_ATTR]
    assert volta_train.patch(model) is model
    assert model.__dict__[hf._PATCH_ATTR] is record
    assert model.config._attn_implementation == hf.ATTN_IMPLEMENTATION
    volta_train.unpatch(model)
    assert model.config._attn_implementation == "sdpa"  # the original, not volta_train
    assert volta_train.unpatch(model) is model  # unpatching twice is harmless


@pytest.mark.parametrize("previous", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_unpatch_restores_stock(family, previous):
    model = build(family, attn=previous)
    ids, mask = tokens(), padding_mask("left")
    stock = model(ids, attention_mask=mask).logits
    volta_train.patch(model)
    model(ids, attention_mask=mask)
    assert volta_train.unpatch(model) is model
    assert model.config._attn_implementation == previous
    assert all(m.config._attn_implementation == previous for m in model.modules() if hasattr(m, "config"))
    with spies() as (dense, varlen):
        restored = model(ids, attention_mask=mask, output_attentions=previous == "eager").logits
    assert dense.call_count == varlen.call_count == 0
    assert torch.equal(restored, stock)


def test_unsupported_family_raises_listing_supported():
    torch.manual_seed(0)
    config = T5Config(vocab_size=VOCAB, d_model=HIDDEN, d_kv=8, d_ff=64, num_layers=1, num_heads=HEADS)
    model = T5ForConditionalGeneration._from_config(config, attn_implementation="eager")
    with pytest.raises(hf.UnsupportedModelError) as info:
        volta_train.patch(model)
    message = str(info.value)
    assert "'t5'" in message and "bert, gpt2" in message
    assert model.config._attn_implementation == "eager"  # untouched, no half-patched state
    assert hf._PATCH_ATTR not in model.__dict__


def test_load_time_implementation_on_unsupported_family_refuses_to_run():
    register_or_skip()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=HEADS, num_key_value_heads=2,
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation=hf.ATTN_IMPLEMENTATION)
    with pytest.raises(hf.UnsupportedModelError, match="'llama'.*supported model_type values: bert, gpt2"):
        model(tokens())


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_attn_implementation_at_load_time(family):
    register_or_skip()
    stock = build(family)
    model = build(family, attn=hf.ATTN_IMPLEMENTATION)
    assert model.config._attn_implementation == hf.ATTN_IMPLEMENTATION
    ids, mask = tokens(), padding_mask("left")
    with spies() as (dense, varlen):
        out = model(ids, attention_mask=mask).logits
    assert varlen.call_count == LAYERS
    keep = mask.bool()
    torch.testing.assert_close(out[keep], stock(ids, attention_mask=mask).logits[keep], **TOL)
    with pytest.raises(ValueError, match="from load time"):
        volta_train.unpatch(model)

    stock.set_attn_implementation(hf.ATTN_IMPLEMENTATION)  # the other public switch works too
    with spies() as (dense, varlen):
        stock(ids, attention_mask=mask)
    assert varlen.call_count == LAYERS


@pytest.mark.parametrize("route", ["patch", "load_time"])
@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_output_attentions_is_refused(family, route):
    register_or_skip()
    model = build(family, attn=hf.ATTN_IMPLEMENTATION) if route == "load_time" else volta_train.patch(build(family))
    with pytest.raises(ValueError, match="output_attentions=True.*eager"):
        model(tokens(), output_attentions=True)


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_family_on_too_old_transformers_is_refused(family, monkeypatch):
    make_config, auto, _ = FAMILIES[family]
    torch.manual_seed(0)
    model = auto.from_config(make_config(), attn_implementation="sdpa")
    simulated = supported_here(family)  # recent enough: play an old release (on an old one, this runs for real)
    if simulated:
        monkeypatch.setattr(hf, "_installed_transformers", lambda: "4.57.6")
    installed, minimum = hf._installed_transformers(), hf.FAMILIES[family].min_transformers
    with pytest.raises(hf.TransformersVersionError, match=rf"{re.escape(installed)}.*transformers>={re.escape(minimum)}"):
        volta_train.patch(model)
    assert model.config._attn_implementation == "sdpa"
    if simulated:
        with pytest.raises(hf.TransformersVersionError):  # the load-time route checks too
            hf.attention_forward(model.get_submodule(ATTENTION[family]), *[torch.randn(1, 1, 2, 8)] * 3, None)


def test_transformers_without_mask_interface_is_refused(monkeypatch):
    try:  # recent enough: remove the interface (on transformers < 4.53, this test runs for real)
        monkeypatch.delattr(importlib.import_module("transformers.masking_utils"), "AttentionMaskInterface")
    except (ImportError, AttributeError):
        pass
    minimum = max((f.min_transformers for f in hf.FAMILIES.values()), key=hf._release)
    with pytest.raises(hf.TransformersVersionError, match=rf"AttentionMaskInterface.*4\.53\.0.*>={re.escape(minimum)}"):
        hf.register()


# ---------------------------------------------------------------------------------------------------------
# masks the integration must refuse rather than drop
# ---------------------------------------------------------------------------------------------------------


def test_packed_sequences_from_position_ids_are_refused():
    model = volta_train.patch(build("gpt2"))
    ids = tokens(batch=1, seqlen=8)
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
    # without a cache (training) transformers reads packing from position_ids; a 2-D padding mask cannot express it
    with pytest.raises(NotImplementedError, match="mask_function.*packed sequences"):
        model(ids, position_ids=position_ids, use_cache=False)


def test_custom_4d_mask_is_refused():
    model = volta_train.patch(build("gpt2"))
    mask = torch.zeros(BATCH, 1, SEQ, SEQ)
    with pytest.raises(ValueError, match="2-D"):
        model(tokens(), attention_mask=mask)


def test_sliding_window_mask_function_is_refused():
    register_or_skip()
    from transformers import masking_utils

    with pytest.raises(NotImplementedError, match="sliding"):
        hf.padding_mask(
            batch_size=1, kv_length=4, mask_function=masking_utils.sliding_window_causal_mask_function(2),
        )


# ---------------------------------------------------------------------------------------------------------
# the attention function itself: GQA without repeating K/V, queries shorter than keys, unsupported kwargs
# ---------------------------------------------------------------------------------------------------------


def fake_module(**attributes):
    if not supported_here("gpt2"):
        pytest.skip(f"transformers {transformers.__version__} is older than gpt2 needs")
    return SimpleNamespace(config=SimpleNamespace(model_type="gpt2"), training=False, is_cross_attention=False, **attributes)


def explicit_attention(q, k, v, visible, scale):
    """q [b, h, sq, d], k/v [b, hkv, sk, d], visible bool [b, sq, sk] -> [b, sq, h, d] in float64."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    scores = torch.einsum("bhid,bhjd->bhij", q.double(), k) * scale
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    return torch.einsum("bhij,bhjd->bihd", scores.softmax(-1), v)


@pytest.mark.parametrize("causal", [True, False])
def test_gqa_and_cached_queries(causal):
    generator = torch.Generator().manual_seed(4)
    batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim = 2, 8, 2, 3, 7, 8
    q = torch.randn(batch, heads, seqlen_q, head_dim, generator=generator)
    k = torch.randn(batch, kv_heads, seqlen_k, head_dim, generator=generator)
    v = torch.randn(batch, kv_heads, seqlen_k, head_dim, generator=generator)
    mask = torch.ones(batch, seqlen_k, dtype=torch.bool)
    mask[1, :3] = False  # left padding of row 1
    with spies() as (dense, varlen):
        out, weights = hf.attention_forward(fake_module(is_causal=causal), q, k, v, mask, scaling=0.3)
    assert weights is None
    assert varlen.call_args.args[1].shape[1] == kv_heads  # K/V not repeated
    position = torch.arange(seqlen_k - seqlen_q, seqlen_k)  # the queries are the last tokens
    visible = mask[:, None, :].expand(batch, seqlen_q, seqlen_k).clone()
    if causal:
        visible &= torch.arange(seqlen_k)[None, None, :] <= position[None, :, None]
    expected = explicit_attention(q, k, v, visible, 0.3)
    torch.testing.assert_close(out.double(), expected, **TOL)

    dense_out, _ = hf.attention_forward(fake_module(is_causal=causal), q, k, v, None, scaling=0.3)
    all_visible = torch.ones(batch, seqlen_q, seqlen_k, dtype=torch.bool)
    if causal:
        all_visible &= torch.arange(seqlen_k)[None, None, :] <= position[None, :, None]
    torch.testing.assert_close(dense_out.double(), explicit_attention(q, k, v, all_visible, 0.3), **TOL)


@pytest.mark.parametrize("name, value", [("sliding_window", 4), ("softcap", 30.0), ("cu_seq_lens_q", torch.zeros(2))])
def test_unsupported_kwargs_are_refused(name, value):
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(NotImplementedError, match=name):
        hf.attention_forward(fake_module(is_causal=True), q, q, q, None, **{name: value})


@pytest.mark.parametrize("training, expected", [(True, 0.25), (False, 0.0)])
def test_dropout_kwarg_is_used_in_training_mode_only(training, expected):
    q = torch.randn(1, 2, 4, 8)
    module = fake_module(is_causal=True)
    module.training = training
    with spies() as (dense, _):
        hf.attention_forward(module, q, q, q, None, dropout=0.25, scaling=0.5)
    assert option(dense.call_args, "dropout_p") == expected

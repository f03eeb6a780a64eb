"""volta_train.patch / unpatch on HuggingFace models (tiny, random-init, CPU, no downloads).

Every family volta_train supports gets a tiny model from a config. Reference
everywhere: the same weights with stock attn_implementation="sdpa" (or "eager"
where sdpa lacks the feature), float32, compared on the non-padded positions
only. Spies on volta_train.flash_attn_func / flash_attn_varlen_func prove the
attention really ran through volta_train, on the path the input calls for.
"""

from __future__ import annotations

import importlib
import re
from types import SimpleNamespace
from typing import Callable
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    AlbertConfig,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    BertConfig,
    DataCollatorWithFlattening,
    DistilBertConfig,
    ElectraConfig,
    GPT2Config,
    GPTJConfig,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    PhiConfig,
    Qwen2Config,
    RobertaConfig,
    T5Config,
    T5ForConditionalGeneration,
)

import volta_train  # noqa: E402
from volta_train.integrations import hf  # noqa: E402
from volta_train.integrations.hf import attention as hf_attention  # noqa: E402
from volta_train.integrations.hf import base as hf_base  # noqa: E402
from volta_train.integrations.hf import masks as hf_masks  # noqa: E402
from volta_train.integrations.hf.families import GPT2_ENCODER_MASK_FIXED, interface_modules  # noqa: E402
from volta_train.integrations.hf.patching import _PATCH_ATTR  # noqa: E402
from hf_compare import (  # noqa: E402
    BATCH, LENGTHS, SEQ, VOCAB, assert_close, assert_grads_close, padding_mask, run, run_stock_then_patched, spies,
    tokens,
)

LAYERS, HEADS, HIDDEN = 2, 4, 32
WINDOW = 4  # Mistral / Qwen2 sliding window: shorter than SEQ, so it matters
TOL = dict(rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------
# tiny models, one per family
# ---------------------------------------------------------------------------------------------------------


def _decoder(**settings) -> dict:
    return dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, max_position_embeddings=64, initializer_range=0.3, bos_token_id=1,
        eos_token_id=1, pad_token_id=0, **settings,
    )


def _encoder(**settings) -> dict:
    defaults = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_size=2 * HIDDEN, max_position_embeddings=64, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, initializer_range=0.3,
    )
    return {**defaults, **settings}


CONFIGS: dict[str, Callable[[], object]] = {
    "gpt2": lambda: GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.3, bos_token_id=1, eos_token_id=1, pad_token_id=0,
    ),
    "gpt_neox": lambda: GPTNeoXConfig(**_decoder(rotary_pct=0.5, attention_dropout=0.0, hidden_dropout=0.0)),
    "llama": lambda: LlamaConfig(**_decoder(num_key_value_heads=2)),  # GQA
    "mistral": lambda: MistralConfig(**_decoder(num_key_value_heads=1, sliding_window=WINDOW)),  # MQA + window
    "qwen2": lambda: Qwen2Config(  # GQA, layer 0 full attention, layer 1 sliding window
        **_decoder(num_key_value_heads=2, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    ),
    "phi": lambda: PhiConfig(**_decoder(partial_rotary_factor=0.5, resid_pdrop=0.0, embd_pdrop=0.0)),
    "bert": lambda: BertConfig(**_encoder()),
    "roberta": lambda: RobertaConfig(**_encoder(pad_token_id=1, max_position_embeddings=72)),
    "electra": lambda: ElectraConfig(**_encoder(embedding_size=16)),
    "albert": lambda: AlbertConfig(**_encoder(embedding_size=16)),
    "distilbert": lambda: DistilBertConfig(
        vocab_size=VOCAB, dim=HIDDEN, n_layers=LAYERS, n_heads=HEADS, hidden_dim=2 * HIDDEN,
        max_position_embeddings=64, dropout=0.0, attention_dropout=0.0, initializer_range=0.3,
    ),
}
CAUSAL = ["gpt2", "gpt_neox", "llama", "mistral", "qwen2", "phi"]
ENCODERS = ["bert", "roberta", "electra", "albert", "distilbert"]
ALL = CAUSAL + ENCODERS
DROPOUT_FIELD = {
    "gpt2": "attn_pdrop", "distilbert": "attention_dropout",
    **{family: "attention_dropout" for family in CAUSAL[1:]},
    **{family: "attention_probs_dropout_prob" for family in ("bert", "roberta", "electra", "albert")},
}
KV_HEADS = {"llama": 2, "mistral": 1, "qwen2": 2}


def supported_here(family: str) -> bool:
    """Whether the installed transformers is recent enough for this family (else patch() refuses it)."""
    return hf.release(hf_base.installed_transformers()) >= hf.release(hf.FAMILIES[family].min_transformers)


def register_or_skip() -> None:
    if hf.release(hf_base.installed_transformers()) < hf.release(hf.MIN_TRANSFORMERS):
        pytest.skip(f"transformers {transformers.__version__} is older than every supported family needs")
    hf.register()


def config_of(family: str, **overrides):
    config = CONFIGS[family]()
    for name, value in overrides.items():
        setattr(config, name, value)
    return config


def build(family: str, attn: str = "sdpa", seed: int = 0, auto=None, **overrides):
    if not supported_here(family):
        pytest.skip(f"transformers {transformers.__version__} is older than {family} needs")
    default_auto = AutoModelForCausalLM if family in CAUSAL else AutoModelForMaskedLM
    torch.manual_seed(seed)  # same seed, same weights, whatever the attention implementation
    return (auto or default_auto).from_config(config_of(family, **overrides), attn_implementation=attn).eval()


def option(call, name: str, default=None):
    return call.kwargs.get(name, default)


def shapes(dense, varlen) -> list[tuple[int, int]]:
    """(seqlen_q, seqlen_k) of every call: dense [b, s, h, d]; varlen max_seqlen_q/k."""
    return [(c.args[0].shape[1], c.args[1].shape[1]) for c in dense.call_args_list] + [
        (c.args[5], c.args[6]) for c in varlen.call_args_list
    ]


def first_attention(model, family: str):
    return interface_modules(model)[0]


# ---------------------------------------------------------------------------------------------------------
# equality with stock attention
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("padding", ["none", "right", "left"])
@pytest.mark.parametrize("family", ALL)
def test_logits_and_grads_match_sdpa(family, padding):
    model = build(family)
    ids, mask = tokens(), padding_mask(padding)
    patched = run_stock_then_patched(model, ids, mask)
    dense, varlen = patched.dense, patched.varlen

    assert patched.returned is model
    assert model.config._attn_implementation == hf.ATTN_IMPLEMENTATION

    # the attention really ran through volta_train, on the path the padding calls for
    if mask is None:
        assert (dense.call_count, varlen.call_count) == (LAYERS, 0)
    else:
        assert (dense.call_count, varlen.call_count) == (0, LAYERS)
        assert varlen.call_args.args[3].tolist() == [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]
    calls = dense.call_args_list + varlen.call_args_list
    assert all(option(c, "causal") is (family in CAUSAL) for c in calls)
    assert all(option(c, "dropout_p") == 0.0 for c in calls)
    k_heads = [c.args[1].shape[-2] for c in calls]
    assert k_heads == [KV_HEADS.get(family, HEADS)] * LAYERS  # GQA/MQA: K/V never repeated
    windows = [option(c, "window_size") for c in calls]
    expected_window = {"mistral": [(WINDOW - 1, 0)] * LAYERS, "qwen2": [None, (WINDOW - 1, 0)]}
    assert windows == expected_window.get(family, [None] * LAYERS)

    torch.testing.assert_close(patched.logits, patched.ref_logits, **TOL)
    assert_grads_close(patched.grads, patched.ref_grads)


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_sliding_window_matters(family):
    """The window changes the result (so the comparison with sdpa above is a real test of it)."""
    ids, mask = tokens(), padding_mask("left")
    keep = mask.bool()
    windowed = volta_train.patch(build(family))(ids, attention_mask=mask).logits[keep]
    wide = volta_train.patch(build(family, sliding_window=SEQ))(ids, attention_mask=mask).logits[keep]
    assert (windowed - wide).abs().max() > 1e-3


@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("family", ["bert", "distilbert", "llama", "mistral"])
def test_padded_query_positions_hold_eagers_rows(family, padding):
    """The first attention layer's output at every position, padded ones included, is eager's."""
    mask = padding_mask(padding)
    outputs = []
    for attn in ("eager", "volta_train"):
        model = build(family, attn="eager")
        if attn == "volta_train":
            volta_train.patch(model)
        handle = first_attention(model, family).register_forward_hook(lambda m, a, o: outputs.append(o[0]))
        model(tokens(), attention_mask=mask)
        handle.remove()
    reference, ours = (out.reshape(BATCH, SEQ, -1) for out in outputs)
    assert reference[~mask.bool()].abs().amax() > 1e-3
    torch.testing.assert_close(ours, reference, **TOL)


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


@pytest.mark.parametrize("family", ["gpt2", "bert", "roberta", "electra"])
def test_cross_attention_pads_keys_only(family):
    """Encoder padding must mask keys, never decoder queries (same lengths, so a mix-up would show)."""
    if family == "gpt2" and hf.release(hf_base.installed_transformers()) < hf.release(GPT2_ENCODER_MASK_FIXED):
        pytest.skip("this transformers drops GPT-2's encoder_attention_mask (patch refuses, see the next test)")
    decoder = dict(is_decoder=True) if family != "gpt2" else {}
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
    assert dense.call_count == LAYERS and all(option(c, "causal") for c in dense.call_args_list)
    torch.testing.assert_close(out, ref, **TOL)  # every decoder position, padding is on the encoder side


def test_gpt2_cross_attention_refused_where_transformers_drops_the_encoder_mask(monkeypatch):
    model = build("gpt2", add_cross_attention=True)
    monkeypatch.setattr(hf_base, "installed_transformers", lambda: "5.8.1")
    with pytest.raises(hf.TransformersVersionError, match="encoder_attention_mask.*5.16.0"):
        volta_train.patch(model)
    assert model.config._attn_implementation == "sdpa"
    volta_train.patch(build("gpt2"))  # without cross-attention that version is fine


# ---------------------------------------------------------------------------------------------------------
# packed sequences (padding-free training with DataCollatorWithFlattening)
# ---------------------------------------------------------------------------------------------------------

PACKED_LENGTHS = (5, 9, 3, 7)


def packed_sequences() -> list[list[int]]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(2, VOCAB, (n,), generator=generator).tolist() for n in PACKED_LENGTHS]


def per_sequence_loss(model, sequences) -> torch.Tensor:
    """The mean next-token loss over all sequences, each run alone (what packing must reproduce)."""
    total, count = 0.0, 0
    for sequence in sequences:
        ids = torch.tensor([sequence])
        logits = model(ids, use_cache=False).logits[0, :-1]
        total = total + F.cross_entropy(logits, ids[0, 1:], reduction="sum")
        count += len(sequence) - 1
    return total / count


def loss_and_grads(model, compute):
    model.zero_grad(set_to_none=True)
    loss = compute()
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


PACKED_CASES = [
    (family, flash_kwargs, use_cache)
    for family in CAUSAL
    for flash_kwargs in (False, True)
    for use_cache in (False, True)
    # every combination for GPT-2 and Llama (issue 5); the other causal families: both routes, fewer combinations
    if family in ("gpt2", "llama") or flash_kwargs != use_cache
]


@pytest.mark.parametrize("family, flash_kwargs, use_cache", PACKED_CASES)
def test_packed_loss_equals_per_sequence_loss(family, flash_kwargs, use_cache):
    model = build(family)
    sequences = packed_sequences()
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)([{"input_ids": s} for s in sequences])
    ref_loss, ref_grads = loss_and_grads(model, lambda: per_sequence_loss(model, sequences))
    if family == "gpt2" and use_cache:
        # stock sdpa with a cache never looks for packing: its sequences see each other (the test can tell)
        assert (model(**batch, use_cache=True).loss - ref_loss).abs() > 1e-3

    volta_train.patch(model)
    with spies() as (dense, varlen):
        loss, grads = loss_and_grads(model, lambda: model(**batch, use_cache=use_cache).loss)
    assert (dense.call_count, varlen.call_count) == (0, LAYERS)
    expected_cu = [0, *torch.tensor(PACKED_LENGTHS).cumsum(0).tolist()]
    assert all(c.args[3].tolist() == c.args[4].tolist() == expected_cu for c in varlen.call_args_list)
    assert all(c.args[5] == c.args[6] == max(PACKED_LENGTHS) for c in varlen.call_args_list)
    assert_close(loss, ref_loss, "packed loss")
    assert_grads_close(grads, ref_grads, rtol=1e-4)


@pytest.mark.parametrize("use_cache", [False, True])
def test_packed_rows_of_a_batch(use_cache):
    """Several rows, each packing sequences (position_ids restart): no sequence sees another, in any row."""
    model = build("llama")
    ids = tokens(batch=2, seqlen=8)
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 0, 1]])
    pieces = [(0, 0, 3), (0, 3, 8), (1, 0, 6), (1, 6, 8)]
    volta_train.patch(model)
    with spies() as (_, varlen):
        packed = model(ids, position_ids=position_ids, use_cache=use_cache).logits
    assert varlen.call_args.args[3].tolist() == [0, 3, 8, 14, 16]
    for row, start, end in pieces:
        alone = model(ids[row : row + 1, start:end], use_cache=False).logits[0]
        torch.testing.assert_close(packed[row, start:end], alone, **TOL)


def test_packing_from_seq_idx():
    """DataCollatorWithFlattening(return_seq_idx=True) without position_ids: seq_idx alone tells the sequences."""
    model = build("llama")  # rotary positions: a sequence's logits do not depend on where it starts
    sequences = packed_sequences()
    collator = DataCollatorWithFlattening(return_position_ids=False, return_seq_idx=True)
    batch = collator([{"input_ids": s} for s in sequences])
    ref = per_sequence_loss(model, sequences)
    volta_train.patch(model)
    with spies() as (_, varlen):
        loss = model(**batch).loss
    assert varlen.call_count == LAYERS
    assert_close(loss, ref, "packed loss")


def test_packed_kwargs_must_come_in_pairs():
    q = torch.randn(1, 2, 6, 8)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seq_lens_q was passed without cu_seq_lens_k"):
        hf.hf_attention_forward(fake_module(is_causal=True), q, q, q, None, scaling=0.5, cu_seq_lens_q=cu)
    with pytest.raises(ValueError, match="cu_seqlens_q ends at 5 but there are 6"):
        short = cu - cu.clamp(max=1)  # [0, 1, 5]: one token short
        hf.hf_attention_forward(fake_module(is_causal=True), q, q, q, None, scaling=0.5, cu_seq_lens_q=short, cu_seq_lens_k=cu)


# ---------------------------------------------------------------------------------------------------------
# KV cache, generation, dropout, gradient checkpointing, torch.compile
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("padding", ["none", "left"])
@pytest.mark.parametrize("family", CAUSAL)
def test_generate_greedy_matches_sdpa(family, padding, cache):
    model = build(family)
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


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_dropout_only_in_training(family):
    model = build(family, **{DROPOUT_FIELD[family]: 0.5})
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


@pytest.mark.parametrize("family", ALL)
def test_gradient_checkpointing(family):
    """Checkpointed training (the attention runs again in backward) gives stock sdpa's gradients."""
    model = build(family).train()
    if not model.supports_gradient_checkpointing:
        pytest.skip(f"transformers {transformers.__version__} has no gradient checkpointing for {family}")
    model.gradient_checkpointing_enable()
    ids, mask = tokens(), padding_mask("left")
    ref_logits, ref_grads = run(model, ids, mask)
    volta_train.patch(model)
    with spies() as (_, varlen):
        logits, grads = run(model, ids, mask)
    assert varlen.call_count == 2 * LAYERS  # forward, and again in backward
    torch.testing.assert_close(logits, ref_logits, **TOL)
    assert_grads_close(grads, ref_grads)


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_gradient_checkpointing_replays_the_dropout_mask(family):
    ids, mask = tokens(), padding_mask("left")
    results = []
    for checkpointing in (False, True):
        model = volta_train.patch(build(family, **{DROPOUT_FIELD[family]: 0.3})).train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        torch.manual_seed(7)
        results.append(run(model, ids, mask))
    torch.testing.assert_close(results[1][0], results[0][0], **TOL)
    assert_grads_close(results[1][1], results[0][1])


# The patch is one attention function for every family; these cover its inputs: GPT-2's own attention class, rotary
# embeddings with GQA (Llama) and with MQA and a window (Mistral), and two encoders' padding masks.
COMPILED = ["gpt2", "llama", "mistral", "bert", "distilbert"]


@pytest.mark.parametrize("family", COMPILED)
def test_torch_compile(family):
    """torch.compile(model) trains and evaluates like the eager patched model (CPU, aot_eager backend)."""
    model = volta_train.patch(build(family, num_hidden_layers=1)).train()
    ids, mask = tokens(), padding_mask("left")
    ref_logits, ref_grads = run(model, ids, mask, use_cache=False)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager")
    with spies() as (_, varlen):
        logits, grads = run(model, ids, mask, forward=compiled, use_cache=False)
    assert varlen.call_count == 1
    assert counters["stats"]["unique_graphs"] >= 2  # compiled for real (the attention call breaks the graph)
    torch.testing.assert_close(logits, ref_logits, **TOL)
    assert_grads_close(grads, ref_grads)


# ---------------------------------------------------------------------------------------------------------
# patch / unpatch / register / loading
# ---------------------------------------------------------------------------------------------------------


def test_patch_is_idempotent():
    model = build("gpt2")
    volta_train.patch(model)
    record = model.__dict__[_PATCH_ATTR]
    assert volta_train.patch(model) is model
    assert model.__dict__[_PATCH_ATTR] is record
    assert model.config._attn_implementation == hf.ATTN_IMPLEMENTATION
    volta_train.unpatch(model)
    assert model.config._attn_implementation == "sdpa"  # the original, not volta_train
    assert volta_train.unpatch(model) is model  # unpatching twice is harmless


@pytest.mark.parametrize("previous", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ALL)
def test_unpatch_restores_stock(family, previous):
    model = build(family, attn=previous)
    ids, mask = tokens(), padding_mask("left")
    stock = model(ids, attention_mask=mask).logits
    volta_train.patch(model)
    model(ids, attention_mask=mask)
    assert volta_train.unpatch(model) is model
    assert model.config._attn_implementation == previous
    assert all(m.config._attn_implementation == previous for m in model.modules() if hasattr(m, "config"))
    assert not model._forward_pre_hooks  # the output_attentions hook is gone too
    with spies() as (dense, varlen):
        restored = model(ids, attention_mask=mask).logits
    assert dense.call_count == varlen.call_count == 0
    assert torch.equal(restored, stock)


def test_family_transformers_does_not_declare_flash_capable_is_refused():
    torch.manual_seed(0)
    config = T5Config(vocab_size=VOCAB, d_model=HIDDEN, d_kv=8, d_ff=64, num_layers=1, num_heads=HEADS)
    model = T5ForConditionalGeneration._from_config(config, attn_implementation="eager")
    with pytest.raises(hf.UnsupportedModelError) as info:
        volta_train.patch(model)
    message = str(info.value)
    assert "'t5'" in message and "does not declare T5ForConditionalGeneration flash-attention capable" in message
    assert model.config._attn_implementation == "eager"  # untouched, no half-patched state
    assert _PATCH_ATTR not in model.__dict__


def test_gptj_patches_and_matches_eager():
    """GPT-J runs through transformers' attention interface, so patch() takes it like any other family."""
    torch.manual_seed(0)
    config = GPTJConfig(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=1, n_head=HEADS, rotary_dim=4, n_positions=64)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    ids, mask = tokens(), padding_mask("right")
    patched = run_stock_then_patched(model, ids, mask)
    assert model.config._attn_implementation == hf.ATTN_IMPLEMENTATION
    assert_close(patched.logits, patched.ref_logits, "logits")
    assert_grads_close(patched.grads, patched.ref_grads)


def test_load_time_implementation_on_unsupported_family_refuses_to_run():
    register_or_skip()
    torch.manual_seed(0)
    config = T5Config(vocab_size=VOCAB, d_model=HIDDEN, d_kv=8, d_ff=64, num_layers=1, num_heads=HEADS)
    model = T5ForConditionalGeneration._from_config(config, attn_implementation=hf.ATTN_IMPLEMENTATION)
    with pytest.raises(hf.UnsupportedModelError, match="'t5'.*flash-attention capable"):
        model(tokens(), decoder_input_ids=tokens())


@pytest.mark.parametrize("family", ALL)
def test_attn_implementation_at_load_time(family, tmp_path):
    """from_pretrained(local dir) then patch(), and from_pretrained(..., attn_implementation="volta_train")."""
    register_or_skip()
    build(family).save_pretrained(tmp_path)
    auto = AutoModelForCausalLM if family in CAUSAL else AutoModelForMaskedLM
    stock = auto.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    patched = volta_train.patch(auto.from_pretrained(tmp_path, attn_implementation="sdpa").eval())
    model = auto.from_pretrained(tmp_path, attn_implementation=hf.ATTN_IMPLEMENTATION).eval()
    assert model.config._attn_implementation == hf.ATTN_IMPLEMENTATION
    ids, mask = tokens(), padding_mask("left")
    keep = mask.bool()
    expected = stock(ids, attention_mask=mask).logits[keep]
    for candidate in (patched, model):
        with spies() as (dense, varlen):
            out = candidate(ids, attention_mask=mask).logits
        assert varlen.call_count == LAYERS
        torch.testing.assert_close(out[keep], expected, **TOL)
    with pytest.raises(ValueError, match="from load time"):
        volta_train.unpatch(model)

    stock.set_attn_implementation(hf.ATTN_IMPLEMENTATION)  # the other public switch works too
    with spies() as (dense, varlen):
        stock(ids, attention_mask=mask)
    assert varlen.call_count == LAYERS


@pytest.mark.parametrize("route", ["patch", "load_time"])
@pytest.mark.parametrize("family", ["gpt2", "llama", "bert", "distilbert"])
def test_output_attentions_is_refused(family, route):
    register_or_skip()
    model = build(family, attn=hf.ATTN_IMPLEMENTATION) if route == "load_time" else volta_train.patch(build(family))
    with pytest.raises(ValueError, match="output_attentions=True.*eager"):
        model(tokens(), output_attentions=True)


@pytest.mark.parametrize("family", ALL)
def test_family_on_too_old_transformers_is_refused(family, monkeypatch):
    torch.manual_seed(0)
    auto = AutoModelForCausalLM if family in CAUSAL else AutoModelForMaskedLM
    model = auto.from_config(config_of(family), attn_implementation="eager")  # 4.x has no sdpa for some families
    simulated = supported_here(family)  # recent enough: play an old release (on an old one, this runs for real)
    if simulated:
        monkeypatch.setattr(hf_base, "installed_transformers", lambda: "4.57.6")
    installed, minimum = hf_base.installed_transformers(), hf.FAMILIES[family].min_transformers
    with pytest.raises(hf.TransformersVersionError, match=rf"{re.escape(installed)}.*transformers>={re.escape(minimum)}"):
        volta_train.patch(model)
    assert model.config._attn_implementation == "eager"
    if simulated:
        with pytest.raises(hf.TransformersVersionError):  # the load-time route checks too
            hf.hf_attention_forward(first_attention(model, family), *[torch.randn(1, 1, 2, 8)] * 3, None)


def test_transformers_without_mask_interface_is_refused(monkeypatch):
    try:  # recent enough: remove the interface (on transformers < 4.53, this test runs for real)
        monkeypatch.delattr(importlib.import_module("transformers.masking_utils"), "AttentionMaskInterface")
    except (ImportError, AttributeError):
        pass
    minimum = hf.MIN_TRANSFORMERS
    with pytest.raises(hf.TransformersVersionError, match=rf"AttentionMaskInterface.*4\.53\.0.*>={re.escape(minimum)}"):
        hf.register()


def test_head_dim_the_kernels_pad_matches_sdpa():
    """head_dim 12 is no kernel head_dim: the API takes it (the kernels zero-pad it to 16), so patch() does too."""
    model = build("llama", head_dim=12)
    ids, mask = tokens(), padding_mask("right")
    patched = run_stock_then_patched(model, ids, mask)
    assert_close(patched.logits, patched.ref_logits, "logits")
    assert_grads_close(patched.grads, patched.ref_grads)


# ---------------------------------------------------------------------------------------------------------
# masks the integration must refuse rather than drop
# ---------------------------------------------------------------------------------------------------------


def test_custom_4d_mask_is_refused():
    model = volta_train.patch(build("gpt2"))
    mask = torch.zeros(BATCH, 1, SEQ, SEQ)
    with pytest.raises(ValueError, match="2-D"):
        model(tokens(), attention_mask=mask)


def test_mask_functions_it_cannot_express_are_refused():
    register_or_skip()
    from transformers import masking_utils

    chunked = masking_utils.chunked_causal_mask_function(2, torch.zeros(1, dtype=torch.long))
    with pytest.raises(NotImplementedError, match="chunked attention"):
        hf.padding_mask(batch_size=1, kv_length=4, mask_function=chunked)
    extra = masking_utils.and_masks(masking_utils.causal_mask_function, lambda b, h, q, kv: kv != 0)
    with pytest.raises(NotImplementedError, match="lambda"):
        hf.padding_mask(batch_size=1, kv_length=4, mask_function=extra)
    # what it does accept: plain, sliding window, packed sequences (found in transformers' closures)
    assert hf.padding_mask(batch_size=1, kv_length=4, mask_function=masking_utils.causal_mask_function) is None
    window = masking_utils.sliding_window_causal_mask_function(2)
    windowed = hf.padding_mask(batch_size=1, kv_length=4, mask_function=window)
    assert windowed.inner is None and windowed.window_size == (1, 0)  # the window travels with the mask
    ids = torch.tensor([[0, 0, 1, 1]])
    packed = masking_utils.and_masks(window, masking_utils.packed_sequence_mask_function(ids))
    packing = hf.padding_mask(batch_size=1, kv_length=4, mask_function=packed).inner
    assert packing.cu_seqlens_q.tolist() == [0, 2, 4] and packing.max_seqlen_q == 2


def test_packed_mask_is_built_once_per_forward():
    """Without a cache transformers finds the packing; the mask function turns it into cu_seqlens once."""
    model = volta_train.patch(build("gpt2"))
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
    original = hf_masks.packing_from_starts
    for use_cache in (False, True):
        with mock.patch.object(hf_masks, "packing_from_starts", wraps=original) as in_mask, \
                mock.patch.object(hf_attention, "packing_from_starts", wraps=original) as in_attn:
            model(tokens(batch=1, seqlen=8), position_ids=position_ids, use_cache=use_cache)
        assert in_mask.call_count + in_attn.call_count == 1  # from position_ids in the first layer, remembered for the others


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


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("causal", [True, False])
def test_gqa_and_cached_queries(causal, window):
    generator = torch.Generator().manual_seed(4)
    batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim = 2, 8, 2, 3, 7, 8
    q = torch.randn(batch, heads, seqlen_q, head_dim, generator=generator)
    k = torch.randn(batch, kv_heads, seqlen_k, head_dim, generator=generator)
    v = torch.randn(batch, kv_heads, seqlen_k, head_dim, generator=generator)
    mask = torch.ones(batch, seqlen_k, dtype=torch.bool)
    mask[1, :3] = False  # left padding of row 1
    with spies() as (dense, varlen):
        out, weights = hf.hf_attention_forward(fake_module(is_causal=causal), q, k, v, mask, scaling=0.3,
                                            sliding_window=window)
    assert weights is None
    assert varlen.call_args.args[1].shape[1] == kv_heads  # K/V not repeated
    position = torch.arange(seqlen_k - seqlen_q, seqlen_k)  # the queries are the last tokens
    distance = position[None, :, None] - torch.arange(seqlen_k)[None, None, :]
    allowed = torch.ones(batch, seqlen_q, seqlen_k, dtype=torch.bool)
    if causal:
        allowed &= distance >= 0
    if window is not None:  # transformers' sliding window: q_idx - window < kv_idx (and the mirror when not causal)
        allowed &= distance.abs() < window
    visible = mask[:, None, :] & allowed
    torch.testing.assert_close(out.double(), explicit_attention(q, k, v, visible, 0.3), **TOL)

    dense_out, _ = hf.hf_attention_forward(fake_module(is_causal=causal), q, k, v, None, scaling=0.3,
                                        sliding_window=window)
    torch.testing.assert_close(dense_out.double(), explicit_attention(q, k, v, allowed, 0.3), **TOL)


@pytest.mark.parametrize("name, value", [("head_mask", torch.ones(2)), ("position_bias", torch.zeros(1, 2, 4, 4))])
def test_unsupported_kwargs_are_refused(name, value):
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(NotImplementedError, match=name):
        hf.hf_attention_forward(fake_module(is_causal=True), q, q, q, None, **{name: value})


def test_softcap_kwarg_is_applied():
    """Gemma-2's logit soft-capping reaches the API."""
    q, k, v = (torch.randn(1, 2, 5, 8, dtype=torch.float64) for _ in range(3))
    out, _ = hf.hf_attention_forward(fake_module(is_causal=True), q, k, v, None, scaling=0.3, softcap=2.0)
    s = 2.0 * torch.tanh(torch.einsum("bhid,bhjd->bhij", q, k) * 0.3 / 2.0)
    s = s.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.einsum("bhij,bhjd->bihd", s.softmax(-1), v)
    torch.testing.assert_close(out.double(), want, rtol=1e-7, atol=1e-8)


@pytest.mark.parametrize("window", [0, -1, 2.5, True])
def test_bad_sliding_window_is_refused(window):
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="sliding_window is"):
        hf.hf_attention_forward(fake_module(is_causal=True), q, q, q, None, scaling=0.5, sliding_window=window)


@pytest.mark.parametrize("training, expected", [(True, 0.25), (False, 0.0)])
def test_dropout_kwarg_is_used_in_training_mode_only(training, expected):
    q = torch.randn(1, 2, 4, 8)
    module = fake_module(is_causal=True)
    module.training = training
    with spies() as (dense, _):
        hf.hf_attention_forward(module, q, q, q, None, dropout=0.25, scaling=0.5)
    assert option(dense.call_args, "dropout_p") == expected

"""volta_train.patch on every family of the matrix: tiny random configs built in code, float32, CPU.

Reference: the same model with transformers' own ``attn_implementation="eager"``, in
float32 (eager attention takes its softmax in float32 whatever the dtype, and in
float64 its padding mask, the float64 minimum, turns to -inf there: NaN rows), so
differences are float32 rounding, compared relative to the largest magnitude. Per family: logits and parameter
gradients with no, right and left padding; decoders also packed sequences
(DataCollatorWithFlattening, against each sequence run alone) and greedy
``generate()`` (token-equal). Families are not listed in volta_train: each is
accepted by the generic check (declared flash-attention capable, attention through
transformers' attention interface).
"""

from __future__ import annotations

import logging
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, DataCollatorWithFlattening  # noqa: E402

import volta_train  # noqa: E402
from volta_train.integrations import hf  # noqa: E402
from hf_compare import (  # noqa: E402
    BATCH, SEQ, VOCAB, assert_close, assert_grads_close, padding_mask, run, run_stock_then_patched, spies, tokens,
)

LAYERS, HEADS, HIDDEN = 2, 4, 32
HEAD_DIM = HIDDEN // HEADS
WINDOW = 4  # shorter than SEQ: the window matters

if hf.release(transformers.__version__) < hf.release(hf.MIN_TRANSFORMERS):
    pytest.skip(f"transformers {transformers.__version__} is older than {hf.MIN_TRANSFORMERS}", allow_module_level=True)


def _decoder(**settings) -> dict:
    base = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, max_position_embeddings=64, initializer_range=0.3, bos_token_id=1,
        eos_token_id=1, pad_token_id=0, tie_word_embeddings=False,
    )
    return {**base, **settings}


def _encoder(**settings) -> dict:
    base = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_size=2 * HIDDEN, max_position_embeddings=64, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, initializer_range=0.3,
    )
    return {**base, **settings}


def _config(name: str, **settings):
    return getattr(transformers, name)(**settings)


# model_type -> (config factory, decoder?). Sliding windows, GQA/MQA, scaling and per-layer patterns vary on purpose.
FAMILIES: dict[str, tuple[Callable[[], object], bool]] = {
    "gpt2": (lambda: _config("GPT2Config", vocab_size=VOCAB, n_positions=64, n_embd=HIDDEN, n_layer=LAYERS,
                             n_head=HEADS, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.3,
                             bos_token_id=1, eos_token_id=1, pad_token_id=0), True),
    "gpt_neox": (lambda: _config("GPTNeoXConfig", **_decoder(rotary_pct=0.5, attention_dropout=0.0,
                                                             hidden_dropout=0.0)), True),
    "llama": (lambda: _config("LlamaConfig", **_decoder(num_key_value_heads=2)), True),
    "mistral": (lambda: _config("MistralConfig", **_decoder(num_key_value_heads=1, sliding_window=WINDOW)), True),
    "qwen2": (lambda: _config("Qwen2Config", **_decoder(num_key_value_heads=2, use_sliding_window=True,
                                                        sliding_window=WINDOW, max_window_layers=1)), True),
    "phi": (lambda: _config("PhiConfig", **_decoder(partial_rotary_factor=0.5, resid_pdrop=0.0, embd_pdrop=0.0)),
            True),
    "qwen3": (lambda: _config("Qwen3Config", **_decoder(num_key_value_heads=2, head_dim=HEAD_DIM)), True),
    "gemma": (lambda: _config("GemmaConfig", **_decoder(num_key_value_heads=1, head_dim=HEAD_DIM)), True),
    "gemma2": (lambda: _config("Gemma2Config", **_decoder(
        num_key_value_heads=2, head_dim=HEAD_DIM, sliding_window=WINDOW, query_pre_attn_scalar=20,
        attn_logit_softcapping=None, final_logit_softcapping=None, layer_types=["sliding_attention", "full_attention"],
    )), True),
    "gemma3_text": (lambda: _config("Gemma3TextConfig", **_decoder(
        num_key_value_heads=2, head_dim=HEAD_DIM, sliding_window=WINDOW, query_pre_attn_scalar=12,
        layer_types=["full_attention", "sliding_attention"],
    )), True),
    "phi3": (lambda: _config("Phi3Config", **_decoder(num_key_value_heads=2, resid_pdrop=0.0, embd_pdrop=0.0)), True),
    "mixtral": (lambda: _config("MixtralConfig", **_decoder(num_key_value_heads=2, num_local_experts=2,
                                                            num_experts_per_tok=1, sliding_window=WINDOW)), True),
    "olmo2": (lambda: _config("Olmo2Config", **_decoder(num_key_value_heads=2)), True),
    "opt": (lambda: _config("OPTConfig", vocab_size=VOCAB, hidden_size=HIDDEN, ffn_dim=2 * HIDDEN,
                            num_hidden_layers=LAYERS, num_attention_heads=HEADS, max_position_embeddings=64,
                            word_embed_proj_dim=HIDDEN, dropout=0.0, attention_dropout=0.0, init_std=0.3,
                            bos_token_id=1, eos_token_id=1, pad_token_id=0), True),
    "starcoder2": (lambda: _config("Starcoder2Config", **_decoder(num_key_value_heads=2, sliding_window=WINDOW,
                                                                  residual_dropout=0.0, embedding_dropout=0.0)), True),
    "gpt_bigcode": (lambda: _config("GPTBigCodeConfig", vocab_size=VOCAB, n_positions=64, n_embd=HIDDEN,
                                    n_layer=LAYERS, n_head=HEADS, multi_query=True, resid_pdrop=0.0, embd_pdrop=0.0,
                                    attn_pdrop=0.0, initializer_range=0.3, bos_token_id=1, eos_token_id=1,
                                    pad_token_id=0), True),
    "qwen2_moe": (lambda: _config("Qwen2MoeConfig", **_decoder(
        num_key_value_heads=2, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=HIDDEN,
        shared_expert_intermediate_size=HIDDEN, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
    )), True),
    "qwen3_moe": (lambda: _config("Qwen3MoeConfig", **_decoder(
        num_key_value_heads=2, head_dim=HEAD_DIM, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=HIDDEN,
    )), True),
    "granite": (lambda: _config("GraniteConfig", **_decoder(num_key_value_heads=2, attention_multiplier=0.2)), True),
    "stablelm": (lambda: _config("StableLmConfig", **_decoder(num_key_value_heads=2, partial_rotary_factor=0.5)),
                 True),
    "olmo": (lambda: _config("OlmoConfig", **_decoder(num_key_value_heads=2)), True),
    # own flash-attention classes (GPTNeoFlashAttention2; FalconFlashAttention2 up to transformers 5.24)
    "falcon": (lambda: _config("FalconConfig", vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=HEADS,
                               num_hidden_layers=LAYERS, max_position_embeddings=64, initializer_range=0.3,
                               attention_dropout=0.0, hidden_dropout=0.0, bos_token_id=1, eos_token_id=1,
                               pad_token_id=0), True),
    "falcon-gqa": (lambda: _config("FalconConfig", vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=HEADS,
                                   num_hidden_layers=LAYERS, new_decoder_architecture=True, num_kv_heads=2,
                                   max_position_embeddings=64, initializer_range=0.3, attention_dropout=0.0,
                                   hidden_dropout=0.0, bos_token_id=1, eos_token_id=1, pad_token_id=0), True),
    "gpt_neo": (lambda: _config("GPTNeoConfig", vocab_size=VOCAB, hidden_size=HIDDEN, num_heads=HEADS,
                                num_layers=LAYERS, attention_types=[[["global", "local"], 1]], window_size=WINDOW,
                                max_position_embeddings=64, initializer_range=0.3, embed_dropout=0.0,
                                attention_dropout=0.0, resid_dropout=0.0, bos_token_id=1, eos_token_id=1,
                                pad_token_id=0), True),
    "bert": (lambda: _config("BertConfig", **_encoder()), False),
    "roberta": (lambda: _config("RobertaConfig", **_encoder(pad_token_id=1, max_position_embeddings=72)), False),
    "xlm-roberta": (lambda: _config("XLMRobertaConfig", **_encoder(pad_token_id=1, max_position_embeddings=72)),
                    False),
    "electra": (lambda: _config("ElectraConfig", **_encoder(embedding_size=16)), False),
    "albert": (lambda: _config("AlbertConfig", **_encoder(embedding_size=16)), False),
    "distilbert": (lambda: _config("DistilBertConfig", vocab_size=VOCAB, dim=HIDDEN, n_layers=LAYERS, n_heads=HEADS,
                                   hidden_dim=2 * HIDDEN, max_position_embeddings=64, dropout=0.0,
                                   attention_dropout=0.0, initializer_range=0.3), False),
    "modernbert": (lambda: _config("ModernBertConfig", vocab_size=VOCAB, hidden_size=HIDDEN,
                                   intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                   max_position_embeddings=64, global_attn_every_n_layers=2, local_attention=4,
                                   attention_dropout=0.0, embedding_dropout=0.0, mlp_dropout=0.0,
                                   pad_token_id=0, bos_token_id=1, eos_token_id=1, cls_token_id=1, sep_token_id=1,
                                   initializer_range=0.3), False),
}
DECODERS = [name for name, (_, decoder) in FAMILIES.items() if decoder]
ENCODERS = [name for name, (_, decoder) in FAMILIES.items() if not decoder]


def build(family: str, seed: int = 0, **overrides):
    config = FAMILIES[family][0]()
    for name, value in overrides.items():
        setattr(config, name, value)
    auto = AutoModelForCausalLM if FAMILIES[family][1] else AutoModelForMaskedLM
    torch.manual_seed(seed)
    return auto.from_config(config, attn_implementation="eager").eval()


@pytest.mark.parametrize("padding", ["none", "right", "left"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_and_grads_match_eager(family, padding):
    model = build(family)
    ids, mask = tokens(), padding_mask(padding)
    patched = run_stock_then_patched(model, ids, mask)
    calls = patched.dense.call_count + patched.varlen.call_count
    assert calls == model.config.num_hidden_layers, "every attention layer ran through volta_train"
    assert (patched.varlen.call_count > 0) == (mask is not None)
    assert_close(patched.logits, patched.ref_logits, "logits")
    assert_grads_close(patched.grads, patched.ref_grads, scale="model")


PACKED_LENGTHS = (5, 9, 3, 7)


@pytest.mark.parametrize("flash_kwargs", [False, True])
@pytest.mark.parametrize("family", DECODERS)
def test_packed_sequences_match_each_sequence_alone(family, flash_kwargs):
    """DataCollatorWithFlattening rows (position_ids, or cu_seq_lens kwargs as transformers' flash path passes
    them): the loss and gradients of each sequence run alone with eager attention."""
    model = build(family)
    generator = torch.Generator().manual_seed(5)
    sequences = [torch.randint(2, VOCAB, (n,), generator=generator).tolist() for n in PACKED_LENGTHS]
    if family in ("gpt2", "opt", "gpt_bigcode"):  # learned absolute positions: position_ids must restart per sequence
        pass
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)([{"input_ids": s} for s in sequences])

    def alone():
        total = 0.0
        for sequence in sequences:
            ids = torch.tensor([sequence])
            logits = model(ids, use_cache=False).logits[0, :-1]
            total = total + F.cross_entropy(logits, ids[0, 1:], reduction="sum")
        return total / sum(n - 1 for n in PACKED_LENGTHS)

    def grads_of(compute):
        model.zero_grad(set_to_none=True)
        loss = compute()
        loss.backward()
        grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
        return loss.detach(), grads

    ref_loss, ref_grads = grads_of(alone)
    volta_train.patch(model)
    with spies() as (dense, varlen):
        loss, grads = grads_of(lambda: model(**batch, use_cache=False).loss)
    assert (dense.call_count, varlen.call_count) == (0, model.config.num_hidden_layers)
    expected_cu = [0, *torch.tensor(PACKED_LENGTHS).cumsum(0).tolist()]
    assert all(c.args[3].tolist() == expected_cu for c in varlen.call_args_list)
    assert_close(loss, ref_loss, "loss")
    assert_grads_close(grads, ref_grads, scale="model")


@pytest.mark.parametrize("family", DECODERS)
def test_generate_greedy_token_equal(family):
    model = build(family)
    ids, mask = tokens(), padding_mask("left")
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, attention_mask=mask)
    ref = model.generate(ids, **kwargs)
    volta_train.patch(model)
    with spies() as (dense, varlen):
        out = model.generate(ids, **kwargs)
    assert dense.call_count + varlen.call_count > 0
    assert torch.equal(out, ref)


# ---------------------------------------------------------------------------------------------------------
# what the generic check must honour, or refuse by name
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family, expected", [
    ("mistral", [(WINDOW - 1, 0)] * 2),
    ("qwen2", [None, (WINDOW - 1, 0)]),  # layer_types: layer 0 full, layer 1 sliding
    ("gemma2", [(WINDOW - 1, 0), None]),
    ("gemma3_text", [None, (WINDOW - 1, 0)]),
    ("modernbert", [None, (WINDOW // 2, WINDOW // 2)]),  # bidirectional local attention of local_attention tokens
])
def test_per_layer_sliding_windows(family, expected):
    model = volta_train.patch(build(family))
    with spies() as (dense, _):
        model(tokens())
    assert [c.kwargs.get("window_size") for c in dense.call_args_list] == expected


@pytest.mark.parametrize("family, attribute, expected", [
    ("gemma2", None, 20**-0.5),  # query_pre_attn_scalar
    ("granite", None, 0.2),  # attention_multiplier
    ("opt", None, 1.0),  # OPT scales the queries itself
])
def test_scaling_comes_from_the_model(family, attribute, expected):
    model = volta_train.patch(build(family))
    with spies() as (dense, _):
        model(tokens())
    assert [c.kwargs["softmax_scale"] for c in dense.call_args_list] == pytest.approx([expected] * LAYERS)


def test_gqa_and_mqa_keep_their_kv_heads():
    for family, kv_heads in (("gemma", 1), ("gpt_bigcode", 1), ("qwen3", 2)):
        model = volta_train.patch(build(family))
        with spies() as (dense, _):
            model(tokens())
        assert [c.args[1].shape[2] for c in dense.call_args_list] == [kv_heads] * LAYERS, family


def test_softcap_models_match_eager():
    model = build("gemma2", attn_logit_softcapping=5.0)
    patched = run_stock_then_patched(model, tokens(), padding_mask("left"))
    assert_close(patched.logits, patched.ref_logits, "logits")
    assert_grads_close(patched.grads, patched.ref_grads, scale="model")


@pytest.mark.parametrize("head_dim,logged", [(256, None), (200, "head_dim 200 is zero-padded to 256")])
def test_head_dims_up_to_256_are_kernel_head_dims(caplog, head_dim, logged):
    """head_dim 256 (Gemma's) is one of the kernel's head dims; 200 is padded to it (logged at patch()); neither is
    sent to the reference backend for its head_dim; both equal to eager (here, on CPU, the reference backend runs
    every call)."""
    model = build("gemma", head_dim=head_dim)
    ids, mask = tokens(), padding_mask("right")
    ref_logits, ref_grads = run(model, ids, mask)
    with caplog.at_level(logging.INFO, logger="volta_train"):
        volta_train.patch(model)
    messages = [r.getMessage() for r in caplog.records]
    assert not any(f"head_dim {head_dim} runs on the reference backend" in m for m in messages), messages
    assert logged is None or any(logged in m for m in messages), messages
    logits, grads = run(model, ids, mask)
    assert_close(logits, ref_logits, "logits")
    assert_grads_close(grads, ref_grads, scale="model")


def test_head_dim_beyond_the_api_is_refused():
    model = build("qwen3", head_dim=520)
    with pytest.raises(ValueError, match=r"qwen3: head_dim 520 .*accepted: 1 to 512"):
        volta_train.patch(model)


def test_attention_sinks_match_eager():
    """gpt-oss's sinks (s_aux) run as the API's sinks on the reference backend: logits and every gradient (the sinks'
    included) equal eager's, with padding."""
    config = transformers.GptOssConfig(**_decoder(
        num_key_value_heads=2, head_dim=HEAD_DIM, num_local_experts=2, num_experts_per_tok=1, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
    ))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "sinks"):
                module.sinks.normal_()
    patched = run_stock_then_patched(model, tokens(), padding_mask("right"))
    assert any("sinks" in name for name in patched.grads)
    assert_close(patched.logits, patched.ref_logits, "logits")
    assert_grads_close(patched.grads, patched.ref_grads, scale="model")


# ---------------------------------------------------------------------------------------------------------
# models whose modeling code computes attention itself: their modules get a volta_train class (swaps.py)


@pytest.mark.parametrize("family", ["falcon", "gpt_neo"])
def test_families_that_had_own_flash_classes_patch_and_unpatch(family):
    """Falcon (up to transformers 5.24) and GPT-Neo compute attention in their own flash-attention classes, which
    patch() swaps; Falcon from 5.25 calls the attention interface instead. Whichever the installed release has: every
    layer's attention runs on volta_train and matches eager, the parameters stay the same objects, patch() is
    idempotent and unpatch() restores the classes and eager's logits bit for bit."""
    model = build(family)
    ids, mask = tokens(), padding_mask("right")
    classes = [type(m) for m in model.modules()]
    own = hf.families.own_attention_modules(model)  # empty where the release routes through the interface
    assert len(own) in (0, LAYERS)
    ref_logits, ref_grads = run(model, ids, mask)
    parameters = [id(p) for p in model.parameters()]
    volta_train.patch(model)
    swapped = [type(m).__name__ for m in model.modules() if type(m).__name__.endswith("OnVoltaTrain")]
    assert len(swapped) == len(own)
    assert [id(p) for p in model.parameters()] == parameters  # the same parameters: optimizers keep working
    with spies() as (dense, varlen):
        logits, grads = run(model, ids, mask)
    assert dense.call_count + varlen.call_count == LAYERS
    assert_close(logits, ref_logits, "logits")
    assert_grads_close(grads, ref_grads, scale="model")
    volta_train.patch(model)  # idempotent
    assert [type(m).__name__ for m in model.modules() if type(m).__name__.endswith("OnVoltaTrain")] == swapped
    volta_train.unpatch(model)
    assert [type(m) for m in model.modules()] == classes
    assert not any("_flash_attn_uses_top_left_mask" in vars(m) for m in model.modules())
    assert model.config._attn_implementation == "eager"
    logits, _ = run(model, ids, mask)
    assert torch.equal(logits, ref_logits)


def test_gpt_neo_local_layers_keep_their_window():
    """transformers' GPTNeoFlashAttention2 passes no window; volta_train applies config.window_size like eager."""
    model = build("gpt_neo")
    ids = tokens()
    reference = model(ids).logits
    wide = build("gpt_neo", window_size=SEQ)  # same weights, a window that covers every key
    assert not torch.allclose(wide(ids).logits, reference, atol=1e-3)  # the window changes the result
    volta_train.patch(model)
    with spies() as (dense, _):
        logits = model(ids).logits
    windows = [c.kwargs.get("window_size") for c in dense.call_args_list]
    assert windows == [None, (WINDOW - 1, 0)]
    assert_close(logits, reference, "logits")


def test_falcon_alibi_is_refused_naming_the_feature():
    model = build("falcon", alibi=True)
    with pytest.raises(NotImplementedError, match=r"falcon: ALiBi position bias \(config.alibi=True\)"):
        volta_train.patch(model)
    assert all(not type(m).__name__.endswith("OnVoltaTrain") for m in model.modules())
    assert model.config._attn_implementation == "eager"


def _pegasus_x(seed: int = 0):
    config = transformers.PegasusXConfig(
        vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=LAYERS, decoder_layers=LAYERS, encoder_attention_heads=HEADS,
        decoder_attention_heads=HEADS, encoder_ffn_dim=2 * HIDDEN, decoder_ffn_dim=2 * HIDDEN, block_size=4,
        num_global_tokens=3, stagger_local_blocks=True, max_position_embeddings=64, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )
    torch.manual_seed(seed)
    return transformers.PegasusXForConditionalGeneration._from_config(config, attn_implementation="eager")


@pytest.mark.parametrize("padding", ["none", "right", "left"])
def test_pegasus_x_global_local_encoder_and_causal_decoder_match_eager(padding):
    """The encoder's global-local attention (its own einsums in transformers) on two varlen calls per layer; the
    decoder's self-attention is causal although its module says is_causal=False (eager gets it from the mask)."""
    model = _pegasus_x()
    ids, mask = tokens(), padding_mask(padding)
    decoder_ids = tokens()[:, :7]

    def run_seq2seq():
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids, use_cache=False).logits
        weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(2))
        (logits * weights).sum().backward()
        grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
        return logits.detach(), grads

    ref_logits, ref_grads = run_seq2seq()
    volta_train.patch(model)
    with spies() as (dense, varlen):
        logits, grads = run_seq2seq()
    assert varlen.call_count >= 2 * LAYERS  # the encoder's global and local attention of every layer
    assert [c.kwargs["causal"] for c in dense.call_args_list][:LAYERS:2] == [True] * ((LAYERS + 1) // 2)
    assert_close(logits, ref_logits, "logits")
    assert_grads_close(grads, ref_grads, scale="model")
    volta_train.unpatch(model)
    assert not any(type(m).__name__.endswith("OnVoltaTrain") for m in model.modules())


@pytest.mark.parametrize("family", ["llama", "falcon", "pegasus_x"])
def test_patched_models_pickle_and_load_in_a_fresh_process(family, tmp_path):
    """torch.save of a whole patched model (PEGASUS-X's modules, and Falcon's up to transformers 5.24, have run-time
    classes; PEGASUS-X's decoder a cross-attention found by name); torch.load in a Python process that never called patch() gives the same
    logits (to 1e-6: a process's own CPU reductions may split differently), and unpatch works on what was loaded."""
    import subprocess
    import sys

    model = _pegasus_x() if family == "pegasus_x" else build(family)
    expect_swapped = bool(hf.families.own_attention_modules(model))  # Falcon's own class: up to transformers 5.24
    volta_train.patch(model)
    ids = tokens()
    kwargs = {"decoder_input_ids": ids[:, :5]} if family == "pegasus_x" else {}
    with torch.no_grad():
        want = model(ids, **kwargs).logits
    torch.save({"model": model, "ids": ids, "kwargs": kwargs, "want": want}, tmp_path / "model.pt")
    script = f"""
import torch, volta_train
torch.set_num_threads({torch.get_num_threads()})  # the CPU's reductions split as in this process
saved = torch.load({str(tmp_path / "model.pt")!r}, weights_only=False)
model = saved["model"]
swapped = [type(m).__name__ for m in model.modules() if type(m).__name__.endswith("OnVoltaTrain")]
assert bool(swapped) == {expect_swapped!r}, swapped
with torch.no_grad():
    got = model(saved["ids"], **saved["kwargs"]).logits
assert (got - saved["want"]).abs().max() <= 1e-6, (got - saved["want"]).abs().max()  # unpatched cross-attention: 6e-3
volta_train.unpatch(model)
assert not any(type(m).__name__.endswith("OnVoltaTrain") for m in model.modules())
print("ok", len(swapped))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.startswith("ok"), done.stderr[-2000:]


def test_hybrid_without_attention_layer_is_refused_saying_so():
    """A Bamba config whose layers are all Mamba (attn_layer_indices=None, its default) holds no attention module."""
    config = transformers.BambaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2,
                                      num_attention_heads=HEADS, num_key_value_heads=2, intermediate_size=2 * HIDDEN,
                                      mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(hf.UnsupportedModelError, match=r"'bamba'.*holds no attention module \(BambaAttention.*"
                                                       r"builds no attention layer"):
        volta_train.patch(model)


def test_model_not_declared_flash_capable_is_refused():
    config = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=HIDDEN, n_head=HEADS, n_layer=1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(hf.UnsupportedModelError, match=r"'bloom'.*does not declare BloomForCausalLM flash-attention"):
        volta_train.patch(model)


def test_output_attentions_is_refused_naming_the_feature():
    model = volta_train.patch(build("qwen3"))
    with pytest.raises(ValueError, match="output_attentions=True"):
        model(tokens(), output_attentions=True)


def test_custom_4d_mask_is_refused_naming_model_type():
    model = volta_train.patch(build("llama"))
    with pytest.raises(ValueError, match=r"llama: attention_mask is \(3, 1, 9, 9\).*custom 4-D mask"):
        model(tokens(), attention_mask=torch.ones(BATCH, 1, SEQ, SEQ, dtype=torch.float64))


def test_model_type_membership_is_generic():
    for model_type in ("qwen3", "gemma2", "modernbert", "starcoder2", "opt", "falcon", "gpt_neo", "pegasus_x"):
        assert model_type in hf.FAMILIES
    for model_type in ("bloom", "t5", "no_such_model"):
        assert model_type not in hf.FAMILIES


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["falcon", "gpt_neo"])
def test_swapped_flash_classes_run_the_kernel_on_the_gpu(family, monkeypatch):
    """fp16 on a GPU with VOLTA_TRAIN_BACKEND=kernel (a call the kernel cannot run raises): Falcon's and GPT-Neo's
    swapped flash classes give eager fp32's logits at the real tokens within fp16 rounding, with right padding."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    reference = build(family).cuda()
    model = build(family).cuda().half()
    ids, mask = tokens().cuda(), padding_mask("right").cuda()
    with torch.no_grad():
        expected = reference(ids, attention_mask=mask).logits[mask.bool()]
    volta_train.patch(model)
    monkeypatch.setenv("VOLTA_TRAIN_BACKEND", "kernel")
    with spies() as (dense, varlen), torch.no_grad():
        logits = model(ids, attention_mask=mask).logits[mask.bool()].float()
    assert varlen.call_count == LAYERS
    assert torch.isfinite(logits).all()
    assert_close(logits, expected, family, rtol=2e-2)

"""volta_train.install_flash_attn(): `import flash_attn` resolves to volta_train; transformers' flash_attention_2 runs it.

On CPU transformers refuses flash_attention_2 (it needs CUDA): the CPU tests replace
only that device check, so the rest (package detection by find_spec and distribution
metadata, the version check, the lazy import of flash_attn and its bert_padding, the
unpad/varlen/pad route) is transformers' own code. The gpu tests run it for real, fp16,
on the kernel.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, BertConfig, LlamaConfig  # noqa: E402

import volta_train  # noqa: E402
from volta_train import bert_padding, flash_attn_compat  # noqa: E402
from hf_compare import (  # noqa: E402
    BATCH, LENGTHS, SEQ, VOCAB, assert_close, assert_grads_close, padding_mask, run, tokens,
)


@pytest.fixture
def flash_attn():
    if flash_attn_compat._real_flash_attn() is not None:
        pytest.skip("the real flash-attn is installed here")
    module = volta_train.install_flash_attn()
    yield module
    flash_attn_compat.uninstall_flash_attn()


def test_imports_resolve_to_volta_train(flash_attn):
    import importlib.metadata

    import flash_attn as fa
    from flash_attn.bert_padding import pad_input, unpad_input
    from flash_attn.flash_attn_interface import flash_attn_varlen_func

    assert fa is flash_attn and fa.flash_attn_func is volta_train.interface.flash_attn_func
    assert flash_attn_varlen_func is volta_train.interface.flash_attn_varlen_func
    assert (unpad_input, pad_input) == (bert_padding.unpad_input, bert_padding.pad_input)
    assert fa.__version__ == importlib.metadata.version("flash_attn") == flash_attn_compat.FLASH_ATTN_VERSION
    assert "flash-attn" in importlib.metadata.packages_distributions()["flash_attn"]
    from transformers.utils.import_utils import is_flash_attn_greater_or_equal

    assert is_flash_attn_greater_or_equal("2.3.3")  # transformers' minimum for flash_attention_2
    assert volta_train.install_flash_attn() is fa  # idempotent


def test_refuses_where_real_flash_attn_is_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    with pytest.raises(RuntimeError, match="flash-attn is installed"):
        volta_train.install_flash_attn()


def test_unpad_pad_round_trip_and_varlen():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, SEQ, 2, 8, generator=generator)
    mask = padding_mask("left")
    unpadded, indices, cu, longest, used = bert_padding.unpad_input(x, mask)
    assert cu.tolist() == [0, 9, 15, 18] and longest == SEQ and used.tolist() == list(LENGTHS)
    assert torch.equal(unpadded, x[mask.bool()])
    back = bert_padding.pad_input(unpadded, indices, BATCH, SEQ)
    assert torch.equal(back[mask.bool()], x[mask.bool()]) and back[~mask.bool()].abs().max() == 0
    with pytest.raises(ValueError, match="attention_mask has shape"):
        bert_padding.unpad_input(x, mask[:, :4])


def test_with_kvcache_matches_full_attention():
    generator = torch.Generator().manual_seed(1)
    batch, cache_len, heads, kv_heads, dim = 2, 12, 4, 2, 8
    k_all = torch.randn(batch, 7, kv_heads, dim, generator=generator)
    v_all = torch.randn(batch, 7, kv_heads, dim, generator=generator)
    k_cache = torch.zeros(batch, cache_len, kv_heads, dim)
    v_cache = torch.zeros_like(k_cache)
    k_cache[:, :6], v_cache[:, :6] = k_all[:, :6], v_all[:, :6]
    q = torch.randn(batch, 1, heads, dim, generator=generator)
    out = volta_train.flash_attn_with_kvcache(
        q, k_cache, v_cache, k_all[:, 6:], v_all[:, 6:], cache_seqlens=torch.tensor([6, 6], dtype=torch.int32),
        causal=True,
    )
    assert torch.equal(k_cache[:, 6], k_all[:, 6])  # written in place
    expected = volta_train.flash_attn_func(q, k_all, v_all, causal=True)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    with pytest.raises(TypeError, match="block_table must be int32"):
        volta_train.flash_attn_with_kvcache(q, k_cache, v_cache, block_table=torch.zeros(1))


def _allow_flash_attention_2_on_cpu(monkeypatch):
    """transformers checks for a CUDA device; pretend one is there (only that check)."""
    from transformers import modeling_flash_attention_utils as fa_utils

    matrix = dict(fa_utils.FLASH_ATTENTION_COMPATIBILITY_MATRIX[2])
    matrix["general_availability_check"] = lambda *a, **k: True
    matrix["supported_devices"] = ((lambda: True, "cuda"),)
    matrix["custom_supported_devices"] = ()
    monkeypatch.setitem(fa_utils.FLASH_ATTENTION_COMPATIBILITY_MATRIX, 2, matrix)
    monkeypatch.setattr(fa_utils, "is_flash_attn_2_available", lambda *a, **k: True)
    monkeypatch.setattr(fa_utils, "_loaded_implementation", None)


def _tiny(kind: str, attn: str, device="cpu", dtype=torch.float32):
    torch.manual_seed(0)
    if kind == "llama":
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                             initializer_range=0.3)
        auto = AutoModelForCausalLM
    else:
        config = BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0, initializer_range=0.3)
        auto = AutoModelForMaskedLM
    return auto.from_config(config, attn_implementation=attn, dtype=dtype).to(device)


def _inputs(device="cpu"):
    return tokens().to(device), padding_mask("left").to(device)


def _assert_match(model, reference, ids, mask, rtol):
    logits, grads = run(model, ids, mask)
    ref_logits, ref_grads = run(reference, ids, mask)
    assert_close(logits, ref_logits, "logits", rtol)
    assert_grads_close(grads, ref_grads, rtol, scale="model")


@pytest.mark.parametrize("kind", ["llama", "bert"])
def test_transformers_flash_attention_2_runs_volta_train(kind, flash_attn, monkeypatch):
    _allow_flash_attention_2_on_cpu(monkeypatch)
    model = _tiny(kind, "flash_attention_2")
    assert model.config._attn_implementation == "flash_attention_2"
    ids, mask = _inputs()
    from transformers import modeling_flash_attention_utils as fa_utils

    _assert_match(model, _tiny(kind, "eager"), ids, mask, rtol=1e-5)
    assert fa_utils._flash_varlen_fn is volta_train.interface.flash_attn_varlen_func  # transformers loaded ours


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["llama", "bert"])
def test_flash_attention_2_fp16_kernel_matches_eager(kind, flash_attn):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    reference = _tiny(kind, "eager", device="cuda", dtype=torch.float32)
    # the same weights, then fp16 (initialising in fp16 draws other weights on some transformers releases)
    model = _tiny(kind, "flash_attention_2", device="cuda", dtype=torch.float32)
    model.load_state_dict(reference.state_dict())
    model = model.half()
    ids, mask = _inputs("cuda")
    _assert_match(model, reference, ids, mask, rtol=2e-2)  # fp16 kernel against fp32 eager


def test_older_transformers_distribution_mapping_follows_install(monkeypatch):
    """transformers <= 5.17 keeps PACKAGE_DISTRIBUTION_MAPPING as a dict taken at import: install adds flash_attn to
    it (the GPU check of 5.17 failed with "the package for FlashAttention2 doesn't seem to be installed"), uninstall
    takes it out again."""
    import transformers.utils.import_utils as utils

    monkeypatch.setattr(utils, "PACKAGE_DISTRIBUTION_MAPPING", {"torch": ["torch"]}, raising=False)
    flash_attn_compat.uninstall_flash_attn()
    volta_train.install_flash_attn()
    try:
        assert utils.PACKAGE_DISTRIBUTION_MAPPING["flash_attn"] == ["flash-attn"]
    finally:
        flash_attn_compat.uninstall_flash_attn()
    assert "flash_attn" not in utils.PACKAGE_DISTRIBUTION_MAPPING and utils.PACKAGE_DISTRIBUTION_MAPPING["torch"] == ["torch"]

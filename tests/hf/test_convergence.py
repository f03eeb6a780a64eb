"""Convergence with and without volta_train.patch, in the manner of Liger-Kernel's convergence tests.

A tiny GPT-2 (padded batches), a tiny Llama with GQA (packed batches, as
DataCollatorWithFlattening makes them) and a tiny BERT (masked-LM, padded
batches) train for a few hundred steps from the same seed on the same
synthetic data, once with stock sdpa attention (eager where the release refuses sdpa) and once patched. The loss
curves must agree at every step, and the trained weights and final logits
must match.

* CPU, float32 (``slow``, runs in CI): the patched run uses volta_train's
  reference backend. Tolerance: |loss difference| <= LOSS_ATOL + LOSS_RTOL x
  loss at every step (fp32 rounding differences, amplified by a few hundred
  optimizer steps, stay below 1e-4 here).
* CUDA, fp16 autocast with a GradScaler (``gpu``, skipped without CUDA): the
  patched forward and backward run the Volta kernels (the test asserts both
  backends from the dispatcher's choices). Tolerance: |loss difference| <= GPU_LOSS_ATOL + GPU_LOSS_RTOL x loss
  at every step (Liger-Kernel's half-precision bounds) and GPU_MEAN_ATOL on the
  mean over the last GPU_TAIL steps. The same runs on the CPU in fp16 (reference
  backend both ways, by hand) differ by at most 5e-4.

The data is a seeded first-order Markov chain on one of a few token subsets per
sequence (each token has a few likely successors), so the loss really falls
(from ln(VOCAB) ~ 4.2 to ~ 1.0 for the causal models, ~ 2.7 for masked LM in
300 steps) and the curves are worth comparing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable
from unittest import mock

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    BertConfig,
    DataCollatorWithFlattening,
    GPT2Config,
    LlamaConfig,
)

import volta_train  # noqa: E402
from volta_train import dispatch  # noqa: E402
from volta_train.integrations import hf  # noqa: E402

VOCAB, SEQ, BATCH, HIDDEN, HEADS, LAYERS = 64, 32, 8, 64, 4, 2
STEPS = 300
LR = 1e-3
LOSS_ATOL, LOSS_RTOL = 1e-4, 1e-4  # CPU fp32, every step
WEIGHT_RTOL = 1e-3  # CPU fp32: trained weights, relative to each tensor's largest entry
GPU_STEPS = 300
GPU_LOSS_ATOL, GPU_LOSS_RTOL = 5e-3, 1e-2  # CUDA fp16: every step (Liger-Kernel's half-precision loss bounds)
GPU_MEAN_ATOL, GPU_TAIL = 5e-3, 50  # CUDA fp16: mean |difference| over the last GPU_TAIL steps
PAD, MASK = 0, 1  # special tokens (the chain never produces them)
TOPICS, TOPIC_SIZE = 8, 12


# ---------------------------------------------------------------------------------------------------------
# data: a seeded Markov chain, padded or packed batches
# ---------------------------------------------------------------------------------------------------------


def markov_sequences(count: int, seed: int) -> list[torch.Tensor]:
    """`count` sequences of SEQ/2..SEQ tokens in [2, VOCAB): each picks one of TOPICS token subsets and walks a
    fixed peaked transition matrix restricted to it (learnable from the previous token, or from the context)."""
    generator = torch.Generator().manual_seed(seed)
    states = VOCAB - 2
    transitions = torch.softmax(torch.randn(states, states, generator=generator) * 3.0, dim=-1)
    topics = [torch.randperm(states, generator=generator)[:TOPIC_SIZE] for _ in range(TOPICS)]
    sequences = []
    for _ in range(count):
        topic = topics[int(torch.randint(TOPICS, (1,), generator=generator))]
        within = transitions[topic][:, topic]
        within = within / within.sum(dim=-1, keepdim=True)
        length = int(torch.randint(SEQ // 2, SEQ + 1, (1,), generator=generator))
        state = int(torch.randint(TOPIC_SIZE, (1,), generator=generator))
        walk = [state]
        for _ in range(length - 1):
            state = int(torch.multinomial(within[state], 1, generator=generator))
            walk.append(state)
        sequences.append(topic[torch.tensor(walk)] + 2)
    return sequences


def padded_batch(sequences: list[torch.Tensor], side: str) -> dict[str, torch.Tensor]:
    """input_ids / attention_mask / labels (-100 on padding), padded to SEQ on the right or the left.

    Left padding: the first real token's label is -100 too. Its prediction would come from the last padding
    position, a query that sees no key: flash-attn's semantics make its attention output 0, sdpa/eager attend
    uniformly to the padding instead, so that one loss term differs by definition, not by accuracy."""
    ids = torch.full((len(sequences), SEQ), PAD)
    mask = torch.zeros(len(sequences), SEQ, dtype=torch.long)
    labels = torch.full((len(sequences), SEQ), -100)
    for row, sequence in enumerate(sequences):
        span = slice(0, len(sequence)) if side == "right" else slice(SEQ - len(sequence), SEQ)
        ids[row, span], mask[row, span], labels[row, span] = sequence, 1, sequence
        if side == "left":
            labels[row, span.start] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def masked_lm_batch(sequences: list[torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """BERT-style: 15% of the real tokens replaced by MASK and predicted; padding on the right."""
    batch = padded_batch(sequences, "right")
    generator = torch.Generator().manual_seed(seed)
    chosen = (torch.rand(batch["input_ids"].shape, generator=generator) < 0.15) & batch["attention_mask"].bool()
    labels = batch["input_ids"].masked_fill(~chosen, -100)
    return {
        "input_ids": batch["input_ids"].masked_fill(chosen, MASK),
        "attention_mask": batch["attention_mask"],
        "labels": labels,
    }


def packed_batch(sequences: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """One row of back-to-back sequences with position_ids and flash-attn kwargs (DataCollatorWithFlattening)."""
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    return collator([{"input_ids": sequence.tolist()} for sequence in sequences])


# ---------------------------------------------------------------------------------------------------------
# models and the training loop
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    make_model: Callable[[], torch.nn.Module]
    make_batch: Callable[[list[torch.Tensor], int], dict]  # (sequences, step) -> model inputs
    forward_kwargs: dict


def _gpt2() -> torch.nn.Module:
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=PAD, bos_token_id=2, eos_token_id=2,
    )
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def _llama() -> torch.nn.Module:
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=SEQ, pad_token_id=PAD,
        bos_token_id=2, eos_token_id=2,
    )
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def _bert() -> torch.nn.Module:
    config = BertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_size=2 * HIDDEN, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=PAD,
    )
    return AutoModelForMaskedLM.from_config(config, attn_implementation="sdpa")


def _decoder_config(name: str, **settings):
    import transformers as tf

    return getattr(tf, name)(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=SEQ, pad_token_id=PAD,
        bos_token_id=2, eos_token_id=2, head_dim=HIDDEN // HEADS, **settings,
    )


def _qwen3() -> torch.nn.Module:
    return AutoModelForCausalLM.from_config(_decoder_config("Qwen3Config"), attn_implementation="sdpa")


def _gemma2() -> torch.nn.Module:  # alternating sliding-window / full layers, query_pre_attn_scalar scaling
    import transformers as tf

    config = _decoder_config(
        "Gemma2Config", sliding_window=SEQ // 4, attn_logit_softcapping=None, final_logit_softcapping=None,
        query_pre_attn_scalar=HIDDEN // HEADS,
    )
    # transformers 5.25 refuses sdpa for Gemma2 (its soft-capping); the stock run is eager there
    stock = "sdpa" if tf.Gemma2ForCausalLM._supports_sdpa else "eager"
    return AutoModelForCausalLM.from_config(config, attn_implementation=stock)


def _modernbert() -> torch.nn.Module:  # local (bidirectional window) and global layers
    import transformers as tf

    config = tf.ModernBertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, max_position_embeddings=SEQ, global_attn_every_n_layers=2,
        local_attention=SEQ // 4, attention_dropout=0.0, embedding_dropout=0.0, mlp_dropout=0.0, pad_token_id=PAD,
        bos_token_id=2, eos_token_id=2, cls_token_id=2, sep_token_id=2,
    )
    return AutoModelForMaskedLM.from_config(config, attn_implementation="sdpa")


CASES = {
    "gpt2": Case("gpt2", _gpt2, lambda sequences, step: padded_batch(sequences, "right"), {"use_cache": False}),
    # packed: stock sdpa sees the packing only without a cache, so both runs pass use_cache=False
    "llama": Case("llama", _llama, lambda sequences, step: packed_batch(sequences), {"use_cache": False}),
    "bert": Case("bert", _bert, lambda sequences, step: masked_lm_batch(sequences, seed=1000 + step), {}),
    "qwen3": Case("qwen3", _qwen3, lambda sequences, step: padded_batch(sequences, "left"), {"use_cache": False}),
    "gemma2": Case("gemma2", _gemma2, lambda sequences, step: packed_batch(sequences), {"use_cache": False}),
    "modernbert": Case(
        "modernbert", _modernbert, lambda sequences, step: masked_lm_batch(sequences, seed=2000 + step), {}
    ),
}


def batches(case: Case, steps: int) -> list[dict]:
    sequences = markov_sequences(steps * BATCH, seed=0)
    return [case.make_batch(sequences[i * BATCH : (i + 1) * BATCH], i) for i in range(steps)]


@dataclass
class Run:
    losses: list[float]
    weights: dict[str, torch.Tensor]
    logits: torch.Tensor


def train(case: Case, data: list[dict], patched: bool, device: str = "cpu", fp16: bool = False) -> Run:
    """Same seed, same data, dropout 0; AdamW. fp16: autocast + GradScaler (the GPU variant)."""
    torch.manual_seed(0)
    model = case.make_model().to(device).train()
    if patched:
        volta_train.patch(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.01)
    scaler = torch.amp.GradScaler(device, enabled=fp16)
    losses = []
    for batch in data:
        inputs = {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in batch.items()}
        with torch.autocast(device, dtype=torch.float16, enabled=fp16):
            loss = model(**inputs, **case.forward_kwargs).loss
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        losses.append(loss.item())
    model.eval()
    probe = {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in data[0].items()}
    with torch.no_grad(), torch.autocast(device, dtype=torch.float16, enabled=fp16):
        logits = model(**probe, **case.forward_kwargs).logits.float().cpu()
    weights = {name: p.detach().float().cpu() for name, p in model.named_parameters()}
    return Run(losses, weights, logits)


def _skip_unless_supported(case: Case) -> None:
    minimum = hf.FAMILIES[case.name].min_transformers
    if hf.release(hf.installed_transformers()) < hf.release(minimum):
        pytest.skip(f"transformers {transformers.__version__} is older than {case.name} needs ({minimum})")


def _effective(name: str, weight: torch.Tensor) -> torch.Tensor | None:
    """The part of a trained weight that the loss depends on.

    A key bias adds a per-query constant to the scores, which softmax ignores: its gradient is zero in exact
    arithmetic and rounding noise in practice, and AdamW turns that noise into full-size steps, so the two runs
    move it differently without any effect on the loss (BERT's key.bias; the middle third of GPT-2's c_attn.bias).
    """
    if name.endswith("attention.self.key.bias"):
        return None
    if name.endswith("attn.c_attn.bias"):
        third = weight.shape[0] // 3
        return torch.cat([weight[:third], weight[2 * third :]])
    return weight


def _real_tokens(batch: dict) -> torch.Tensor:
    """Positions that are tokens (the loss reads only these)."""
    mask = batch.get("attention_mask")
    return torch.ones(batch["input_ids"].shape, dtype=torch.bool) if mask is None else mask.bool()


def _assert_learned(run: Run) -> None:
    late = sum(run.losses[-20:]) / 20
    assert late < 0.75 * run.losses[0], f"loss {run.losses[0]:.3f} -> {late:.3f}: too little learning to compare"


def _report(name: str, stock: Run, patched: Run) -> str:
    differences = [abs(a - b) for a, b in zip(stock.losses, patched.losses)]
    worst = max(range(len(differences)), key=differences.__getitem__)
    return (
        f"{name}: loss {stock.losses[0]:.3f} -> {stock.losses[-1]:.3f} (stock) / {patched.losses[-1]:.3f} (patched); "
        f"largest |difference| {differences[worst]:.2e} at step {worst}"
    )


# ---------------------------------------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def one_cpu_thread():
    """These models are tiny: one intra-op thread is faster than two, and steadier next to other jobs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


CPU_CASES = ["gpt2", "llama", "bert"]  # the newer families (qwen3, gemma2, modernbert) run on the GPU only


@pytest.mark.slow
@pytest.mark.parametrize("name", CPU_CASES)
def test_convergence_cpu_fp32(name):
    case = CASES[name]
    _skip_unless_supported(case)
    data = batches(case, STEPS)
    stock, patched = train(case, data, patched=False), train(case, data, patched=True)
    print(_report(name, stock, patched))

    _assert_learned(stock)
    for step, (expected, actual) in enumerate(zip(stock.losses, patched.losses)):
        assert math.isfinite(actual), f"step {step}: patched loss is {actual}"
        assert abs(actual - expected) <= LOSS_ATOL + LOSS_RTOL * abs(expected), (
            f"step {step}: patched loss {actual:.6f} vs stock {expected:.6f}; {_report(name, stock, patched)}"
        )
    for parameter, expected in stock.weights.items():
        expected, actual = _effective(parameter, expected), _effective(parameter, patched.weights[parameter])
        if expected is not None:
            error = (actual - expected).abs().max()
            assert error <= WEIGHT_RTOL * expected.abs().max(), f"{parameter}: max |difference| {error:.3g}"
    keep = _real_tokens(data[0])
    torch.testing.assert_close(patched.logits[keep], stock.logits[keep], rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_convergence_cuda_fp16_kernel(name):
    """The same runs on a CUDA GPU: fp16 autocast + GradScaler; patched forward and backward on the Volta kernels."""
    case = CASES[name]
    _skip_unless_supported(case)
    data = batches(case, GPU_STEPS)
    stock = train(case, data, patched=False, device="cuda", fp16=True)
    with mock.patch.object(dispatch, "_log_choice", wraps=dispatch._log_choice) as choices:
        patched = train(case, data, patched=True, device="cuda", fp16=True)
    print(_report(name, stock, patched))
    for pass_name in ("forward", "backward"):
        ran = {(c.args[0].backend, c.args[0].reason) for c in choices.call_args_list if c.args[1] == pass_name}
        assert {backend for backend, _ in ran} == {"kernel"}, f"{pass_name} backends (backend, reason): {ran}"

    _assert_learned(stock)
    assert all(math.isfinite(loss) for loss in patched.losses)
    differences = [abs(a - b) for a, b in zip(stock.losses, patched.losses)]
    for step, (expected, difference) in enumerate(zip(stock.losses, differences)):
        assert difference <= GPU_LOSS_ATOL + GPU_LOSS_RTOL * abs(expected), (
            f"step {step}: |difference| {difference:.3g}; {_report(name, stock, patched)}"
        )
    tail = sum(differences[-GPU_TAIL:]) / GPU_TAIL
    assert tail <= GPU_MEAN_ATOL, f"mean |difference| over the last {GPU_TAIL} steps {tail:.3g}"


FP16_ACC_TAIL_ATOL = 2e-2  # accum="fp16" vs "fp32": mean |difference| over the last GPU_TAIL steps


@pytest.mark.gpu
@pytest.mark.slow
def test_training_with_fp16_accumulating_forward_follows_fp32():
    """GPT-2, fp16 autocast + GradScaler, GPU_STEPS steps on the kernel: accum="fp16" (FP16-ACC forward, gradients
    from the fp32-accumulating recomputation) against accum="fp32" (the default). Prints both curves' summary."""
    import functools

    from volta_train import interface

    case = CASES["gpt2"]
    data = batches(case, GPU_STEPS)
    runs = {}
    for accum in ("fp32", "fp16"):
        with mock.patch.object(interface, "flash_attn_func", functools.partial(interface.flash_attn_func, accum=accum)), \
                mock.patch.object(interface, "flash_attn_varlen_func",
                                  functools.partial(interface.flash_attn_varlen_func, accum=accum)):
            runs[accum] = train(case, data, patched=True, device="cuda", fp16=True)
    fp32, fp16 = runs["fp32"], runs["fp16"]
    print(_report("gpt2 accum=fp16 vs fp32", fp32, fp16))
    _assert_learned(fp32)
    _assert_learned(fp16)
    differences = [abs(a - b) for a, b in zip(fp32.losses, fp16.losses)]
    tail = sum(differences[-GPU_TAIL:]) / GPU_TAIL
    print(f"accum=fp16 vs fp32: first loss {fp32.losses[0]:.4f}/{fp16.losses[0]:.4f}, last {fp32.losses[-1]:.4f}/"
          f"{fp16.losses[-1]:.4f}, max |difference| {max(differences):.4f}, mean over the last {GPU_TAIL} {tail:.4f}")
    assert tail <= FP16_ACC_TAIL_ATOL, f"mean |difference| over the last {GPU_TAIL} steps {tail:.3g}"

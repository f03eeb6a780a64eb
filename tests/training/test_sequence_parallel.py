"""Sequence parallelism: volta_train's attention inside DeepSpeed-Ulysses (CPU, gloo, reference backend).

Fast tests (in-process): the degree checks and their messages, sequence shards (padding to a multiple
of sp, labels shifted over the whole sequence), the loss over shards, DeepSpeed's gradient factor,
the GPT-2 config alias, Accelerate's ParallelismConfig, and what the core attention does with packed
documents when Ulysses hands it no mask.
Slow tests (subprocesses, 2 gloo processes): tests/support/sp_worker.py compares the loss and every parameter
gradient of a small random GPT-2 (Accelerate, ZeRO-3) and Llama with MQA and packed documents (plain
DeepSpeed, ZeRO-2) under sp=2 with one process's; recipes/gpt_long.py with sequence_parallel_size 2 repeats the
one-process loss trajectory and resumes exactly.
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from volta_train.training import config, gpt, sequence_parallel
from child_process import launch_env, run_retrying_gloo_abort, stderr_tail
from checkout import ROOT

pytestmark = pytest.mark.launches_processes  # its recipe runs and gloo groups share one xdist worker

RECIPE = ROOT / "recipes" / "gpt_long.py"
WORKER = ROOT / "tests" / "support" / "sp_worker.py"
CPU_TINY = ROOT / "configs" / "gpt_long" / "cpu_tiny.yaml"
ACCELERATE = (sys.executable, "-m", "accelerate.commands.launch")


def _run(cmd: list[str], cwd: Path, timeout: int = 240) -> subprocess.CompletedProcess:
    env = launch_env(OMP_WAIT_POLICY="PASSIVE")
    proc = run_retrying_gloo_abort(lambda: subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True,
                                                          text=True, timeout=timeout, env=env))
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))}\n--- stdout\n{proc.stdout[-3000:]}\n" \
                                 f"--- stderr\n{stderr_tail(proc.stderr)}"
    return proc


def _patch_supports(model_type: str) -> bool:
    from volta_train.integrations import hf

    return model_type in hf.FAMILIES


# --------------------------------------------------------------------------------------------------
# the degree
# --------------------------------------------------------------------------------------------------


def test_accepted_degrees():
    assert sequence_parallel.accepted_degrees(16, 16) == [1, 2, 4, 8, 16]
    assert sequence_parallel.accepted_degrees(12, 12, processes=8) == [1, 2, 4]
    assert sequence_parallel.accepted_degrees(8, 2) == [1, 2, 4, 8]  # kv heads replicated when sp > kv heads
    assert sequence_parallel.accepted_degrees(6, 3) == [1, 3, 6]  # 2 divides 6 heads but not 3 kv heads, nor they it
    assert sequence_parallel.padded_length(250, 4) == 252 and sequence_parallel.padded_length(256, 4) == 256


@pytest.mark.parametrize("sp, heads, kv, processes, expected", [
    (3, 16, 16, None, r"sequence_parallel_size is 3, but it does not divide the 16 attention heads \(n_head\)\. "
                      r"Accepted sequence_parallel_size values for these heads: 1, 2, 4, 8, 16$"),
    (2, 6, 3, None, r"the 3 key/value heads \(n_kv_head\) are neither a multiple nor a divisor of it\. "
                    r"Accepted sequence_parallel_size values for these heads: 1, 3, 6$"),
    (4, 16, 16, 6, r"does not divide the number of processes \(6; .*\)\. Accepted sequence_parallel_size values "
                   r"for these heads: 1, 2, 4, 8, 16; with 6 process\(es\): 1, 2$"),
    (0, 16, 16, None, r"sequence_parallel_size must be an integer >= 1 \(1: no sequence parallelism\), got 0"),
])
def test_degree_errors_name_the_option_and_the_accepted_values(sp, heads, kv, processes, expected):
    with pytest.raises(sequence_parallel.SequenceParallelError, match=expected):
        sequence_parallel.check_degree(sp, heads, kv, processes)


def test_degrees_that_work_pass():
    sequence_parallel.check_degree(4, 16, 16, 8)
    sequence_parallel.check_degree(8, 16, 2, 8)
    sequence_parallel.check_degree(1, 5, 5, 3)


def _cfg(**values) -> gpt.GPTTrainConfig:
    return config.from_flat(gpt.GPTTrainConfig, {**config.load_yaml(CPU_TINY, gpt.GPTTrainConfig), **values})


def test_recipe_config_checks():
    with pytest.raises(config.ConfigError, match=r"sequence_parallel_size is 4, but it does not divide the 2 "
                                                 r"attention heads \(n_head\).*values for these heads: 1, 2$"):
        gpt.resolve(_cfg(sequence_parallel_size=4, deepspeed="zero3"), "cpu")
    with pytest.raises(config.ConfigError, match=r"parallel.sequence_parallel_size 2 runs under DeepSpeed-Ulysses, "
                                                 r"and parallel.deepspeed is unset: set parallel.deepspeed"):
        gpt.resolve(_cfg(sequence_parallel_size=2), "cpu")
    with pytest.raises(config.ConfigError, match=r"the 3 key/value heads \(n_kv_head\)"):
        gpt.resolve(_cfg(arch="llama", n_embd=192, n_head=6, n_kv_head=3, sequence_parallel_size=2,
                         deepspeed="zero3"), "cpu")
    cfg = gpt.resolve(_cfg(sequence_parallel_size=2, deepspeed="zero3"), "cpu", num_processes=4)
    with pytest.raises(config.ConfigError, match=r"does not divide the number of processes \(3;"):
        gpt.check_sequence_parallel(cfg, processes=3)
    gpt.check_sequence_parallel(cfg, processes=4)
    # processes of one sequence read the same data: the synthetic corpus is sized for the data-parallel replicas
    one = gpt.resolve(_cfg(deepspeed="zero3", steps=2000), "cpu", num_processes=4)
    two = gpt.resolve(_cfg(deepspeed="zero3", steps=2000, sequence_parallel_size=2), "cpu", num_processes=4)
    assert two.synthetic_mb < one.synthetic_mb


# --------------------------------------------------------------------------------------------------
# shards and the loss over them
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sp, seq_len", [(2, 64), (2, 63), (3, 50), (4, 61)])
@pytest.mark.parametrize("documents", [False, True])
def test_shards_cover_the_padded_sequence(rng, sp, seq_len, documents):
    ids = torch.randint(0, 300, (3, seq_len), generator=rng)
    labels = ids.clone()
    labels[:, 5] = -100
    batch = {"input_ids": ids, "labels": labels}
    if documents:
        cut = int(torch.randint(2, seq_len - 2, (1,), generator=rng))
        batch["position_ids"] = torch.cat([torch.arange(cut), torch.arange(seq_len - cut)]).expand(3, -1)
    shards = [sequence_parallel.shard_batch(batch, sp, r) for r in range(sp)]
    padded = sequence_parallel.padded_length(seq_len, sp)
    chunk = padded // sp
    for shard in shards:
        assert set(shard) == {"input_ids", "position_ids", "shift_labels"}
        assert all(t.shape == (3, chunk) for t in shard.values())
    full = {k: torch.cat([s[k] for s in shards], dim=1) for k in shards[0]}
    assert torch.equal(full["input_ids"][:, :seq_len], ids)
    # labels shifted over the whole sequence: a shard's last token predicts the next shard's first
    assert torch.equal(full["shift_labels"][:, : seq_len - 1], labels[:, 1:])
    assert (full["shift_labels"][:, seq_len - 1 :] == -100).all()  # last real token and the padding
    expected_positions = batch["position_ids"] if documents else torch.arange(seq_len).expand(3, -1)
    assert torch.equal(full["position_ids"][:, :seq_len], expected_positions)
    assert torch.equal(full["position_ids"][:, seq_len:], torch.arange(padded - seq_len).expand(3, -1))


def test_padded_batches_are_refused():
    batch = {"input_ids": torch.zeros(1, 8, dtype=torch.long), "attention_mask": torch.ones(1, 8)}
    with pytest.raises(ValueError, match="attention_mask: padded batches cannot be split"):
        sequence_parallel.shard_batch(batch, 2, 0)


def _tiny_gpt2(seq_len: int = 64, heads: int = 4):
    from transformers import AutoModelForCausalLM, GPT2Config

    config = GPT2Config(vocab_size=80, n_positions=seq_len, n_embd=32, n_layer=2, n_head=heads, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


@pytest.mark.parametrize("sp, seq_len", [(1, 48), (2, 47), (4, 45)])
def test_shard_losses_add_up_to_the_full_sequence_loss(rng, sp, seq_len):
    """Token losses of the shards (logits of the whole sequence, cut like the shards) over the total number of
    targets: transformers' loss of the unsharded batch; with sp = 1, sharded_loss itself is that loss."""
    torch.manual_seed(int(rng.initial_seed()) % 2**31)
    model = _tiny_gpt2()
    ids = torch.randint(0, 80, (2, seq_len), generator=rng)
    labels = ids.clone()
    labels[:, :7] = -100
    batch = {"input_ids": ids, "labels": labels}
    with torch.no_grad():
        expected = model(**batch).loss
        shards = [sequence_parallel.shard_batch(batch, sp, r) for r in range(sp)]
        ids_padded = torch.cat([s["input_ids"] for s in shards], 1)
        pos_padded = torch.cat([s["position_ids"] for s in shards], 1)
        logits = model(input_ids=ids_padded, position_ids=pos_padded).logits
        chunk = ids_padded.shape[1] // sp
        total = count = 0.0
        for r, shard in enumerate(shards):
            part = logits[:, r * chunk : (r + 1) * chunk]
            total += torch.nn.functional.cross_entropy(part.flatten(0, 1), shard["shift_labels"].flatten(),
                                                       ignore_index=-100, reduction="sum")
            count += int((shard["shift_labels"] != -100).sum())
        torch.testing.assert_close(total / count, expected, rtol=1e-5, atol=1e-6)
        if sp == 1:
            torch.testing.assert_close(sequence_parallel.sharded_loss(model, shards[0]), expected, rtol=1e-6,
                                       atol=1e-6)


def test_sharded_loss_gradient_factor_scales_the_gradient_only(rng):
    torch.manual_seed(int(rng.initial_seed()) % 2**31)
    model = _tiny_gpt2()
    batch = sequence_parallel.shard_batch({"input_ids": torch.randint(0, 80, (2, 32), generator=rng)}, 1, 0)
    plain = sequence_parallel.sharded_loss(model, batch)
    plain.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    scaled = sequence_parallel.sharded_loss(model, batch, grad_factor=4.0)
    scaled.backward()
    torch.testing.assert_close(scaled, plain)
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(p.grad, 4.0 * g)


def test_sharded_batches_count_whole_sequences_once():
    batch = {"input_ids": torch.zeros(2, 10, dtype=torch.long), "labels": torch.zeros(2, 10, dtype=torch.long)}
    counts = []
    for rank in range(2):
        lay = sequence_parallel.Layout(sp=2, sp_rank=rank, dp=1, dp_rank=0)
        shards = sequence_parallel.ShardedBatches(iter([batch]), lay, lambda b: (b["input_ids"].numel(), 7.0))
        shard = next(shards)
        assert shard["input_ids"].shape == (2, 5)
        counts.append(shards.counts(shard))
    assert counts == [(20, 7.0), (0, 0.0)]


# --------------------------------------------------------------------------------------------------
# DeepSpeed and Accelerate glue
# --------------------------------------------------------------------------------------------------


def test_gradient_factor():
    zero3 = json.loads((ROOT / "configs/deepspeed/zero3.json").read_text())
    assert sequence_parallel.gradient_factor(zero3, 4) == 4.0  # ZeRO-3's reduce-scatter divides by all processes
    assert sequence_parallel.gradient_factor(zero3, 1) == 1.0
    for stage in ("zero1", "zero2"):
        assert sequence_parallel.gradient_factor(json.loads((ROOT / f"configs/deepspeed/{stage}.json").read_text()), 4) == 1.0
    zero3["zero_optimization"]["reduce_scatter"] = False
    with pytest.raises(sequence_parallel.SequenceParallelError, match="zero_optimization.reduce_scatter is false"):
        sequence_parallel.gradient_factor(zero3, 2)


def test_kv_heads_alias_for_gpt2_only_while_registering():
    from transformers import LlamaConfig

    model = _tiny_gpt2()
    assert not hasattr(model.config, "num_key_value_heads")
    with sequence_parallel.kv_heads_alias(model.config):
        assert model.config.num_key_value_heads == 4
    assert not hasattr(model.config, "num_key_value_heads")
    assert "num_key_value_heads" not in model.config.to_dict()
    llama = LlamaConfig(num_attention_heads=8, num_key_value_heads=2)
    with sequence_parallel.kv_heads_alias(llama):
        assert llama.num_key_value_heads == 2
    assert llama.num_key_value_heads == 2


def test_parallelism_config_names_the_models_attention():
    import volta_train

    model = volta_train.patch(_tiny_gpt2())
    pc = sequence_parallel.parallelism_config(2, 4, model)
    assert (pc.sp_size, pc.sp_backend, pc.data_parallel_size) == (2, "deepspeed", 2)
    assert pc.sp_handler.sp_attn_implementation == "volta_train" and pc.sp_handler.sp_seq_length_is_variable
    with pytest.raises(sequence_parallel.SequenceParallelError, match="does not divide the 4 attention heads"):
        sequence_parallel.parallelism_config(8, 8, model)
    eager = _tiny_gpt2()
    eager.config._attn_implementation = "eager"
    with pytest.raises(sequence_parallel.SequenceParallelError, match="attention implementation is 'eager'"):
        sequence_parallel.parallelism_config(2, 2, eager)


def test_install_needs_deepspeeds_wrapper_first():
    with pytest.raises(RuntimeError, match="not DeepSpeed-Ulysses' wrapper: register it first"):
        sequence_parallel.install("sdpa")
    with pytest.raises(RuntimeError, match="sequence parallelism is not installed"):
        sequence_parallel.ensure_installed("sdpa")


def _per_document_attention(module, q, k, v, mask, position_ids=None, **kwargs):
    """Causal attention within each document of position_ids (the reference for keeps_documents_apart)."""
    n = q.shape[2]
    doc = torch.cumsum((position_ids[0] == 0).long(), 0)
    allowed = torch.tril(torch.ones(n, n, dtype=torch.bool)) & (doc[:, None] == doc[None, :])
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    return out.transpose(1, 2), None


def test_keeps_documents_apart():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import volta_train
    from volta_train.integrations import hf

    model = volta_train.patch(_tiny_gpt2())
    module = model.transformer.h[0].attn
    assert sequence_parallel.keeps_documents_apart(_per_document_attention, module) == (True, "")
    ok, why = sequence_parallel.keeps_documents_apart(ALL_ATTENTION_FUNCTIONS["sdpa"], module)
    assert not ok and "second document's outputs differ" in why  # plain causal attention across documents
    ok, why = sequence_parallel.keeps_documents_apart(ALL_ATTENTION_FUNCTIONS["volta_train"], module)
    # volta_train keeps them apart where its integration finds packed sequences in position_ids
    assert ok == hasattr(hf, "Packing"), why


# --------------------------------------------------------------------------------------------------
# two processes
# --------------------------------------------------------------------------------------------------


def _worker(tmp_path: Path, name: str, *args: str) -> dict:
    out = tmp_path / f"{name}.json"
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "0",
          "--rdzv_backend", "c10d", "--rdzv_endpoint", "127.0.0.1:0", WORKER, "--out", out, *args], tmp_path)
    return json.loads(out.read_text())


def _check_worker(result: dict, layout: list[int]) -> None:
    assert result["attention"] == "volta_train" and result["layout"] == layout
    assert result["grads_compared"] == result["parameters"] > 0
    # the gradient is not trivially small, and the sharded one matches the single process's
    assert result["grad_max_abs"] > 1e-2
    assert result["grad_max_abs_diff"] <= 1e-5 * result["grad_max_abs"] + 1e-7, result
    for ref, got in zip(result["reference"], result["sharded"]):
        assert abs(ref - got) <= 1e-5 * abs(ref), result  # every step, after SGD updates from sharded gradients
    assert len(set(result["reference"])) == len(result["reference"])  # the steps did change the model


@pytest.mark.slow
def test_gpt2_zero3_two_processes_match_one(tmp_path):
    """sp=2 under ZeRO-3, 63 tokens (padded to 64), random data: loss and gradients equal one process's."""
    _check_worker(_worker(tmp_path, "gpt2", "--arch", "gpt2", "--zero", "zero3", "--seq-len", "63",
                          "--seed", str(int.from_bytes(os.urandom(2), "little"))), [2, 1])


@pytest.mark.slow
def test_llama_gqa_documents_zero2_two_processes_match_one(tmp_path):
    """sp=2 under ZeRO-2, Llama with one key/value head (replicated by DeepSpeed), two packed documents per row;
    through sequence_parallel.register + deepspeed.initialize(mpu=...), without Accelerate."""
    if not _patch_supports("llama"):
        pytest.skip("volta_train.patch does not support Llama in this checkout")
    _check_worker(_worker(tmp_path, "llama", "--arch", "llama", "--heads", "4", "--kv-heads", "1", "--zero", "zero2",
                          "--documents", "--seq-len", "50", "--plain-deepspeed",
                          "--seed", str(int.from_bytes(os.urandom(2), "little"))), [2, 1])


def _recipe(tmp_path: Path, out: str, *extra: str, processes: int = 1) -> subprocess.CompletedProcess:
    launcher = (*ACCELERATE, "--num_processes", str(processes), "--num_machines", "1", "--use_deepspeed",
                "--dynamo_backend", "no") if processes > 1 else (sys.executable,)
    return _run([*launcher, RECIPE, "--config", CPU_TINY, "--steps", "6", "--log-interval", "1", "--eval-batches",
                 "1", "--batch-size", "4", "--deepspeed", "zero3", "--out-dir", tmp_path / out, "--cache-dir",
                 tmp_path / "cache", "--no-progress", *extra], tmp_path)


def _trajectory(path: Path) -> list[tuple[int, float, float]]:
    return [(int(r["step"]), float(r["loss"]), float(r["grad_norm"])) for r in csv.DictReader(path.open())]


@pytest.mark.slow
def test_recipe_sp2_repeats_the_one_process_trajectory_and_resumes(tmp_path):
    """gpt_long.py, tiny GPT-2, ZeRO-3: two processes sharing each sequence train exactly like one process."""
    one = _recipe(tmp_path, "one", "--checkpoint-interval", "0")
    two = _recipe(tmp_path, "two", "--sequence-parallel-size", "2", "--checkpoint-interval", "3", processes=2)
    log = two.stderr
    assert "DeepSpeed-Ulysses: 'volta_train' is the core attention of 2 processes per sequence (1/2 heads each)" in log
    assert "sequence parallel: 2 processes per sequence (DeepSpeed-Ulysses), data parallel 1; shard 128 tokens of " \
           "256" in log
    ref, got = _trajectory(tmp_path / "one/train.csv"), _trajectory(tmp_path / "two/train.csv")
    assert [s for s, _, _ in got] == [1, 2, 3, 4, 5, 6] and [s for s, _, _ in ref] == [1, 2, 3, 4, 5, 6]
    for (_, loss_ref, norm_ref), (_, loss, norm) in zip(ref, got):
        assert math.isclose(loss, loss_ref, rel_tol=1e-5), (ref, got)
        assert math.isclose(norm, norm_ref, rel_tol=1e-4), (ref, got)  # DeepSpeed's norm of the full gradient
    assert ref[-1][1] < ref[0][1] - 0.3  # it trained
    s_one = json.loads((tmp_path / "one/summary.json").read_text())
    s_two = json.loads((tmp_path / "two/summary.json").read_text())
    assert math.isclose(s_two["val_loss"], s_one["val_loss"], rel_tol=1e-5)
    assert (s_two["sequence_parallel_size"], s_two["data_parallel_size"], s_two["processes"]) == (2, 1, 2)
    assert s_two["tokens"] == s_one["tokens"] == 6 * 4 * 256  # each token counted once
    assert s_two["packing"] == s_one["packing"]

    # resume from the step-3 checkpoint: steps 4-6 again, exactly
    _recipe(tmp_path, "resumed", "--sequence-parallel-size", "2", "--checkpoint-interval", "0", "--resume",
            str(tmp_path / "two/checkpoints/step-00000003"), processes=2)
    assert _trajectory(tmp_path / "resumed/train.csv") == got[3:]


# --------------------------------------------------------------------------------------------------
# the GPU check's pieces, on CPU
# --------------------------------------------------------------------------------------------------


def _report(out: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("sp_check_report", ROOT / "lab" / "gpu_checks" / "sp_check_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(out)


def _fake_run(out: Path, sp: int, losses: list[float]) -> None:
    d = out / f"loss_sp{sp}"
    d.mkdir(parents=True)
    with (d / "train.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", "loss"])
        writer.writerows([(5 * (i + 1), x) for i, x in enumerate(losses)])
    (d / "summary.json").write_text(json.dumps({
        "steps": 5 * len(losses), "planned_steps": 5 * len(losses), "train_loss": losses[-1], "val_loss": losses[-1],
        "tokens_per_second": 1000.0, "peak_memory_bytes": 2**30, "skipped_steps": 0, "attention": "volta_train",
        "data_parallel_size": 4 // sp}))


def _fake_probe(out: Path, sp: int, max_length: int | None, window_gib: float, full_gib: float) -> None:
    step = {"length": 1024, "shard": 1024 // sp, "attention": "window 256", "peak_allocated_gib": 1.0,
            "peak_reserved_gib": 1.1, "seconds": 0.5, "loss": 5.0}
    (out / f"probe_sp{sp}.json").write_text(json.dumps({
        "sp": sp, "dp": 4 // sp, "processes": 4, "arch": "llama", "model": "medium",
        "shape": {"n_layer": 24, "n_head": 16, "n_embd": 1024}, "parameters": 3e8, "device": "test",
        "steps": [step], "twin": {"length": 1024, "window_gib": window_gib, "full_gib": full_gib},
        "fit": {"intercept_gib": 3.0, "kib_per_token": 100.0, "predicted_length": (max_length or 10**6) + 1},
        "verified": {**step, "length": max_length or 10**6, "ok": max_length is not None},
        "max_length": max_length}))


@pytest.mark.parametrize("case, passes", [
    ("good", True), ("diverged", False), ("short_memory", False), ("twin_differs", False), ("oom", False),
])
def test_gpu_check_report_decides(tmp_path, capsys, case, passes):
    """lab/gpu_checks/sp_check_report.py on fabricated results: PASS only when every criterion holds."""
    settings = {"nproc": 4, "sp_list": "1 2 4", "steps": 200, "model": "mini", "seq_len": 2048, "global_batch": 4,
                "tol_mean": 0.03, "tol_max": 0.15, "mem_gb": 32, "probe_sp": 4, "probe_arch": "llama",
                "probe_model": "medium", "ratio_min": 3.5, "tol_twin": 0.05, "window": 256}
    (tmp_path / "settings.json").write_text(json.dumps(settings))
    (tmp_path / "skipped.txt").write_text("")
    base = [5.5 - 0.1 * i for i in range(40)]
    _fake_run(tmp_path, 1, base)
    _fake_run(tmp_path, 2, [x + 0.004 for x in base])
    _fake_run(tmp_path, 4, [x + (0.2 if case == "diverged" and i > 20 else -0.003) for i, x in enumerate(base)])
    _fake_probe(tmp_path, 1, 200 * 1024, 20.0, 20.2)
    sp4 = {"short_memory": 600 * 1024, "oom": None}.get(case, 760 * 1024)
    _fake_probe(tmp_path, 4, sp4, 20.0, 25.0 if case == "twin_differs" else 20.3)
    assert (_report(tmp_path) == 0) is passes
    text = capsys.readouterr().out
    assert text.strip().endswith("RESULT: PASS" if passes else "RESULT: FAIL")
    if case == "good":
        assert "PASS: memory: longest sequence sp=4 / sp=1 = 778,240 / 204,800 = 3.80 (>= 3.5)" in text
        assert "PASS: loss sp=4 vs sp=1 over 40 logged steps: mean |diff| 0.0030" in text


@pytest.mark.slow
def test_memory_probe_cpu_smoke(tmp_path):
    """lab/gpu_checks/sp_memory_probe.py's code path (window and full attention steps, verification) on 2 gloo processes."""
    out = tmp_path / "probe.json"
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "0",
          "--rdzv_backend", "c10d", "--rdzv_endpoint", "127.0.0.1:0", ROOT / "lab" / "gpu_checks" / "sp_memory_probe.py",
          "--cpu", "--sp", "2", "--window", "8", "--shard-lengths", "32,64", "--twin-shard-length", "48",
          "--out", out], tmp_path)
    result = json.loads(out.read_text())
    assert (result["sp"], result["dp"], result["device"]) == (2, 1, "cpu")
    assert [(r["length"], r["attention"]) for r in result["steps"]] == [
        (64, "window 8"), (64, "window 8"), (64, "window 8"), (128, "window 8"), (96, "window 8"), (96, "full"),
        (256, "window 8")]
    assert result["verified"]["ok"] and result["max_length"] == 256
    assert all(math.isfinite(r["loss"]) for r in result["steps"])

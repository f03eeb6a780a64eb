"""One core for both recipes: the memory, parallel and precision sections read the same in gpt_long and finetune
(YAML and flags, older names included), combinations that cannot work are refused before any file is written, and
finetune with sequence parallelism 2 on two gloo processes repeats one process's losses (slow)."""

from __future__ import annotations

import csv
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from volta_train.training import config, gpt, memory, parallel, precision
from volta_train.training.finetune_config import FinetuneConfig
from child_process import launch_env, run_retrying_gloo_abort, stderr_tail
from checkout import ROOT

FINETUNE = ROOT / "recipes" / "finetune.py"
GPT_LONG = ROOT / "recipes" / "gpt_long.py"
LLAMA_PACKED = ROOT / "configs" / "finetune" / "llama_text_packed.yaml"
CPU_TINY = ROOT / "configs" / "gpt_long" / "cpu_tiny.yaml"
SECTIONS = {"memory": memory.MemoryConfig, "parallel": parallel.ParallelConfig, "precision": precision.PrecisionConfig}


def _random_sections(rnd: random.Random) -> dict:
    """A value for every option of the shared sections, drawn at random (choices from their accepted values)."""
    out = {}
    for name, cls in SECTIONS.items():
        values = {}
        for key, (f, tp, _) in config.leaf_fields(cls).items():
            choices = f.metadata.get("choices")
            if choices:
                values[key] = rnd.choice(choices)
            elif tp is bool:
                values[key] = rnd.random() < 0.5
            elif tp is int:
                values[key] = rnd.randint(1, 9)
            elif tp is float:
                values[key] = rnd.uniform(1.0, 1e5)
            elif tp is str:
                values[key] = rnd.choice(["zero2", "zero3"])
        out[name] = values
    return out


def test_both_recipes_read_the_same_sections_from_yaml_and_flags(tmp_path):
    rnd = random.Random(int.from_bytes(os.urandom(4), "little"))
    sections = _random_sections(rnd)
    import yaml

    path = tmp_path / "sections.yaml"
    path.write_text(yaml.safe_dump(sections))
    gpt_cfg = config.from_flat(gpt.GPTTrainConfig, config.load_yaml(path, gpt.GPTTrainConfig))
    ft_cfg = config.from_flat(FinetuneConfig, config.load_yaml(path, FinetuneConfig))
    for name in SECTIONS:
        assert getattr(gpt_cfg, name) == getattr(ft_cfg, name) == SECTIONS[name](**sections[name])
    # the same as flags, each a --section.key in both parsers, with the same help
    flags = []
    for name, values in sections.items():
        for key, value in values.items():
            flag = f"--{name}.{key.replace('_', '-')}"
            if isinstance(value, bool):
                flags.append(flag if value else f"--{name}.no-{key.replace('_', '-')}")
            else:
                flags += [flag, str(value)]
    from_gpt = config.parse_config(gpt.GPTTrainConfig, flags)
    from_ft = config.parse_config(FinetuneConfig, flags)
    for name in SECTIONS:
        assert getattr(from_gpt, name) == getattr(from_ft, name) == getattr(gpt_cfg, name)
    gpt_help = config.build_parser(gpt.GPTTrainConfig, "").format_help()
    ft_help = config.build_parser(FinetuneConfig, "").format_help()
    for name, cls in SECTIONS.items():
        for key, (f, _, _) in config.leaf_fields(cls).items():
            assert f"--{name}.{key.replace('_', '-')}" in gpt_help and f"--{name}.{key.replace('_', '-')}" in ft_help
        gpt_part = gpt_help[gpt_help.index(f"{name} (YAML section"):].split("\n\n")[0]
        ft_part = ft_help[ft_help.index(f"{name} (YAML section"):].split("\n\n")[0]
        assert gpt_part == ft_part  # help written once


@pytest.mark.parametrize("cls, old, new, value", [
    (gpt.GPTTrainConfig, "gradient_checkpointing", "memory.gradient_checkpointing", True),
    (gpt.GPTTrainConfig, "deepspeed", "parallel.deepspeed", "zero2"),
    (gpt.GPTTrainConfig, "sequence_parallel_size", "parallel.sequence_parallel_size", 2),
    (gpt.GPTTrainConfig, "mixed_precision", "precision.mixed_precision", "bf16"),
    (FinetuneConfig, "model.tiled_mlp", "memory.tiled_mlp", "on"),
    (FinetuneConfig, "train.chunked_loss", "memory.chunked_loss", False),
    (FinetuneConfig, "train.deepspeed", "parallel.deepspeed", "zero3"),
    (FinetuneConfig, "train.loss_scale_window", "precision.loss_scale_window", 7),
])
def test_older_names_still_read_and_not_twice(tmp_path, cls, old, new, value):
    import yaml

    def nested(dotted: str, v) -> dict:
        head, _, rest = dotted.partition(".")
        return {head: nested(rest, v)} if rest else {head: v}

    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(nested(old, value)))
    assert config.load_yaml(path, cls) == {new: value}
    flag = "--" + old.replace("_", "-")
    argv = ([flag] if value is True else [flag.replace(".", ".no-") if "." in flag else "--no-" + flag[2:]]) \
        if isinstance(value, bool) else [flag, str(value)]
    cfg = config.parse_config(cls, argv)
    section, key = new.split(".")
    assert getattr(getattr(cfg, section), key) == value
    path.write_text(yaml.safe_dump({**nested(old, value), **nested(new, value)}))  # sections differ
    with pytest.raises(config.ConfigError, match=rf"{old} and {new} are the same option \({new}\)|"
                                                 rf"{new} and {old} are the same option \({new}\)"):
        config.load_yaml(path, cls)


@pytest.mark.parametrize("recipe, argv, message", [
    (GPT_LONG, ["--task", "causal_lm"], "--task is an option of the finetune recipe; gpt_long has no such option"),
    (FINETUNE, ["--config", str(LLAMA_PACKED), "--arch", "llama"],
     "--arch is an option of the gpt_long recipe; finetune has no such option"),
])
def test_an_option_of_the_other_recipe_is_refused_naming_it(tmp_path, recipe, argv, message):
    proc = subprocess.run([sys.executable, str(recipe), *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]


def test_a_yaml_key_of_the_other_recipe_is_refused_naming_it(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("optimizer:\n  lr: 0.1\n")
    with pytest.raises(config.ConfigError, match="optimizer is an option of the finetune recipe; gpt_long has no "
                                                 "such option"):
        config.load_yaml(bad, gpt.GPTTrainConfig, other=FinetuneConfig)
    bad.write_text("task: causal_lm\n")
    with pytest.raises(config.ConfigError, match="task is an option of the finetune recipe; gpt_long has no "
                                                 "such option"):
        config.load_yaml(bad, gpt.GPTTrainConfig, other=FinetuneConfig)
    bad.write_text("n_layer: 3\n")
    with pytest.raises(config.ConfigError, match="n_layer is an option of the gpt_long recipe; finetune has no "
                                                 "such option"):
        config.load_yaml(bad, FinetuneConfig, other=gpt.GPTTrainConfig)


# ---- combinations that cannot work: refused at start, naming both options, before any file is written


def _refused(recipe: Path, out: Path, argv: list[str]) -> str:
    base = ["--config", str(CPU_TINY), "--out-dir", str(out), "--cpu"] if recipe == GPT_LONG else \
        ["--config", str(LLAMA_PACKED), "--logging.out-dir", str(out), "--train.cpu"]
    proc = subprocess.run([sys.executable, str(recipe), *base, *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=240, env=launch_env(OMP_WAIT_POLICY="PASSIVE"))
    assert proc.returncode != 0, proc.stderr[-2000:]
    assert not out.exists(), sorted(p.name for p in out.iterdir())  # nothing written
    return proc.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("recipe", [GPT_LONG, FINETUNE], ids=["gpt_long", "finetune"])
def test_offload_without_checkpointing_is_refused(tmp_path, recipe):
    line = _refused(recipe, tmp_path / "out", ["--memory.activation-offload", "--memory.no-gradient-checkpointing"])
    assert "memory.activation_offload" in line and "memory.gradient_checkpointing is off" in line
    assert "set memory.gradient_checkpointing: true, or memory.activation_offload: false" in line


@pytest.mark.parametrize("recipe", [GPT_LONG, FINETUNE], ids=["gpt_long", "finetune"])
def test_zero_offload_without_deepspeed_is_refused(tmp_path, recipe):
    line = _refused(recipe, tmp_path / "out", ["--parallel.zero-offload", "optimizer"])
    assert "parallel.zero_offload optimizer is a DeepSpeed ZeRO feature, and parallel.deepspeed is unset" in line
    assert "set parallel.deepspeed (zero2, or zero3 for zero_offload all)" in line


@pytest.mark.parametrize("recipe", [GPT_LONG, FINETUNE], ids=["gpt_long", "finetune"])
def test_sequence_parallel_without_deepspeed_is_refused(tmp_path, recipe):
    line = _refused(recipe, tmp_path / "out", ["--parallel.sequence-parallel-size", "2"])
    assert "parallel.sequence_parallel_size 2 runs under DeepSpeed-Ulysses, and parallel.deepspeed is unset" in line


def test_finetune_sequence_parallel_needs_packed_rows(tmp_path):
    line = _refused(FINETUNE, tmp_path / "out", ["--parallel.sequence-parallel-size", "2", "--parallel.deepspeed",
                                                 "zero3", "--data.no-packing"])
    assert "parallel.sequence_parallel_size 2 splits each row over 2 processes" in line
    assert "data.packing is false: set data.packing: true (task causal_lm), or parallel.sequence_parallel_size: 1" \
        in line


def test_a_degree_that_does_not_divide_the_heads_is_refused_naming_the_accepted_ones():
    with pytest.raises(config.ConfigError, match=r"parallel.sequence_parallel_size is 4, but it does not divide the 2 "
                                                 r"attention heads \(n_head\).*values for these heads: 1, 2"):
        gpt.resolve(config.from_flat(gpt.GPTTrainConfig, {**config.load_yaml(CPU_TINY, gpt.GPTTrainConfig),
                                                          "parallel.sequence_parallel_size": 4,
                                                          "parallel.deepspeed": "zero3"}), "cpu", 4)
    # a model known only once built (finetune, gpt_long's model_path): its config's heads
    p = parallel.ParallelConfig(deepspeed="zero3", sequence_parallel_size=8)
    with pytest.raises(config.ConfigError, match=r"parallel.sequence_parallel_size is 8, but it does not divide the 4 "
                                                 r"attention heads \(num_attention_heads\).*heads: 1, 2, 4; with 8 "
                                                 r"process\(es\): 1, 2, 4$"):
        parallel.check_heads(p, 4, 2, 8)
    parallel.check_heads(parallel.ParallelConfig(deepspeed="zero3", sequence_parallel_size=2), 4, 2, 2)


# ---- finetune with sequence parallelism: two processes sharing each packed row train like one


def _finetune(tmp_path: Path, out: str, *extra: str, processes: int = 1) -> subprocess.CompletedProcess:
    launcher = (sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(processes),
                "--num_machines", "1", "--use_deepspeed", "--dynamo_backend", "no") if processes > 1 else \
        (sys.executable,)
    cmd = [*launcher, str(FINETUNE), "--config", str(LLAMA_PACKED), "--train.cpu", "--train.steps", "5",
           "--train.batch-size", "2", "--data.max-length", "256", "--logging.log-interval", "1",
           "--logging.out-dir", str(tmp_path / out), "--data.cache-dir", str(tmp_path / "cache"),
           "--logging.no-progress", "--checkpoint.interval", "0", "--parallel.deepspeed", "zero3",
           "--precision.mixed-precision", "no", *extra]
    proc = run_retrying_gloo_abort(lambda: subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400,
                                                          env=launch_env(OMP_WAIT_POLICY="PASSIVE")))
    assert proc.returncode == 0, f"{' '.join(cmd)}\n--- stderr\n{stderr_tail(proc.stderr)}"
    return proc


def _losses(path: Path) -> list[tuple[int, float, float]]:
    return [(int(r["step"]), float(r["loss"]), float(r["grad_norm"])) for r in csv.DictReader(path.open())]


@pytest.mark.launches_processes
@pytest.mark.slow
def test_finetune_sp2_repeats_the_one_process_losses(tmp_path):
    one = _finetune(tmp_path, "one")
    two = _finetune(tmp_path, "two", "--parallel.sequence-parallel-size", "2", processes=2)
    assert "DeepSpeed-Ulysses: 'volta_train' is the core attention of 2 processes per sequence (2/4 heads each)" \
        in two.stderr
    assert "shard 128 tokens of 256" in two.stderr and "shard" not in one.stderr
    ref, got = _losses(tmp_path / "one/train.csv"), _losses(tmp_path / "two/train.csv")
    assert [s for s, _, _ in got] == [s for s, _, _ in ref] == [1, 2, 3, 4, 5]
    for (_, loss_ref, norm_ref), (_, loss, norm) in zip(ref, got):
        assert math.isclose(loss, loss_ref, rel_tol=1e-5), (ref, got)
        assert math.isclose(norm, norm_ref, rel_tol=1e-4), (ref, got)
    assert ref[-1][1] < ref[0][1]  # it trained
    s_one = json.loads((tmp_path / "one/summary.json").read_text())
    s_two = json.loads((tmp_path / "two/summary.json").read_text())
    assert math.isclose(s_two["eval_loss"], s_one["eval_loss"], rel_tol=1e-5)
    assert (s_two["sequence_parallel_size"], s_two["data_parallel_size"], s_two["processes"]) == (2, 1, 2)
    assert s_two["tokens"] == s_one["tokens"]  # each token counted once


@pytest.mark.parametrize("stage, offload", [(2, "optimizer"), (3, "optimizer"), (3, "all")])
def test_zero_offload_goes_into_the_deepspeed_config(stage, offload):
    from volta_train.training import distributed

    json_config = json.loads((ROOT / f"configs/deepspeed/zero{stage}.json").read_text())
    assert "offload_optimizer" not in json_config["zero_optimization"]
    distributed._complete(json_config, 2, 1, 1.0, offload)
    zero = json_config["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == "cpu"
    assert ("offload_param" in zero) == (offload == "all")
    if stage == 3:  # the partitioned build sees the weights' offload as well
        built = distributed.zero3_init_config(mixed_precision="no", grad_accum=1, batch_size=2, grad_clip=1.0,
                                              deepspeed_spec="zero3", zero_offload=offload)
        assert ("offload_param" in built["zero_optimization"]) == (offload == "all")


def test_zero_offload_all_needs_stage_3():
    from volta_train.training import distributed

    with pytest.raises(config.ConfigError, match=r"parallel.zero_offload all needs ZeRO stage 3, and the DeepSpeed "
                                                 r"config \(parallel.deepspeed\) has stage 2: use parallel.deepspeed "
                                                 r"zero3, or parallel.zero_offload optimizer"):
        distributed._complete(json.loads((ROOT / "configs/deepspeed/zero2.json").read_text()), 2, 1, 1.0, "all")


@pytest.mark.parametrize("installed, backend, processes, refused", [
    ("0.18.2", "gloo", 2, True), ("0.19.7", "gloo", 4, True), ("0.19.8", "gloo", 2, False),
    ("0.18.2", "nccl", 2, False), ("0.18.2", "gloo", 1, False),
])
def test_zero3_over_gloo_needs_a_deepspeed_that_waits_for_every_gather(monkeypatch, installed, backend, processes,
                                                                        refused):
    """DeepSpeed before versions.ZERO3_ON_GLOO gathers ZeRO-3 parameters over gloo without waiting for every transfer
    (CPU runs then started from garbage weights): ZeRO-3 over several gloo processes is refused
    there, naming what would be accepted; NCCL, one process, ZeRO-2 and newer releases are not."""
    import torch.distributed as dist

    from volta_train import versions
    from volta_train.training import distributed

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: processes)
    monkeypatch.setattr(dist, "get_backend", lambda *a, **k: backend)
    monkeypatch.setattr(versions, "installed", lambda package: installed if package == "deepspeed" else None)

    def build(spec):
        return distributed.zero3_init_config(mixed_precision="no", grad_accum=1, batch_size=2, grad_clip=1.0,
                                             deepspeed_spec=spec)

    assert build("zero2") is None  # not ZeRO-3: nothing to refuse
    if not refused:
        assert build("zero3")["zero_optimization"]["stage"] == 3
        return
    with pytest.raises(config.ConfigError) as info:
        build("zero3_offload")
    message = str(info.value)
    assert f"ZeRO-3 over {processes} CPU (gloo) processes needs DeepSpeed 0.19.8 or newer; DeepSpeed {installed}" \
        in message
    assert "pip install -U 'deepspeed>=0.19.8', ZeRO-2 (parallel.deepspeed zero2), or CUDA GPUs" in message

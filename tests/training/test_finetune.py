"""recipes/finetune.py: YAML validation and overrides, data formats and batching, and every shipped config run.

The shipped configs run for a few steps as subprocesses (``@pytest.mark.slow``), each through a
different launcher: ``python``, accelerate's ``single_gpu.yaml`` (one CPU process here) and
``ddp.yaml`` (two gloo processes, with and without ``ACCELERATE_USE_CPU=1``).
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from volta_train.training import checkpoint, config, data
from volta_train.training import example_batches, examples, models
from volta_train.training import finetune_config as ft
from volta_train.recipes import finetune as finetune_recipe
from checkout import ROOT
from child_process import launch_env

RECIPE = ROOT / "recipes" / "finetune.py"
CONFIGS = sorted((ROOT / "configs" / "finetune").glob("*.yaml"))
ACCELERATE = (sys.executable, "-m", "accelerate.commands.launch")


def _patch_supports(model_type: str) -> bool:
    try:
        from volta_train.integrations import hf
    except ImportError:
        return False
    return model_type in hf.FAMILIES


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def _parse(*argv: str) -> ft.FinetuneConfig:
    return ft.check(config.parse_config(ft.FinetuneConfig, list(argv)))


BASE = """
task: causal_lm
model: {config: configs/finetune/models/tiny_gpt2}
data: {train: data/samples/instructions_train.jsonl, format: instruction}
"""


# ------------------------------------------------------------------------------------------------
# YAML validation and command-line overrides
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_shipped_configs_are_valid(path, monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = ft.check(config.from_flat(ft.FinetuneConfig, config.load_yaml(path, ft.FinetuneConfig)))
    assert cfg.model.patch and cfg.model.config and cfg.logging.out_dir.startswith("out/finetune/")
    tokenizer = data.load_tokenizer(models.tokenizer_spec(cfg.model.tokenizer, cfg.model.path, cfg.model.config))
    assert models.read_model_config(cfg.model.config).vocab_size >= tokenizer.vocab_size


@pytest.mark.parametrize(
    "text, message",
    [
        ("optimizer: {lrr: 0.1}\n", "unknown key 'optimizer.lrr' (did you mean 'optimizer.lr'?)"),
        ("optimiser: {lr: 0.1}\n", "unknown key 'optimiser' (did you mean 'optimizer'?)"),
        ("train: {batch_size: big}\n", "train.batch_size must be int, got 'big'"),
        ("schedule: {name: exponential}\n", "schedule.name is 'exponential'; accepted: cosine, linear, constant"),
        ("train: {mixed_precision: no}\n", "quote it"),
        ("data: data/samples/x.jsonl\n", "data is a section: expected a mapping"),
        ("data: {labels: [[a]]}\n", "data.labels[0] must be str, got ['a']"),
        ("model: {config_overrides: [1, 2]}\n", "model.config_overrides must be dict"),
        ("task: regression\n", "task is 'regression'; accepted: causal_lm, classification"),
        ("optimizer.lr: many\n", "optimizer.lr must be float, got 'many'"),
    ],
)
def test_bad_yaml_names_the_key(tmp_path, text, message):
    with pytest.raises(config.ConfigError, match=re.escape(message)):
        config.load_yaml(_write(tmp_path, text), ft.FinetuneConfig)


BASE_DICT = {"task": "causal_lm", "model": {"config": "configs/finetune/models/tiny_gpt2"},
             "data": {"train": "data/samples/instructions_train.jsonl", "format": "instruction"}}


def _merged(extra: dict) -> dict:
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in BASE_DICT.items()}
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key].update(value)
        else:
            out[key] = value
    return out


@pytest.mark.parametrize(
    "extra, message",
    [
        ({}, None),
        ({"task": "classification"}, "data.format 'instruction' does not fit task 'classification'"),
        ({"model": {"config": None}}, "model: set model.path (a pretrained directory) or model.config"),
        ({"model": {"path": "nowhere"}}, "model.path: 'nowhere' does not exist"),
        ({"model": {"tokenizer": "nowhere"}}, "model.tokenizer: 'nowhere' is neither 'bytes' nor a directory"),
        ({"data": {"train": "nowhere/*.jsonl"}}, "data.train: 'nowhere/*.jsonl' matches no .jsonl file"),
        ({"data": {"eval": "missing.jsonl"}}, "data.eval: 'missing.jsonl' matches no .jsonl file"),
        ({"task": "classification", "data": {"format": "classification", "packing": True}},
         "data.packing applies to task causal_lm only"),
        ({"train": {"batch_size": 0}}, "train.batch_size must be positive, got 0"),
        ({"data": {"prompt_template": "no placeholder"}}, "data.prompt_template must contain {instruction}"),
        ({"schedule": {"warmup_ratio": 1.5}}, "schedule.warmup_ratio must lie in [0, 1), got 1.5"),
        ({"optimizer": {"lr": 0}}, "optimizer.lr must be a finite number > 0, got 0.0"),
        ({"model": {"gradient_checkpointing": True, "activation_offload": True, "activation_offload_keep": -1}},
         "memory.activation_offload_keep must be >= 0"),
    ],
)
def test_cross_key_checks(tmp_path, monkeypatch, extra, message):
    import yaml

    monkeypatch.chdir(ROOT)
    path = _write(tmp_path, yaml.safe_dump(_merged(extra)))
    cfg = config.from_flat(ft.FinetuneConfig, config.load_yaml(path, ft.FinetuneConfig))
    if message is None:
        assert ft.check(cfg).data.format == "instruction"
        return
    with pytest.raises(config.ConfigError, match=re.escape(message)):
        ft.check(cfg)


def test_duplicate_yaml_keys_are_refused(tmp_path):
    path = _write(tmp_path, BASE + "data: {train: data/samples/stories.jsonl}\n")
    with pytest.raises(config.ConfigError, match=re.escape("duplicate key 'data' (first at line 4)")):
        config.load_yaml(path, ft.FinetuneConfig)


def test_every_yaml_key_has_a_flag_that_overrides_it(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    path = _write(tmp_path, BASE + "optimizer: {lr: 0.1}\ntrain: {steps: 9}\n")
    cfg = _parse("--config", str(path), "--optimizer.lr", "3e-4", "--train.steps", "3", "--model.no-patch",
                 "--data.max-length", "64", "--data.labels", "a", "b", "--model.config-overrides", '{"n_layer": 1}',
                 "--logging.no-tensorboard", "--schedule.name", "constant")
    assert (cfg.optimizer.lr, cfg.train.steps, cfg.model.patch, cfg.data.max_length) == (3e-4, 3, False, 64)
    assert cfg.data.labels == ["a", "b"] and cfg.model.config_overrides == {"n_layer": 1}
    assert (cfg.logging.tensorboard, cfg.schedule.name, cfg.task) == (False, "constant", "causal_lm")
    leaves = config.leaf_fields(ft.FinetuneConfig)
    parser = config.build_parser(ft.FinetuneConfig, "")
    flags = {s for action in parser._actions for s in action.option_strings}
    for name in leaves:
        assert "--" + name.replace("_", "-") in flags, name


def test_recipe_reports_bad_configs_with_the_key(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    spec = importlib.util.spec_from_file_location("finetune_recipe", RECIPE)
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    with pytest.raises(SystemExit) as info:  # a type error: argparse usage error, status 2
        recipe.main(["--config", str(_write(tmp_path, BASE + "train: {steps: lots}\n"))])
    assert info.value.code == 2 and "train.steps must be int, got 'lots'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:  # an inconsistent value: exits naming the key
        recipe.main(["--config", str(_write(tmp_path, BASE)), "--task", "classification"])
    assert "data.format 'instruction' does not fit task 'classification'" in str(info.value.code)


# ------------------------------------------------------------------------------------------------
# data formats and batching
# ------------------------------------------------------------------------------------------------


def _cfg(tmp_path, **data_kwargs) -> ft.FinetuneConfig:
    cfg = ft.FinetuneConfig()
    cfg.data.cache_dir = str(tmp_path / "cache")
    for k, v in data_kwargs.items():
        setattr(cfg.data, k, v)
    return cfg


def test_instruction_records_mask_the_prompt(tmp_path):
    f = tmp_path / "i.jsonl"
    f.write_text(json.dumps({"instruction": "Add.", "input": "1 + 2", "output": "3"}) + "\n"
                 + json.dumps({"instruction": "Say hi.", "output": "hi"}) + "\n")
    tok = data.ByteTokenizer()
    cfg = _cfg(tmp_path, train=str(f), format="instruction")
    arrays = examples.load_examples(str(f), cfg, tok, [])
    assert list((tmp_path / "cache").glob("*.npz"))
    ds = example_batches.ExampleDataset(arrays, "causal_lm")
    first, second = ds[0], ds[1]
    prompt = ft.DEFAULT_PROMPT_WITH_INPUT.format(instruction="Add.", input="1 + 2")
    assert tok.decode(first["input_ids"]) == prompt + "3<|eos|>"
    n = len(prompt.encode())
    assert (first["labels"][:n] == -100).all() and first["labels"][n:].tolist() == [ord("3"), tok.eos_token_id]
    assert tok.decode(second["input_ids"]).startswith(ft.DEFAULT_PROMPT.format(instruction="Say hi."))
    batch = example_batches.Collator(tok.pad_token_id, "causal_lm", False)([first, second])
    assert batch["input_ids"].shape == (2, max(first["input_ids"].numel(), second["input_ids"].numel()))
    assert batch["attention_mask"].sum().item() == first["input_ids"].numel() + second["input_ids"].numel()
    assert (batch["labels"][batch["attention_mask"] == 0] == -100).all()
    cfg.data.train_on_prompt = True
    arrays = examples.tokenize(examples.read_records(str(f)), cfg, tok, [])
    assert arrays["prompt"].tolist() == [0, 0]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "?"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: no field 'instruction' \(set data.instruction_field"):
        examples.tokenize(examples.read_records(str(bad)), cfg, tok, [])


def test_packed_examples_restart_positions():
    arrays = {"ids": np.arange(1, 11, dtype=np.uint16), "offsets": np.array([0, 3, 7, 10]),
              "prompt": np.array([0, 2, 0], dtype=np.int32), "split": np.zeros(3, np.int32),
              "label": np.full(3, -100)}
    ds = example_batches.PackedExamples(arrays, 8, pad_token_id=0)
    assert ds.rows == [[0, 1], [2]]
    row = ds[0]
    assert row["input_ids"].tolist() == [1, 2, 3, 4, 5, 6, 7, 0]
    assert row["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 3, 0]  # the padding tail is a segment of its own
    assert row["labels"].tolist() == [-100, 2, 3, -100, -100, 6, 7, -100]  # example starts, prompt, padding
    assert ds[1]["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 3, 4]


def test_classification_pairs_and_labels(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps({"a": a, "b": b, "y": y}) for a, b, y in
                           [("the kettle is red", "it is red", "yes"), ("the rope", "it is blue", "no")]) + "\n")
    records = examples.read_records(str(f))
    cfg = _cfg(tmp_path, train=str(f), format="classification", text_field="a", text_pair_field="b", label_field="y")
    names = examples.label_names(records, cfg.data)
    assert names == ["no", "yes"]
    bert = data.load_tokenizer(str(ROOT / "configs/finetune/models/tiny_bert"))
    ds = example_batches.ExampleDataset(examples.tokenize(records, cfg, bert, names), "classification")
    batch = example_batches.Collator(bert.pad_token_id, "classification", True)([ds[0], ds[1]])
    assert batch["labels"].tolist() == [1, 0]
    ids, types = batch["input_ids"][0].tolist(), batch["token_type_ids"][0].tolist()
    assert ids[0] == bert.cls_token_id and ids.count(bert.sep_token_id) == 2
    assert types.index(1) == ids.index(bert.sep_token_id) + 1  # the second segment starts after the first [SEP]
    roberta = data.load_tokenizer(str(ROOT / "configs/finetune/models/tiny_roberta"))
    arrays = examples.tokenize(records, cfg, roberta, names)
    first = arrays["ids"][: arrays["offsets"][1]].tolist()
    split = int(arrays["split"][0])
    assert first[split - 2 : split] == [roberta.sep_token_id] * 2  # <s> a </s></s> b </s>
    byte = data.ByteTokenizer()
    arrays = examples.tokenize(records, cfg, byte, names)
    first = arrays["ids"][: arrays["offsets"][1]].tolist()
    assert first[0] == byte.cls_token_id and first.count(byte.sep_token_id) == 2
    cfg.data.labels = ["yes"]
    with pytest.raises(ValueError, match=r"label 'no' is not one of data.labels \['yes'\]"):
        examples.tokenize(records, cfg, byte, ["yes"])


def test_select_keeps_examples_intact(tmp_path):
    arrays = {"ids": np.arange(10, dtype=np.uint16), "offsets": np.array([0, 3, 7, 10]),
              "prompt": np.array([1, 2, 0], dtype=np.int32), "split": np.zeros(3, np.int32), "label": np.arange(3)}
    sub = examples.select(arrays, [2, 0])
    assert sub["ids"].tolist() == [7, 8, 9, 0, 1, 2] and sub["offsets"].tolist() == [0, 3, 6]
    assert sub["prompt"].tolist() == [0, 1] and sub["label"].tolist() == [2, 0]


def test_models_from_config_and_path(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = _parse("--config", str(ROOT / "configs/finetune/roberta_pairs.yaml"))
    tok = data.load_tokenizer(models.tokenizer_spec(cfg.model.tokenizer, cfg.model.path, cfg.model.config))
    model = finetune_recipe.build_model(cfg, tok, ["contradiction", "entailment"])
    assert model.config.model_type == "roberta" and model.config.num_labels == 2
    assert models.max_positions(model.config) == 256  # 258 positions - padding_idx 1 - 1
    model.save_pretrained(tmp_path / "m")
    tok.tokenizer.save_pretrained(tmp_path / "m")
    cfg = _parse("--config", str(ROOT / "configs/finetune/roberta_pairs.yaml"), "--model.path", str(tmp_path / "m"),
                 "--model.config-overrides", '{"hidden_dropout_prob": 0.0}')
    # model.path's own tokenizer comes first
    assert models.tokenizer_spec(cfg.model.tokenizer, cfg.model.path, cfg.model.config) == str(tmp_path / "m")
    again = finetune_recipe.build_model(cfg, tok, ["contradiction", "entailment"])
    assert again.config.hidden_dropout_prob == 0.0
    assert torch.equal(again.roberta.embeddings.word_embeddings.weight, model.roberta.embeddings.word_embeddings.weight)
    with pytest.raises(config.ConfigError, match="data.max_length 300 exceeds the model's 256 positions"):
        finetune_recipe.build_model(_parse("--config", str(ROOT / "configs/finetune/roberta_pairs.yaml"),
                                           "--data.max-length", "300"), tok, ["a", "b"])


# ------------------------------------------------------------------------------------------------
# the shipped configs, end to end
# ------------------------------------------------------------------------------------------------


LAUNCHERS = {
    # ddp.yaml (MULTI_GPU) on a machine without a GPU: the recipe falls back to gloo on its own
    "gpt2_instruct": ((*ACCELERATE, "--config_file", str(ROOT / "configs/accelerate/ddp.yaml")), {}, 2),
    "bert_sentiment": ((*ACCELERATE, "--config_file", str(ROOT / "configs/accelerate/single_gpu.yaml")), {}, 1),
    "llama_text_packed": ((sys.executable,), {}, 1),
    "roberta_pairs": ((*ACCELERATE, "--config_file", str(ROOT / "configs/accelerate/ddp.yaml"), "--num_processes",
                       "2"), {"ACCELERATE_USE_CPU": "1"}, 2),
}
MODEL_TYPES = {"gpt2_instruct": "gpt2", "bert_sentiment": "bert", "llama_text_packed": "llama",
               "roberta_pairs": "roberta"}


@pytest.mark.launches_processes
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LAUNCHERS))
def test_shipped_config_runs(tmp_path, name):
    assert (ROOT / "configs" / "finetune" / f"{name}.yaml").is_file()
    launcher, env_extra, processes = LAUNCHERS[name]
    out = tmp_path / "out"
    cmd = [*launcher, str(RECIPE), "--config", f"configs/finetune/{name}.yaml", "--train.steps", "4",
           "--logging.log-interval", "2", "--logging.out-dir", str(out), "--data.cache-dir", str(tmp_path / "cache"),
           "--logging.no-progress", "--eval.interval", "2", "--eval.batches", "2", "--checkpoint.interval", "4"]
    patched = _patch_supports(MODEL_TYPES[name])
    if not patched:
        cmd.append("--model.no-patch")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=launch_env(**env_extra))
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stderr[-6000:]}"
    log = proc.stderr
    assert re.search(r"step 4/4 \| loss [\d.]+ \| lr", log), log
    assert re.search(r"eval step 2 \| val loss [\d.]+", log), log
    summary = json.loads((out / "summary.json").read_text())
    assert summary["processes"] == processes and summary["steps"] == 4
    assert summary["attention"] == ("volta_train" if patched else "sdpa")
    assert math.isfinite(summary["train_loss"]) and math.isfinite(summary["eval_loss"])
    if summary["task"] == "classification":
        assert 0.0 <= summary["eval_accuracy"] <= 1.0
    else:
        assert summary["eval_perplexity"] > 1.0
    assert [step for step, _ in checkpoint.complete_checkpoints(out / "checkpoints")] == [4]
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(out / "final").model_type == MODEL_TYPES[name]
    if MODEL_TYPES[name] in ("bert", "roberta"):  # HuggingFace tokenizers travel with the model
        from transformers import AutoTokenizer

        assert len(AutoTokenizer.from_pretrained(out / "final")) > 100

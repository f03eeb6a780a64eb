"""Fine-tune a model from a YAML file: causal LM on text/instruction jsonl, or sequence classification (BERT/RoBERTa).

    volta-train finetune --config gpt2_instruct      # a shipped config by name (its sample data ships too)
    python recipes/finetune.py --config configs/finetune/gpt2_instruct.yaml
    python recipes/finetune.py --config configs/finetune/bert_sentiment.yaml --optimizer.lr 3e-4 --train.steps 50
    accelerate launch --config_file configs/accelerate/zero2.yaml recipes/finetune.py --config ...
    accelerate launch --num_processes 2 --use_deepspeed recipes/finetune.py --config llama_text_packed \
        --parallel.deepspeed zero3 --parallel.sequence-parallel-size 2   # 2 GPUs share each packed row

Every YAML key is also a flag, with its section in front (--optimizer.lr, --data.max-length,
--model.no-patch ... see --help); flags override the file. The sections memory, parallel and precision are the
same as gpt_long's (volta_train/training/memory.py, parallel.py, precision.py). The YAML is checked before anything
runs: an unknown key, a wrong type or an inconsistent value stops with the key named.
Models, tokenizers and data are read from local paths only; nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see recipes/gpt_long.py

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from accelerate.utils import set_seed  # noqa: E402

from .. import resources  # noqa: E402
from ..training import (  # noqa: E402
    activation_offload, attention_choice, config, data, distributed, examples, logs, memory, metrics, models, optim,
    parallel, precision, sequence_parallel, steps,
)
from ..training.config import ConfigError  # noqa: E402
from ..training.evaluation import Evaluator  # noqa: E402
from ..training.example_batches import Collator, ExampleDataset, PackedExamples  # noqa: E402
from ..training.finetune_config import FinetuneConfig, check  # noqa: E402
from ..training.gpt import GPTTrainConfig  # noqa: E402
from ..training.trainer import (  # noqa: E402
    LoopConfig, Trainer, end_training, exit_status, finished_earlier, resume_option_problem, run_or_fail,
    save_final_and_summary, starting_run, trajectory_settings,
)

log = logging.getLogger("finetune")
_prog = ["finetune.py"]  # the command name error messages start with (volta-train finetune sets its own)

# Options that do not change what is trained (where files go, logging, checkpoint and evaluation scheduling,
# threads); every other option is recorded with each checkpoint and compared on resume.
NOT_TRAJECTORY = {"logging", "checkpoint", "eval", "data.cache_dir", "data.num_workers", "train.cpu",
                  "train.cpu_threads", "train.time_limit_min", "precision.max_consecutive_skips",
                  "parallel.deepspeed", "parallel.zero_offload", "memory.gradient_checkpointing"}
# Options whose change makes the checkpoint's weights meaningless for this run: resuming with another is refused.
FIXED = ("--task", "--model.config", "--model.tokenizer", "--data.labels")


def _fail(message: str):
    sys.exit(f"{_prog[0]}: error: {message}")


def main(argv=None, prog: str = "finetune.py") -> dict:
    """Run the recipe: parse, build, train, save; returns summary.json's contents. A run that stopped before its
    planned steps with a checkpoint (SIGTERM, a time limit) exits with trainer.STOPPED_EXIT once that is written."""
    _prog[0] = prog
    # ---- parse: the options, checked across keys, and every refusal before out_dir is touched
    cfg, notes = _parse(argv)
    allocator_note = distributed.cuda_allocator_env()  # before anything initialises CUDA
    t, d = cfg.train, cfg.data
    try:
        state = distributed.init_state(t.cpu, cfg.parallel.deepspeed)
        cfg = dataclasses.replace(cfg, precision=precision.resolve(cfg.precision, state.device.type))
        precision.check_device(cfg.precision, state.device)
        parallel.check(cfg.parallel, state.num_processes)
    except ConfigError as e:
        _fail(str(e))
    if state.device.type == "cuda":
        notes = [allocator_note, *notes]
    out_dir = Path(cfg.logging.out_dir)

    with starting_run(out_dir, state, _fail) as run:  # a failure before run.begin() leaves no file in out_dir
        transformers.utils.logging.disable_progress_bar()
        threads = t.cpu_threads
        if threads is None and state.device.type != "cuda":
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            threads = max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", state.num_processes)))
        if threads:
            torch.set_num_threads(threads)
        set_seed(t.seed)
        for note in notes:
            log.info("%s", note)
        logs.log_config(log, config.to_dict(cfg), out_dir, state.is_main_process, write=False)

        # ---- build: examples, the model (partitioned under ZeRO-3) with its attention and memory features, the
        # Accelerator, the batches and the evaluation
        tokenizer, names, train_arrays, eval_arrays = _load_data(cfg, state)
        p, prec = cfg.parallel, cfg.precision
        causal = cfg.task == "causal_lm"
        try:
            zero3 = parallel.zero3_config(p, mixed_precision=prec.mixed_precision, grad_accum=t.grad_accum,
                                          batch_size=t.batch_size, grad_clip=t.grad_clip)
        except ConfigError as e:
            _fail(str(e))
        with parallel.partitioned_build(zero3):  # ZeRO-3: no process ever holds the whole model
            model = _build_model(cfg, state, tokenizer, names)
        impl = model.config._attn_implementation
        chunked = memory.loss_mode(cfg.memory, model, causal)
        train_set, eval_set, collate = _datasets(cfg, model, tokenizer, train_arrays, eval_arrays)
        n_params = sum(distributed.param_numel(w) for w in model.parameters())
        n_layer, hidden = models.layers_and_hidden(model.config)
        flops = metrics.FlopCounter(metrics.matmul_parameters(model), n_layer, hidden, causal=causal)
        log.info("model: %s for %s, %.2fM parameters, attention %s%s%s", model.config.model_type, cfg.task,
                 n_params / 1e6, impl, ", gradient checkpointing" if cfg.memory.gradient_checkpointing else "",
                 f", labels {names}" if names else "")
        log.info("data: %d training %s, %s evaluation; %s, max_length %d, tokenizer %s", len(train_set),
                 "packed rows" if d.packing else "examples", len(eval_set) if eval_set is not None else "no",
                 d.format, d.max_length, getattr(tokenizer, "name", "?"))

        try:
            par = parallel.accelerator(p, model, cpu=t.cpu, mixed_precision=prec.mixed_precision,
                                       grad_accum=t.grad_accum, batch_size=t.batch_size, grad_clip=t.grad_clip,
                                       loss_scale_init=prec.loss_scale_init, loss_scale_window=prec.loss_scale_window)
        except ConfigError as e:
            _fail(str(e))
        setup, accelerator = par.setup, par.setup.accelerator
        n_steps = steps_for(cfg, len(train_set), par.replicas)
        warmup = cfg.schedule.warmup_steps if cfg.schedule.warmup_steps is not None else \
            int(cfg.schedule.warmup_ratio * n_steps)
        o = cfg.optimizer
        optimizer = optim.for_setup(setup, model, o.name, o.lr, o.weight_decay, (o.beta1, o.beta2), o.eps, o.momentum)
        log.info("device: %s x %d process(es), %s; %d steps of %d x %d x %d, %s lr %.1e, warmup %d",
                 accelerator.device, accelerator.num_processes, setup.precision, n_steps, t.batch_size, t.grad_accum,
                 par.replicas, cfg.schedule.name, o.lr, warmup)
        model, optimizer = parallel.prepare(par, model, optimizer, d.max_length)
        try:
            batches = steps.MicroBatches(train_set, t.batch_size, par, t.seed, flops, collate_fn=collate,
                                         num_workers=d.num_workers)
        except ValueError as e:
            _fail(f"data.train: {e}")
        loss_fn = steps.loss_function(par, impl, chunked, cfg.memory.loss_chunk_tokens) if causal else None
        evaluate = Evaluator(model, accelerator, eval_set, collate, cfg.eval.batch_size or t.batch_size,
                             cfg.eval.batches, causal, chunked, cfg.memory.loss_chunk_tokens, par.layout) \
            if eval_set is not None and len(eval_set) else None
        hf_tokenizer = data.saveable_tokenizer(tokenizer)  # AutoTokenizer.from_pretrained(model) loads it
        options = config.to_dict(cfg)
        options["train"]["steps"], options["schedule"]["warmup_steps"] = n_steps, warmup  # as resolved
        options["data"]["labels"] = list(names)
        settings = trajectory_settings(options, NOT_TRAJECTORY, lambda name: "--" + name.replace("_", "-"))
        trainer = Trainer(setup, model, optimizer, _loop_config(cfg, n_steps, warmup), batches=batches,
                          flops=batches.count, evaluate=evaluate, run_info={"chunked_loss": chunked},
                          tokenizer=hf_tokenizer, loss_fn=loss_fn, settings=settings, fixed_settings=FIXED,
                          renamed_settings=config.renamed_flags(FinetuneConfig))
        run.begin(config.to_dict(cfg))  # train.log and config.yaml: the run's files from here on

        # ---- train
        result = run_or_fail(trainer, _fail)
        summary = finished_earlier(trainer, result, log, final_expected=cfg.checkpoint.save_final)
        if summary is None:
            # ---- save: the final model and summary.json
            summary = {**result, "task": cfg.task, "attention": impl, "parameters": n_params,
                       "precision": setup.precision, "zero_stage": setup.zero_stage,
                       "processes": accelerator.num_processes, "sequence_parallel_size": p.sequence_parallel_size,
                       "data_parallel_size": par.replicas, "labels": names or None,
                       "model": str(out_dir / "final") if cfg.checkpoint.save_final and result["completed"] else None}
            offloaded = activation_offload.report(accelerator.unwrap_model(model))
            if offloaded is not None:
                summary["activation_offload"] = offloaded
            save_final_and_summary(accelerator, model, out_dir, summary, "model", cfg, hf_tokenizer, _fail)
            _log_done(summary, impl, out_dir)
            end_training(accelerator)
    if exit_status(summary):
        raise SystemExit(exit_status(summary))
    return summary


def parse(argv=None) -> FinetuneConfig:
    return _parse(argv)[0]


def _parse(argv=None) -> tuple[FinetuneConfig, list[str]]:
    """The checked config and one note per shipped path used in place of a checkout's."""
    try:
        argv = resources.resolve_config_option(sys.argv[1:] if argv is None else list(argv), "finetune")
    except FileNotFoundError as e:
        config.usage_error(_prog[0], str(e))
    cfg = config.parse_config(FinetuneConfig, argv, description=__doc__, other=GPTTrainConfig)
    try:
        cfg, notes = shipped_paths(cfg)
        cfg = check(cfg)
        logs.check_tensorboard(cfg.logging.tensorboard, "--logging.tensorboard")
        resume_problem = resume_option_problem(cfg.checkpoint.resume, "--checkpoint.resume")
        if resume_problem:
            config.usage_error(_prog[0], resume_problem)
        return cfg, notes
    except ConfigError as e:
        config.usage_error(_prog[0], str(e))
    except ImportError as e:
        _fail(str(e))


def shipped_paths(cfg: FinetuneConfig) -> tuple[FinetuneConfig, list[str]]:
    """Paths written relative to a checkout's root (``configs/...``, ``data/...``, as the shipped configs have them)
    that do not exist here are taken from the installed package's copies; returns the config and one note each."""
    sections, notes = {}, []
    for section, names in (("model", ("config", "path", "tokenizer")), ("data", ("train", "eval"))):
        part = getattr(cfg, section)
        changes = {}
        for name in names:
            value = getattr(part, name, None)
            if isinstance(value, str) and value and not Path(value).exists():
                shipped = resources.shipped_path(value)
                if shipped is not None:
                    changes[name] = str(shipped)
                    notes.append(f"{section}.{name}: {value} is not here; using the shipped {shipped}")
        if changes:
            sections[section] = dataclasses.replace(part, **changes)
    return (dataclasses.replace(cfg, **sections) if sections else cfg), notes


def _load_data(cfg, state):
    """(tokenizer, label names, training arrays, eval arrays): eval from data.eval, else data.eval_fraction of the
    training examples held out (seeded), else None."""
    d = cfg.data
    try:
        tokenizer = data.load_tokenizer(models.tokenizer_spec(cfg.model.tokenizer, cfg.model.path, cfg.model.config))
        records_for_labels = examples.read_records(d.train) if cfg.task == "classification" and not d.labels else []
        names = examples.label_names(records_for_labels, d) if cfg.task == "classification" else []
        with state.local_main_process_first():
            train_arrays = examples.load_examples(d.train, cfg, tokenizer, names)
            eval_arrays = examples.load_examples(d.eval, cfg, tokenizer, names) if d.eval else None
    except (OSError, ValueError) as e:
        _fail(str(e))
    if eval_arrays is None and d.eval_fraction > 0:
        n = train_arrays["offsets"].size - 1
        order = np.random.default_rng(cfg.train.seed).permutation(n)
        n_eval = max(1, int(n * d.eval_fraction))
        eval_arrays = examples.select(train_arrays, sorted(order[:n_eval].tolist()))
        train_arrays = examples.select(train_arrays, sorted(order[n_eval:].tolist()))
    return tokenizer, names, train_arrays, eval_arrays


def build_model(cfg: FinetuneConfig, tokenizer, names: list[str]):
    """The model for ``cfg.task`` (weights from model.path, or random from model.config; loaded as gpt_long loads
    one: :func:`~volta_train.training.models.load_causal_lm`), attention still stock, memory features not yet on."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    m = cfg.model
    if m.path:
        model_config = AutoConfig.from_pretrained(m.path, local_files_only=True)
    else:
        model_config = models.read_model_config(m.config)
    for key, value in m.config_overrides.items():
        if not hasattr(model_config, key):
            raise ConfigError(f"model.config_overrides: the {model_config.model_type} config has no {key!r}")
        setattr(model_config, key, value)
    model_config.use_cache = False
    if cfg.task == "classification":
        model_config.num_labels = len(names)
        model_config.id2label = dict(enumerate(names))
        model_config.label2id = {n: i for i, n in enumerate(names)}
        if getattr(model_config, "pad_token_id", None) is None:
            model_config.pad_token_id = tokenizer.pad_token_id
        cls = AutoModelForSequenceClassification
    else:
        cls = AutoModelForCausalLM
    if model_config.vocab_size < tokenizer.vocab_size:
        raise ConfigError(f"model: the vocabulary ({model_config.vocab_size}) is smaller than the tokenizer's "
                          f"({tokenizer.vocab_size}); with the byte tokenizer use vocab_size >= "
                          f"{models.padded_vocab(tokenizer.vocab_size)}")
    limit = models.max_positions(model_config)
    if limit is not None and cfg.data.max_length > limit:
        raise ConfigError(f"data.max_length {cfg.data.max_length} exceeds the model's {limit} positions")
    model = models.load_causal_lm(cls, m.path, config=model_config)
    if cfg.task == "causal_lm":
        model.loss_type = "ForCausalLM"
    return model


def _build_model(cfg, state, tokenizer, names: list[str]):
    """The model, its attention (volta_train's unless model.no-patch), packed examples checked to stay apart, its
    heads checked against the sequence-parallel degree, then the memory features."""
    p = cfg.parallel
    try:
        model = build_model(cfg, tokenizer, names)
        if cfg.model.patch:
            attention_choice.apply_patch(model, flag="--model.no-patch")
        if p.sequence_parallel_size > 1:
            heads, kv_heads = sequence_parallel.heads_of(model.config)
            parallel.check_heads(p, heads, kv_heads, state.num_processes)
        memory.apply(model, cfg.memory, memory.tokens_per_process(cfg.train.batch_size, cfg.data.max_length,
                                                                  p.sequence_parallel_size))
    except (ConfigError, attention_choice.AttentionSetupError, OSError, ValueError) as e:
        _fail(str(e))
    if cfg.data.packing:
        ok, why = attention_choice.packed_documents_kept_apart(model, p.sequence_parallel_size > 1,
                                                               vocab_limit=min(256, tokenizer.vocab_size))
        if not ok:
            _fail(f"data.packing: attention {model.config._attn_implementation!r} does not keep packed examples "
                  f"apart ({why}); set data.packing: false, or model.patch: false")
    return model


def _datasets(cfg, model, tokenizer, train_arrays, eval_arrays):
    """(training set, eval set or None, collator): packed rows (data.packing) or one example per item."""
    d, pad = cfg.data, tokenizer.pad_token_id
    if d.packing:
        train_set = PackedExamples(train_arrays, d.max_length, pad)
        eval_set = PackedExamples(eval_arrays, d.max_length, pad) if eval_arrays is not None else None
    else:
        train_set = ExampleDataset(train_arrays, cfg.task)
        eval_set = ExampleDataset(eval_arrays, cfg.task) if eval_arrays is not None else None
    token_types = cfg.task == "classification" and getattr(model.config, "type_vocab_size", 1) > 1
    return train_set, eval_set, Collator(pad, cfg.task, token_types)


def steps_for(cfg: FinetuneConfig, n_train_items: int, replicas: int) -> int:
    """train.steps, or the optimizer steps of train.epochs passes over the training items by ``replicas``
    data-parallel replicas."""
    if cfg.train.steps:
        return cfg.train.steps
    per_epoch = n_train_items // (cfg.train.batch_size * replicas)
    return max(1, math.ceil(cfg.train.epochs * per_epoch / cfg.train.grad_accum))


def _loop_config(cfg, n_steps: int, warmup: int) -> LoopConfig:
    t = cfg.train
    return LoopConfig(
        steps=n_steps, grad_accum=t.grad_accum, lr=cfg.optimizer.lr, warmup_steps=warmup,
        min_lr_ratio=cfg.schedule.min_lr_ratio, schedule=cfg.schedule.name, grad_clip=t.grad_clip,
        log_interval=cfg.logging.log_interval, eval_interval=cfg.eval.interval,
        checkpoint_interval=cfg.checkpoint.interval, keep_checkpoints=cfg.checkpoint.keep, resume=cfg.checkpoint.resume,
        time_limit_min=t.time_limit_min, out_dir=cfg.logging.out_dir, progress=cfg.logging.progress,
        tensorboard=cfg.logging.tensorboard, peak_tflops=cfg.logging.peak_tflops,
        max_consecutive_skips=cfg.precision.max_consecutive_skips, allow_missing_rng=cfg.checkpoint.resume_without_rng,
        steps_flag="--train.steps", resume_flag="--checkpoint.resume", final_model=cfg.checkpoint.save_final,
    )


def _log_done(summary: dict, impl: str, out_dir: Path) -> None:
    evals = " | ".join(f"eval {k.removeprefix('eval_')} {'n/a' if v is None else f'{v:.4f}'}"
                       for k, v in summary.items() if k.startswith("eval_"))
    log.info("done: %d steps, %s tokens in %.1f s (%s tok/s) | train loss %.4f%s | attention %s%s | model %s | %s",
             summary["steps"], f"{summary['tokens']:,}", summary["seconds"], f"{summary['tokens_per_second']:,.0f}",
             summary["train_loss"], f" | {evals}" if evals else "", impl,
             f" | stopped early: {summary['stopped']}" if summary.get("stopped") else "", summary["model"],
             logs.run_files(out_dir))


if __name__ == "__main__":
    main()

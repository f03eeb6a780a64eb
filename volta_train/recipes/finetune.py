"""Fine-tune a model from a YAML file: causal LM on text/instruction jsonl, or sequence classification (BERT/RoBERTa).

    volta-train finetune --config gpt2_instruct      # a shipped config by name (its sample data ships too)
    python recipes/finetune.py --config configs/finetune/gpt2_instruct.yaml
    python recipes/finetune.py --config configs/finetune/bert_sentiment.yaml --optimizer.lr 3e-4 --train.steps 50
    accelerate launch --config_file configs/accelerate/zero2.yaml recipes/finetune.py --config ...

Every YAML key is also a flag, with its section in front (--optimizer.lr, --data.max-length,
--model.no-patch ... see --help); flags override the file. The YAML is checked before anything
runs: an unknown key, a wrong type or an inconsistent value stops with the key named.
Models, tokenizers and data are read from local paths only; nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import logging
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
    activation_offload, attention_choice, chunked_loss, config, data, distributed, logs, metrics, models, optim,
    runlock,
)
from ..training import finetune_setup as ft  # noqa: E402
from ..training.trainer import (  # noqa: E402
    LoopConfig, Trainer, end_training, finished_earlier, resume_option_problem, run_or_fail, run_recipe,
    save_final_and_summary, trajectory_settings,
)

log = logging.getLogger("finetune")
_prog = ["finetune.py"]  # the command name error messages start with (volta-train finetune sets its own)

# Options that do not change what is trained (where files go, logging, checkpoint and evaluation scheduling,
# threads); every other option is recorded with each checkpoint and compared on resume.
NOT_TRAJECTORY = {"logging", "checkpoint", "eval", "data.cache_dir", "data.num_workers", "train.cpu",
                  "train.cpu_threads", "train.time_limit_min", "train.max_consecutive_skips", "train.deepspeed",
                  "model.gradient_checkpointing"}
# Options whose change makes the checkpoint's weights meaningless for this run: resuming with another is refused.
FIXED = ("--task", "--model.config", "--model.tokenizer", "--data.labels")


def _fail(message: str):
    sys.exit(f"{_prog[0]}: error: {message}")


def shipped_paths(cfg: ft.FinetuneConfig) -> tuple[ft.FinetuneConfig, list[str]]:
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


def parse(argv=None) -> ft.FinetuneConfig:
    return _parse(argv)[0]


def _parse(argv=None) -> tuple[ft.FinetuneConfig, list[str]]:
    try:
        argv = resources.resolve_config_option(sys.argv[1:] if argv is None else list(argv), "finetune")
    except FileNotFoundError as e:
        config.usage_error(_prog[0], str(e))
    cfg = config.parse_config(ft.FinetuneConfig, argv, description=__doc__)
    try:
        cfg, notes = shipped_paths(cfg)
        cfg = ft.check(cfg)
        logs.check_tensorboard(cfg.logging.tensorboard, "--logging.tensorboard")
        if cfg.train.loss_chunk_tokens is not None and cfg.train.loss_chunk_tokens <= 0:
            config.usage_error(_prog[0], "train.loss_chunk_tokens must be positive (or unset: auto), got "
                               f"{cfg.train.loss_chunk_tokens}")
        resume_problem = resume_option_problem(cfg.checkpoint.resume, "--checkpoint.resume")
        if resume_problem:
            config.usage_error(_prog[0], resume_problem)
        return cfg, notes
    except config.ConfigError as e:
        config.usage_error(_prog[0], str(e))
    except ImportError as e:
        _fail(str(e))


def main(argv=None, prog: str = "finetune.py") -> dict:
    """Run the recipe; returns summary.json's contents (:func:`~volta_train.training.trainer.run_recipe`)."""
    _prog[0] = prog
    return run_recipe(argv, _start, _prepare, _train, lambda cfg: cfg.logging.out_dir, _fail)


def _prepare(cfg, state):
    """Everything before the first step: data, model, accelerator, trainer (a failure here leaves no files)."""
    t, d = cfg.train, cfg.data
    tokenizer, names, train_arrays, eval_arrays = _load_data(cfg, state)
    try:
        zero3 = distributed.zero3_init_config(mixed_precision=_precision(cfg, state), grad_accum=t.grad_accum,
                                              batch_size=t.batch_size, grad_clip=t.grad_clip,
                                              deepspeed_spec=t.deepspeed)
    except config.ConfigError as e:
        _fail(str(e))
    with distributed.partitioned_build(zero3):  # ZeRO-3: no process ever holds the whole model
        model, chunked = _build_model(cfg, tokenizer, names)
    impl = model.config._attn_implementation
    train_set, eval_set, collate = _datasets(cfg, model, tokenizer, train_arrays, eval_arrays)
    causal = cfg.task == "causal_lm"
    n_params = sum(distributed.param_numel(p) for p in model.parameters())
    n_layer, hidden = models.layers_and_hidden(model.config)
    flops = metrics.FlopCounter(metrics.matmul_parameters(model), n_layer, hidden, causal=causal)
    log.info("model: %s for %s, %.2fM parameters, attention %s%s%s", model.config.model_type, cfg.task,
             n_params / 1e6, impl, ", gradient checkpointing" if cfg.model.gradient_checkpointing else "",
             f", labels {names}" if names else "")
    log.info("data: %d training %s, %s evaluation; %s, max_length %d, tokenizer %s", len(train_set),
             "packed rows" if d.packing else "examples", len(eval_set) if eval_set is not None else "no",
             d.format, d.max_length, getattr(tokenizer, "name", "?"))

    setup, optimizer, steps, warmup = _accelerator(cfg, state, model, len(train_set))
    accelerator = setup.accelerator
    model, optimizer = accelerator.prepare(model, optimizer)
    batches = _batches(cfg, accelerator, train_set, collate)
    evaluate = ft.Evaluator(model, accelerator, eval_set, collate, cfg.eval.batch_size or t.batch_size,
                            cfg.eval.batches, causal, chunked, t.loss_chunk_tokens) \
        if eval_set is not None and len(eval_set) else None
    hf_tokenizer = data.saveable_tokenizer(tokenizer)  # AutoTokenizer.from_pretrained(model) loads it
    options = config.to_dict(cfg)
    options["train"]["steps"], options["schedule"]["warmup_steps"] = steps, warmup  # as resolved
    options["data"]["labels"] = list(names)
    settings = trajectory_settings(options, NOT_TRAJECTORY, lambda name: "--" + name.replace("_", "-"))
    loss_fn = (lambda engine, batch: chunked_loss.causal_lm_loss(engine, batch, chunk_tokens=t.loss_chunk_tokens)) \
        if chunked else None
    trainer = Trainer(setup, model, optimizer, _loop_config(cfg, steps, warmup), batches=batches, flops=flops,
                      evaluate=evaluate, run_info={"chunked_loss": chunked}, tokenizer=hf_tokenizer, loss_fn=loss_fn,
                      settings=settings, fixed_settings=FIXED)
    return trainer, (model, impl, n_params, names, setup, hf_tokenizer)


def _train(cfg, trainer, model, impl, n_params, names, setup, hf_tokenizer) -> dict:
    out_dir, accelerator = Path(cfg.logging.out_dir), setup.accelerator
    result = run_or_fail(trainer, _fail)
    previous = finished_earlier(trainer, result, log, final_expected=cfg.checkpoint.save_final)
    if previous is not None:
        return previous

    summary = {**result, "task": cfg.task, "attention": impl, "parameters": n_params, "precision": setup.precision,
               "zero_stage": setup.zero_stage, "processes": accelerator.num_processes, "labels": names or None,
               "model": str(out_dir / "final") if cfg.checkpoint.save_final and result["completed"] else None}
    offloaded = activation_offload.report(accelerator.unwrap_model(model))
    if offloaded is not None:
        summary["activation_offload"] = offloaded
    save_final_and_summary(accelerator, model, out_dir, summary, "model", cfg, hf_tokenizer, _fail)
    _log_done(summary, impl, out_dir)
    end_training(accelerator)
    return summary


def _start(argv, held: list):
    """The checked config and the process state; out_dir locked for this run, logging, threads and seeds set up."""
    cfg, notes = _parse(argv)
    allocator_note = distributed.cuda_allocator_env()  # before anything initialises CUDA
    t = cfg.train
    try:
        state = distributed.init_state(t.cpu, t.deepspeed)
        distributed.check_mixed_precision(_precision(cfg, state), state.device, "train.mixed_precision")
    except config.ConfigError as e:
        _fail(str(e))
    out_dir = Path(cfg.logging.out_dir)
    try:  # before anything is written there: one run per out_dir
        held.append(runlock.acquire_for_run(out_dir, state.is_main_process, state.num_processes, state.device))
    except runlock.RunLockError as e:
        _fail(str(e))
    logs.setup_logging(state.is_main_process, out_dir / "train.log", deferred=True)  # written once the run begins
    if state.device.type == "cuda":
        notes = [allocator_note, *notes]
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
    return cfg, state


def _load_data(cfg, state):
    """(tokenizer, label names, training arrays, eval arrays): eval from data.eval, else data.eval_fraction of the
    training examples held out (seeded), else None."""
    d = cfg.data
    try:
        tokenizer = data.load_tokenizer(ft.tokenizer_spec(cfg))
        records_for_labels = ft.read_records(d.train) if cfg.task == "classification" and not d.labels else []
        names = ft.label_names(records_for_labels, d) if cfg.task == "classification" else []
        with state.local_main_process_first():
            train_arrays = ft.load_examples(d.train, cfg, tokenizer, names)
            eval_arrays = ft.load_examples(d.eval, cfg, tokenizer, names) if d.eval else None
    except (OSError, ValueError) as e:
        _fail(str(e))
    if eval_arrays is None and d.eval_fraction > 0:
        n = train_arrays["offsets"].size - 1
        order = np.random.default_rng(cfg.train.seed).permutation(n)
        n_eval = max(1, int(n * d.eval_fraction))
        eval_arrays = ft.select(train_arrays, sorted(order[:n_eval].tolist()))
        train_arrays = ft.select(train_arrays, sorted(order[n_eval:].tolist()))
    return tokenizer, names, train_arrays, eval_arrays


def _build_model(cfg, tokenizer, names: list[str]):
    """(model, chunked loss?): the model, then its attention (volta_train's unless model.no-patch); packed examples
    checked to stay apart; the causal LM's chunked loss resolved."""
    try:
        model = ft.build_model(cfg, tokenizer, names)
        if cfg.model.patch:
            attention_choice.apply_patch(model, flag="--model.no-patch")
    except (config.ConfigError, attention_choice.AttentionSetupError, OSError, ValueError) as e:
        _fail(str(e))
    if cfg.data.packing:
        ok, why = attention_choice.packed_documents_supported(model, vocab_limit=min(256, tokenizer.vocab_size))
        if not ok:
            _fail(f"data.packing: attention {model.config._attn_implementation!r} does not keep packed examples "
                  f"apart ({why}); set data.packing: false, or model.patch: false")
    chunked = False
    if cfg.task == "causal_lm":
        chunked, loss_note = chunked_loss.resolve(cfg.train.chunked_loss, model, cfg.train.loss_chunk_tokens)
        log.info("%s", loss_note)
    return model, chunked


def _datasets(cfg, model, tokenizer, train_arrays, eval_arrays):
    """(training set, eval set or None, collator): packed rows (data.packing) or one example per item."""
    d, pad = cfg.data, tokenizer.pad_token_id
    if d.packing:
        train_set = ft.PackedExamples(train_arrays, d.max_length, pad)
        eval_set = ft.PackedExamples(eval_arrays, d.max_length, pad) if eval_arrays is not None else None
    else:
        train_set = ft.ExampleDataset(train_arrays, cfg.task)
        eval_set = ft.ExampleDataset(eval_arrays, cfg.task) if eval_arrays is not None else None
    token_types = cfg.task == "classification" and getattr(model.config, "type_vocab_size", 1) > 1
    return train_set, eval_set, ft.Collator(pad, cfg.task, token_types)


def _accelerator(cfg, state, model, n_train: int):
    """(accelerate setup, optimizer, steps, warmup steps), the device line logged; precision "auto": fp16 on a
    GPU, fp32 on CPU, unless ``accelerate config`` chose one."""
    t, o = cfg.train, cfg.optimizer
    try:
        setup = distributed.build_accelerator(
            cpu=t.cpu, mixed_precision=_precision(cfg, state), grad_accum=t.grad_accum, batch_size=t.batch_size,
            grad_clip=t.grad_clip, deepspeed_spec=t.deepspeed, loss_scale_init=t.loss_scale_init,
            loss_scale_window=t.loss_scale_window,
        )
    except config.ConfigError as e:
        _fail(str(e))
    accelerator = setup.accelerator
    world = accelerator.num_processes
    steps = ft.steps_for(cfg, n_train, world)
    warmup = cfg.schedule.warmup_steps if cfg.schedule.warmup_steps is not None else \
        int(cfg.schedule.warmup_ratio * steps)
    if setup.deepspeed and "optimizer" in accelerator.state.deepspeed_plugin.deepspeed_config:
        from accelerate.utils import DummyOptim

        optimizer = DummyOptim(optim.param_groups(model, o.weight_decay), lr=o.lr, weight_decay=o.weight_decay)
    else:
        optimizer = optim.build_optimizer(model, o.name, o.lr, o.weight_decay, (o.beta1, o.beta2), o.eps, o.momentum)
    log.info("device: %s x %d process(es), %s; %d steps of %d x %d x %d, %s lr %.1e, warmup %d", accelerator.device,
             world, setup.precision, steps, t.batch_size, t.grad_accum, world, cfg.schedule.name, o.lr, warmup)
    return setup, optimizer, steps, warmup


def _precision(cfg, state) -> str:
    """train.mixed_precision resolved: "auto" is fp16 on a GPU, fp32 on CPU, unless ``accelerate config`` chose one."""
    precision = cfg.train.mixed_precision
    if precision == "auto":
        on_gpu = state.device.type == "cuda"
        precision = models.auto_precision("fp16" if on_gpu else "no", "cuda" if on_gpu else "cpu")
    return precision


def _batches(cfg, accelerator, train_set, collate):
    """The trainer's ``batches``: this process's micro-batches from a micro-batch index on (a training set too small
    for one batch per process stops the run here)."""
    t = cfg.train
    rank, world = accelerator.process_index, accelerator.num_processes
    try:
        data.ShardedBatchSampler(len(train_set), t.batch_size, world, rank)
    except ValueError as e:
        _fail(f"data.train: {e}")
    pin = accelerator.device.type == "cuda"

    def batches(start: int):
        sampler = data.ShardedBatchSampler(len(train_set), t.batch_size, world, rank, seed=t.seed, start=start)
        return data.micro_batches(train_set, sampler, collate_fn=collate, num_workers=cfg.data.num_workers,
                                  pin_memory=pin)

    return batches


def _loop_config(cfg, steps: int, warmup: int) -> LoopConfig:
    t = cfg.train
    return LoopConfig(
        steps=steps, grad_accum=t.grad_accum, lr=cfg.optimizer.lr, warmup_steps=warmup,
        min_lr_ratio=cfg.schedule.min_lr_ratio, schedule=cfg.schedule.name, grad_clip=t.grad_clip,
        log_interval=cfg.logging.log_interval, eval_interval=cfg.eval.interval,
        checkpoint_interval=cfg.checkpoint.interval, keep_checkpoints=cfg.checkpoint.keep, resume=cfg.checkpoint.resume,
        time_limit_min=t.time_limit_min, out_dir=cfg.logging.out_dir, progress=cfg.logging.progress,
        tensorboard=cfg.logging.tensorboard, peak_tflops=cfg.logging.peak_tflops,
        max_consecutive_skips=t.max_consecutive_skips, allow_missing_rng=cfg.checkpoint.resume_without_rng,
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

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
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see recipes/gpt_long.py

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from accelerate.utils import set_seed  # noqa: E402

from .. import _resources  # noqa: E402
from ..training import (  # noqa: E402
    attention, chunked_loss, config, data, distributed, logs, metrics, optim, runlock,
)
from ..training import finetune as ft  # noqa: E402
from ..training.models import auto_precision  # noqa: E402
from ..training.trainer import (  # noqa: E402
    LoopConfig, Trainer, finished_earlier, run_or_fail, save_final_and_summary,
)

log = logging.getLogger("finetune")


def _fail(message: str):
    sys.exit(f"finetune.py: error: {message}")


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
                shipped = _resources.shipped_path(value)
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
        argv = _resources.resolve_config_option(sys.argv[1:] if argv is None else list(argv), "finetune")
    except FileNotFoundError as e:
        _fail(str(e))
    cfg = config.parse_config(ft.FinetuneConfig, argv, description=__doc__)
    try:
        cfg, notes = shipped_paths(cfg)
        cfg = ft.check(cfg)
        logs.check_tensorboard(cfg.logging.tensorboard, "--logging.tensorboard")
        if cfg.train.loss_chunk_tokens is not None and cfg.train.loss_chunk_tokens <= 0:
            _fail(f"train.loss_chunk_tokens must be positive (or unset: auto), got {cfg.train.loss_chunk_tokens}")
        return cfg, notes
    except config.ConfigError as e:
        _fail(str(e))
    except ImportError as e:
        _fail(str(e))


def main(argv=None) -> dict:
    held: list = []  # out_dir's lock (main process), released however the run ends
    try:
        return _main(argv, held)
    finally:
        for lock in held:
            if lock is not None:
                lock.release()


def _main(argv, held: list) -> dict:
    cfg, notes = _parse(argv)
    t = cfg.train
    try:
        state = distributed.init_state(t.cpu, t.deepspeed)
    except config.ConfigError as e:
        _fail(str(e))
    on_gpu = state.device.type == "cuda"
    precision = t.mixed_precision
    if precision == "auto":
        precision = auto_precision("fp16" if on_gpu else "no", "cuda" if on_gpu else "cpu")
    out_dir = Path(cfg.logging.out_dir)
    try:  # before anything is written there: one run per out_dir
        held.append(runlock.acquire_for_run(out_dir, state.is_main_process, state.num_processes, state.device))
    except runlock.RunLockError as e:
        _fail(str(e))
    logs.setup_logging(state.is_main_process, out_dir / "train.log")
    transformers.utils.logging.disable_progress_bar()
    threads = t.cpu_threads
    if threads is None and not on_gpu:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        threads = max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", state.num_processes)))
    if threads:
        torch.set_num_threads(threads)
    set_seed(t.seed)
    for note in notes:
        log.info("%s", note)
    logs.log_config(log, config.to_dict(cfg), out_dir, state.is_main_process)

    # data
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
        order = np.random.default_rng(t.seed).permutation(n)
        n_eval = max(1, int(n * d.eval_fraction))
        eval_arrays = ft.select(train_arrays, sorted(order[:n_eval].tolist()))
        train_arrays = ft.select(train_arrays, sorted(order[n_eval:].tolist()))

    # model and attention
    try:
        model = ft.build_model(cfg, tokenizer, names)
        if cfg.model.patch:
            attention.apply_patch(model, flag="--model.no-patch")
    except (config.ConfigError, attention.AttentionSetupError, OSError, ValueError) as e:
        _fail(str(e))
    impl = model.config._attn_implementation
    if d.packing:
        ok, why = attention.packed_documents_supported(model, vocab_limit=min(256, tokenizer.vocab_size))
        if not ok:
            _fail(f"data.packing: attention {impl!r} does not keep packed examples apart ({why}); set "
                  "data.packing: false, or model.patch: false")
    causal = cfg.task == "causal_lm"
    chunked = False
    if causal:
        chunked, loss_note = chunked_loss.resolve(t.chunked_loss, model, t.loss_chunk_tokens)
        log.info("%s", loss_note)
    token_types = cfg.task == "classification" and getattr(model.config, "type_vocab_size", 1) > 1
    pad = tokenizer.pad_token_id
    if d.packing:
        train_set = ft.PackedExamples(train_arrays, d.max_length, pad)
        eval_set = ft.PackedExamples(eval_arrays, d.max_length, pad) if eval_arrays is not None else None
    else:
        train_set = ft.ExampleDataset(train_arrays, cfg.task)
        eval_set = ft.ExampleDataset(eval_arrays, cfg.task) if eval_arrays is not None else None
    collate = ft.Collator(pad, cfg.task, token_types)
    n_params = sum(p.numel() for p in model.parameters())
    hidden = getattr(model.config, "hidden_size", None) or model.config.n_embd
    n_layer = getattr(model.config, "num_hidden_layers", None) or model.config.n_layer
    flops = metrics.FlopCounter(metrics.matmul_parameters(model), n_layer, hidden, causal=causal)
    log.info("model: %s for %s, %.2fM parameters, attention %s%s%s", model.config.model_type, cfg.task,
             n_params / 1e6, impl, ", gradient checkpointing" if cfg.model.gradient_checkpointing else "",
             f", labels {names}" if names else "")
    log.info("data: %d training %s, %s evaluation; %s, max_length %d, tokenizer %s", len(train_set),
             "packed rows" if d.packing else "examples", len(eval_set) if eval_set is not None else "no",
             d.format, d.max_length, getattr(tokenizer, "name", "?"))

    try:
        setup = distributed.build_accelerator(
            cpu=t.cpu, mixed_precision=precision, grad_accum=t.grad_accum, batch_size=t.batch_size,
            grad_clip=t.grad_clip, deepspeed_spec=t.deepspeed, loss_scale_init=t.loss_scale_init,
            loss_scale_window=t.loss_scale_window,
        )
    except config.ConfigError as e:
        _fail(str(e))
    accelerator = setup.accelerator
    rank, world = accelerator.process_index, accelerator.num_processes
    steps = ft.steps_for(cfg, len(train_set), world)
    warmup = cfg.schedule.warmup_steps if cfg.schedule.warmup_steps is not None else \
        int(cfg.schedule.warmup_ratio * steps)
    o = cfg.optimizer
    if setup.deepspeed and "optimizer" in accelerator.state.deepspeed_plugin.deepspeed_config:
        from accelerate.utils import DummyOptim

        optimizer = DummyOptim(optim.param_groups(model, o.weight_decay), lr=o.lr, weight_decay=o.weight_decay)
    else:
        optimizer = optim.build_optimizer(model, o.name, o.lr, o.weight_decay, (o.beta1, o.beta2), o.eps, o.momentum)
    log.info("device: %s x %d process(es), %s; %d steps of %d x %d x %d, %s lr %.1e, warmup %d", accelerator.device,
             world, setup.precision, steps, t.batch_size, t.grad_accum, world, cfg.schedule.name, o.lr, warmup)
    model, optimizer = accelerator.prepare(model, optimizer)

    try:
        data.ShardedBatchSampler(len(train_set), t.batch_size, world, rank)
    except ValueError as e:
        _fail(f"data.train: {e}")
    pin = accelerator.device.type == "cuda"

    def batches(start: int):
        sampler = data.ShardedBatchSampler(len(train_set), t.batch_size, world, rank, seed=t.seed, start=start)
        return data.micro_batches(train_set, sampler, collate_fn=collate, num_workers=d.num_workers, pin_memory=pin)

    evaluate = None
    if eval_set is not None and len(eval_set):
        eval_bs = cfg.eval.batch_size or t.batch_size
        group = eval_bs * world
        n_groups = math.ceil(len(eval_set) / group)
        if cfg.eval.batches:
            n_groups = min(n_groups, cfg.eval.batches)

        @torch.no_grad()
        def evaluate() -> dict[str, float]:
            """Loss (and accuracy) over the eval set; the last group wraps around with zero weight, so that
            every process runs the same number of forwards (ZeRO-3 gathers weights collectively)."""
            model.eval()
            sums = torch.zeros(3, dtype=torch.float64, device=accelerator.device)  # loss sum, weight, correct
            for g in range(n_groups):
                idx = [g * group + rank * eval_bs + j for j in range(eval_bs)]
                weight = torch.tensor([1.0 if i < len(eval_set) else 0.0 for i in idx], device=accelerator.device)
                batch = collate([eval_set[i % len(eval_set)] for i in idx])
                labels = batch.pop("labels").to(accelerator.device)
                batch = {k: v.to(accelerator.device) for k, v in batch.items()}
                if chunked:  # loss and argmax hits chunk by chunk, no [tokens, vocab] logits
                    targets = chunked_loss.shift_labels(labels)
                    targets[weight == 0] = -100
                    loss_sum, count, correct = chunked_loss.causal_lm_eval_sums(
                        model, batch, targets, chunk_tokens=t.loss_chunk_tokens)
                    sums += torch.stack([loss_sum.double(), count.double(), correct.double()])
                    continue
                logits = model(**batch).logits.float()
                if causal:
                    shift_logits, shift_labels = logits[:, :-1], labels[:, 1:]
                    loss = F.cross_entropy(shift_logits.transpose(1, 2), shift_labels, ignore_index=-100,
                                           reduction="none")
                    valid = (shift_labels != -100).float() * weight[:, None]
                    sums[0] += (loss * valid).sum()
                    sums[1] += valid.sum()
                    sums[2] += ((shift_logits.argmax(-1) == shift_labels).float() * valid).sum()
                else:
                    loss = F.cross_entropy(logits, labels, reduction="none")
                    sums[0] += (loss * weight).sum()
                    sums[1] += weight.sum()
                    sums[2] += ((logits.argmax(-1) == labels).float() * weight).sum()
            model.train()
            total = accelerator.reduce(sums, "sum").tolist()
            if total[1] == 0:  # nothing to score (no target token): no loss rather than 0
                return {"loss": None, **({"perplexity": None, "token_accuracy": None} if causal else
                                         {"accuracy": None})}
            mean = total[0] / total[1]
            if causal:
                accuracy = total[2] / max(total[1], 1e-9)
                return {"loss": mean, "perplexity": math.exp(min(mean, 50.0)), "token_accuracy": accuracy}
            return {"loss": mean, "accuracy": total[2] / max(total[1], 1e-9)}

    loop = LoopConfig(
        steps=steps, grad_accum=t.grad_accum, lr=o.lr, warmup_steps=warmup, min_lr_ratio=cfg.schedule.min_lr_ratio,
        schedule=cfg.schedule.name, grad_clip=t.grad_clip, log_interval=cfg.logging.log_interval,
        eval_interval=cfg.eval.interval, checkpoint_interval=cfg.checkpoint.interval,
        keep_checkpoints=cfg.checkpoint.keep, resume=cfg.checkpoint.resume, time_limit_min=t.time_limit_min,
        out_dir=cfg.logging.out_dir, progress=cfg.logging.progress, tensorboard=cfg.logging.tensorboard,
        peak_tflops=cfg.logging.peak_tflops,
        max_consecutive_skips=t.max_consecutive_skips, allow_missing_rng=cfg.checkpoint.resume_without_rng,
    )
    hf_tokenizer = data.saveable_tokenizer(tokenizer)  # AutoTokenizer.from_pretrained(model) loads it
    run_info = {"task": cfg.task, "batch_size": t.batch_size, "grad_accum": t.grad_accum, "seed": t.seed,
                "train": d.train, "max_length": d.max_length}
    loss_fn = (lambda engine, batch: chunked_loss.causal_lm_loss(engine, batch, chunk_tokens=t.loss_chunk_tokens)) \
        if chunked else None
    trainer = Trainer(setup, model, optimizer, loop, batches=batches, flops=flops, evaluate=evaluate,
                      run_info=run_info, tokenizer=hf_tokenizer, loss_fn=loss_fn)
    result = run_or_fail(trainer, _fail)
    previous = finished_earlier(result, out_dir, accelerator, log, "--checkpoint.resume")
    if previous is not None:
        return previous

    summary = {**result, "task": cfg.task, "attention": impl, "parameters": n_params, "precision": setup.precision,
               "zero_stage": setup.zero_stage, "processes": world, "labels": names or None,
               "model": str(out_dir / "final") if cfg.checkpoint.save_final and result["completed"] else None}
    save_final_and_summary(accelerator, model, out_dir, summary, "model", cfg, hf_tokenizer)
    evals = " | ".join(f"eval {k.removeprefix('eval_')} {'n/a' if v is None else f'{v:.4f}'}"
                       for k, v in summary.items() if k.startswith("eval_"))
    log.info("done: %d steps, %s tokens in %.1f s (%s tok/s) | train loss %.4f%s | attention %s%s | model %s | %s",
             summary["steps"], f"{summary['tokens']:,}", summary["seconds"], f"{summary['tokens_per_second']:,.0f}",
             summary["train_loss"], f" | {evals}" if evals else "", impl,
             f" | stopped early: {summary['stopped']}" if summary.get("stopped") else "", summary["model"],
             logs.run_files(out_dir))
    accelerator.end_training()
    return summary


if __name__ == "__main__":
    main()

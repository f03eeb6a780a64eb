"""Train a GPT (GPT-2 or Llama-style) on long sequences, attention through volta_train.

    volta-train train                                # GPU: GPT-2 small, 4096 tokens, fp16; CPU: a tiny model
    volta-train train --config v100_gpt2_small_4k --steps 200   # a shipped config by name, or a YAML path
    accelerate launch -m volta_train.recipes.gpt_long --config ...  # several processes (installed package)
    accelerate launch recipes/gpt_long.py            # the same from a checkout
    python recipes/gpt_long.py --config configs/gpt_long/v100_gpt2_small_4k.yaml --steps 200
    accelerate launch --config_file configs/accelerate/zero2.yaml recipes/gpt_long.py --config ...   # ZeRO-2
    python recipes/gpt_long.py --arch llama --n-kv-head 1    # Llama-style (RoPE, RMSNorm, SwiGLU, GQA)
    python recipes/gpt_long.py --no-patch            # stock PyTorch SDPA attention, to compare
    accelerate launch --num_processes 4 recipes/gpt_long.py --config configs/gpt_long/v100_gpt2_medium_sp4_zero3.yaml
                                                     # DeepSpeed-Ulysses: 4 GPUs share each sequence

Every option is a flag and a YAML key (see --help); flags override --config. The sections memory, parallel and
precision are the same as finetune's (volta_train/training/memory.py, parallel.py, precision.py). Options left
"auto" are chosen for the device the run lands on (volta_train/training/gpt.py: AUTO).
Runs resume from out_dir's last checkpoint by default (--resume never to start over).
The corpus is generated or read locally, tokenised once and cached; nothing is downloaded.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from pathlib import Path

# OpenMP threads that spin while they wait take the core their partner needs whenever anything else runs, which
# halves a CPU run's speed on a small, busy machine. Set before torch loads OpenMP; your own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import transformers  # noqa: E402
from accelerate.utils import set_seed  # noqa: E402

from .. import resources  # noqa: E402
from ..training import (  # noqa: E402
    activation_offload, attention_choice, config, data, distributed, gpt, logs, memory, metrics, optim, parallel,
    precision, sequence_parallel, steps,
)
from ..training.finetune_config import FinetuneConfig  # noqa: E402
from ..training.trainer import (  # noqa: E402
    LoopConfig, Trainer, end_training, exit_status, finished_earlier, resume_option_problem, run_or_fail,
    save_final_and_summary, starting_run, trajectory_settings,
)

log = logging.getLogger("gpt_long")
_prog = ["gpt_long.py"]  # the command name error messages start with (volta-train train sets its own)

# Options that do not change what is trained (where files go, logging, scheduling of checkpoints and evaluation,
# threads); every other option is recorded with each checkpoint and compared on resume.
NOT_TRAJECTORY = {
    "out_dir", "cache_dir", "num_workers", "log_interval", "eval_interval", "eval_batches", "checkpoint_interval",
    "keep_checkpoints", "resume", "resume_without_rng", "time_limit_min", "cpu", "cpu_threads", "progress",
    "tensorboard", "peak_tflops", "save", "precision.max_consecutive_skips", "memory.gradient_checkpointing",
    "parallel.deepspeed", "parallel.zero_offload",
}
# Options whose change makes the checkpoint's weights meaningless for this run: resuming with another is refused.
FIXED = ("--arch", "--model", "--n-layer", "--n-head", "--n-embd", "--n-kv-head", "--intermediate-size",
         "--model-config", "--tokenizer")


def _fail(message: str):
    sys.exit(f"{_prog[0]}: error: {message}")


def main(argv=None, prog: str = "gpt_long.py") -> dict:
    """Run the recipe: parse, build, train, save; returns summary.json's contents. A run that stopped before its
    planned steps with a checkpoint (SIGTERM, a time limit) exits with trainer.STOPPED_EXIT once that is written."""
    _prog[0] = prog
    # ---- parse: the options, what "auto" becomes here, and every refusal before out_dir is touched
    try:
        argv = resources.resolve_config_option(sys.argv[1:] if argv is None else list(argv), "gpt_long")
    except FileNotFoundError as e:
        config.usage_error(_prog[0], str(e))
    cfg = config.parse_config(gpt.GPTTrainConfig, argv, description=__doc__, other=FinetuneConfig)
    allocator_note = distributed.cuda_allocator_env()  # before anything initialises CUDA
    try:
        logs.check_tensorboard(cfg.tensorboard)
    except ImportError as e:
        _fail(str(e))
    try:
        state = distributed.init_state(cfg.cpu, cfg.parallel.deepspeed)
        cfg = gpt.resolve(cfg, state.device.type, state.num_processes)
        precision.check_device(cfg.precision, state.device)
        gpt.check_sequence_parallel(cfg, state.num_processes)
    except config.ConfigError as e:
        config.usage_error(_prog[0], str(e))
    resume_problem = resume_option_problem(cfg.resume, "--resume")
    if resume_problem:
        config.usage_error(_prog[0], resume_problem)
    out_dir = Path(cfg.out_dir)

    with starting_run(out_dir, state, _fail) as run:  # a failure before run.begin() leaves no file in out_dir
        if state.device.type == "cuda":
            log.info("%s", allocator_note)
        transformers.utils.logging.disable_progress_bar()  # no "Writing model shards" bars between log lines
        if cfg.cpu_threads:
            torch.set_num_threads(cfg.cpu_threads)
        set_seed(cfg.seed)
        logs.log_config(log, config.to_dict(cfg), out_dir, state.is_main_process, write=False)

        # ---- build: data, the model (partitioned under ZeRO-3) with its attention and memory features, the
        # Accelerator and the per-step functions
        tokenizer, train_tokens, val_tokens = _load_data(cfg, state)
        p, prec = cfg.parallel, cfg.precision
        try:
            zero3 = parallel.zero3_config(p, mixed_precision=prec.mixed_precision, grad_accum=cfg.grad_accum,
                                          batch_size=cfg.batch_size, grad_clip=cfg.grad_clip)
        except config.ConfigError as e:
            _fail(str(e))
        with parallel.partitioned_build(zero3):  # ZeRO-3: no process ever holds the whole model
            model = _build_model(cfg, state, tokenizer)
        shape = gpt.describe(model)
        impl = model.config._attn_implementation
        documents, packing_note = resolve_packing(cfg, model)
        n_params = sum(distributed.param_numel(w) for w in model.parameters())
        flops = metrics.FlopCounter(metrics.matmul_parameters(model), shape["n_layer"],
                                    shape["n_head"] * shape["head_dim"])
        log.info("model: %s (n_layer %d, n_head %d, n_kv_head %d, hidden %d), %.2fM parameters, seq_len %d, "
                 "attention %s%s", shape["model_type"], shape["n_layer"], shape["n_head"], shape["n_kv_head"],
                 shape["hidden"], n_params / 1e6, cfg.seq_len, impl,
                 ", gradient checkpointing" if cfg.memory.gradient_checkpointing else "")
        log.info("data: %s tokens for training, %s for validation; %s", f"{train_tokens.size:,}",
                 f"{val_tokens.size:,}", packing_note)
        chunked = memory.loss_mode(cfg.memory, model)
        eos = tokenizer.eos_token_id
        train_set = data.PackedDataset(train_tokens, cfg.seq_len, documents=documents, eos_token_id=eos)
        val_set = data.PackedDataset(val_tokens, cfg.seq_len, documents=documents, eos_token_id=eos)

        try:
            par = parallel.accelerator(p, model, cpu=cfg.cpu, mixed_precision=prec.mixed_precision,
                                       grad_accum=cfg.grad_accum, batch_size=cfg.batch_size, grad_clip=cfg.grad_clip,
                                       loss_scale_init=prec.loss_scale_init,
                                       loss_scale_window=prec.loss_scale_window)
        except config.ConfigError as e:
            _fail(str(e))
        setup, accelerator = par.setup, par.setup.accelerator
        log.info("device: %s x %d process(es), %s, %d torch threads", accelerator.device, accelerator.num_processes,
                 setup.precision, torch.get_num_threads())
        optimizer = optim.for_setup(setup, model, "adamw", cfg.lr, cfg.weight_decay, (cfg.beta1, cfg.beta2))
        model, optimizer = parallel.prepare(par, model, optimizer, cfg.seq_len)
        try:
            batches = steps.MicroBatches(train_set, cfg.batch_size, par, cfg.seed, flops, num_workers=cfg.num_workers)
        except ValueError as e:
            _fail(f"{e}: give more data or a shorter seq_len")
        loss_fn = steps.loss_function(par, impl, chunked, cfg.memory.loss_chunk_tokens)
        val_batches = data.eval_indices(len(val_set), cfg.batch_size, cfg.eval_batches, par.replicas, par.replica)
        evaluate = _Evaluation(model, accelerator, val_set, val_batches, par.layout, loss_fn)

        tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum * par.replicas
        log.info("training: %d steps x %s tokens (batch %d x accum %d x %d replica(s) x seq %d), lr %.1e, warmup %d, "
                 "%d sequences per epoch", cfg.steps, f"{tokens_per_step:,}", cfg.batch_size, cfg.grad_accum,
                 par.replicas, cfg.seq_len, cfg.lr, cfg.warmup_steps,
                 batches.batches_per_epoch * cfg.batch_size * par.replicas)
        # what "auto" options resolved to (the options themselves are the settings)
        run_info = {"packing": "documents" if documents else "stream", "chunked_loss": chunked}
        saved_tokenizer = data.saveable_tokenizer(tokenizer)  # AutoTokenizer.from_pretrained(checkpoint) loads it
        settings = trajectory_settings(config.to_dict(cfg), NOT_TRAJECTORY, lambda name: "--" + name.replace("_", "-"))
        trainer = Trainer(setup, model, optimizer, _loop_config(cfg), batches=batches, flops=batches.count,
                          evaluate=evaluate if val_batches else None, run_info=run_info, tokenizer=saved_tokenizer,
                          loss_fn=loss_fn, settings=settings, fixed_settings=FIXED,
                          renamed_settings=config.renamed_flags(gpt.GPTTrainConfig))
        run.begin(config.to_dict(cfg))  # train.log and config.yaml: the run's files from here on

        # ---- train
        result = run_or_fail(trainer, _fail)
        summary = finished_earlier(trainer, result, log, final_expected=cfg.save)
        if summary is None:
            # ---- save: the final model and summary.json
            val_loss = result.pop("eval_loss", None)  # None (null in summary.json): no validation ran
            summary = {
                **result, "val_loss": val_loss, "attention": impl, "parameters": n_params,
                "packing": "documents" if documents else "stream", "precision": setup.precision,
                "zero_stage": setup.zero_stage, "processes": accelerator.num_processes,
                "sequence_parallel_size": p.sequence_parallel_size, "data_parallel_size": par.replicas,
                "chunked_loss": chunked,
                "checkpoint": str(out_dir / "final") if cfg.save and result["completed"] else None,
            }
            offloaded = activation_offload.report(accelerator.unwrap_model(model))
            if offloaded is not None:
                summary["activation_offload"] = offloaded
            save_final_and_summary(accelerator, model, out_dir, summary, "checkpoint", cfg, saved_tokenizer, _fail)
            _log_done(summary, val_loss, impl, out_dir)
            end_training(accelerator)
    if exit_status(summary):
        raise SystemExit(exit_status(summary))
    return summary


def _load_data(cfg, state):
    """Text -> cached token stream -> (tokenizer, training tokens, validation tokens)."""
    try:
        tokenizer = data.load_tokenizer(gpt.default_tokenizer(cfg))
        with state.local_main_process_first():
            tokens = data.load_tokens(cfg.data, cfg.cache_dir, tokenizer, synthetic_bytes=int(cfg.synthetic_mb * 1e6))
        train_tokens, val_tokens = data.split_tokens(tokens, cfg.val_fraction, cfg.seq_len)
    except (OSError, ValueError) as e:
        _fail(str(e))
    return tokenizer, train_tokens, val_tokens


def _build_model(cfg, state, tokenizer):
    """The model, its attention (volta_train's, or stock SDPA with --no-patch), its heads checked against the
    sequence-parallel degree, then the memory features."""
    sp = cfg.parallel.sequence_parallel_size
    try:
        model = gpt.build_model(cfg, tokenizer)
        if cfg.patch:
            attention_choice.apply_patch(model)
        heads, kv_heads = sequence_parallel.heads_of(model.config)
        names = ("n_head", "n_kv_head") if not (cfg.model_path or cfg.model_config) else (
            "the model config's num_attention_heads", "num_key_value_heads")
        parallel.check_heads(cfg.parallel, heads, kv_heads, state.num_processes, heads_name=names[0],
                             kv_name=names[1])
        if sp > 1 and cfg.attn_pdrop > 0:
            log.warning("attn_pdrop %g with sequence_parallel_size %d: each process draws dropout masks for its own "
                        "heads from the same generator state, so heads on different processes share mask patterns",
                        cfg.attn_pdrop, sp)
        memory.apply(model, cfg.memory, memory.tokens_per_process(cfg.batch_size, cfg.seq_len, sp))
    except (config.ConfigError, attention_choice.AttentionSetupError, OSError, ValueError) as e:
        _fail(str(e))
    return model


def resolve_packing(cfg, model) -> tuple[bool, str]:
    """(documents?, why) for cfg.packing given what the model's attention does with packed rows."""
    if cfg.packing == "stream":
        return False, "packing stream: documents attend across EOS (GPT-2 style)"
    ok, why = attention_choice.packed_documents_kept_apart(model, cfg.parallel.sequence_parallel_size > 1)
    impl = model.config._attn_implementation
    if ok:
        return True, f"packing documents: position ids restart at each document; {impl} keeps documents apart"
    if cfg.packing == "documents":
        _fail(f"packing documents: attention {impl!r} does not keep packed documents apart ({why}); use "
              "--packing stream, or --no-patch")
    log.warning("packing auto -> stream: attention %r does not keep packed documents apart (%s), so documents "
                "attend across each other; --packing documents refuses to run instead", impl, why)
    return False, f"packing stream (auto: {impl} cannot separate packed documents)"


class _Evaluation:
    """The trainer's ``evaluate``: the mean loss of the fixed validation micro-batches, each process its own (its
    shard of them under sequence parallelism), averaged over the processes."""

    def __init__(self, model, accelerator, val_set, val_batches: list[list[int]], layout, loss_fn):
        self.model, self.accelerator, self.val_set, self.val_batches = model, accelerator, val_set, val_batches
        self.layout, self.loss_fn = layout, loss_fn

    @torch.no_grad()
    def __call__(self) -> dict[str, float]:
        model, layout = self.model, self.layout
        model.eval()
        losses = []
        for idx in self.val_batches:
            batch = torch.utils.data.default_collate([self.val_set[i] for i in idx])
            if layout.enabled:
                batch = sequence_parallel.shard_batch(batch, layout.sp, layout.sp_rank)
            batch = {k: v.to(self.accelerator.device) for k, v in batch.items()}
            losses.append(self.loss_fn(model, batch).float())
        model.train()
        return {"loss": self.accelerator.reduce(torch.stack(losses).mean(), "mean").item()}


def _loop_config(cfg) -> LoopConfig:
    return LoopConfig(
        steps=cfg.steps, grad_accum=cfg.grad_accum, lr=cfg.lr, warmup_steps=cfg.warmup_steps,
        min_lr_ratio=cfg.min_lr_ratio, grad_clip=cfg.grad_clip, log_interval=cfg.log_interval,
        eval_interval=cfg.eval_interval, checkpoint_interval=cfg.checkpoint_interval,
        keep_checkpoints=cfg.keep_checkpoints, resume=cfg.resume, time_limit_min=cfg.time_limit_min,
        out_dir=cfg.out_dir, progress=cfg.progress, tensorboard=cfg.tensorboard, peak_tflops=cfg.peak_tflops,
        max_consecutive_skips=cfg.precision.max_consecutive_skips, allow_missing_rng=cfg.resume_without_rng,
        steps_flag="--steps", resume_flag="--resume", final_model=cfg.save,
    )


def _log_done(summary: dict, val_loss: float | None, impl: str, out_dir: Path) -> None:
    mem = summary.get("peak_memory_bytes", math.nan)
    log.info(
        "done: %d steps, %s tokens in %.1f s (%s tok/s) | train loss %.4f | val loss %s | peak mem %s (%s)%s"
        " | attention %s%s | checkpoint %s | %s",
        summary["steps"], f"{summary['tokens']:,}", summary["seconds"], f"{summary['tokens_per_second']:,.0f}",
        summary["train_loss"], "n/a" if val_loss is None else f"{val_loss:.4f}", metrics.format_bytes(mem),
        summary.get("peak_memory_kind", ""),
        f" | {summary['skipped_steps']} fp16 steps skipped" if summary["skipped_steps"] else "",
        impl, f" | stopped early: {summary['stopped']}" if summary.get("stopped") else "", summary["checkpoint"],
        logs.run_files(out_dir),
    )


if __name__ == "__main__":
    main()

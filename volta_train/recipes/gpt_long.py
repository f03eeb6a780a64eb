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

Every option is a flag and a YAML key (see --help); flags override --config. Options left
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
    activation_offload, attention_choice, chunked_loss, config, data, distributed, gpt, logs, metrics, optim, runlock,
    sequence_parallel,
)
from ..training.trainer import (  # noqa: E402
    LoopConfig, Trainer, end_training, finished_earlier, resume_option_problem, run_or_fail, run_recipe,
    save_final_and_summary, trajectory_settings,
)

log = logging.getLogger("gpt_long")
_prog = ["gpt_long.py"]  # the command name error messages start with (volta-train train sets its own)

# Options that do not change what is trained (where files go, logging, scheduling of checkpoints and evaluation,
# threads); every other option is recorded with each checkpoint and compared on resume.
NOT_TRAJECTORY = {
    "out_dir", "cache_dir", "num_workers", "log_interval", "eval_interval", "eval_batches", "checkpoint_interval",
    "keep_checkpoints", "resume", "resume_without_rng", "time_limit_min", "cpu", "cpu_threads", "progress",
    "tensorboard", "peak_tflops", "save", "max_consecutive_skips", "gradient_checkpointing", "deepspeed",
}
# Options whose change makes the checkpoint's weights meaningless for this run: resuming with another is refused.
FIXED = ("--arch", "--model", "--n-layer", "--n-head", "--n-embd", "--n-kv-head", "--intermediate-size",
         "--model-config", "--tokenizer")


def _fail(message: str):
    sys.exit(f"{_prog[0]}: error: {message}")


def make_optimizer(setup, model, cfg):
    """AdamW with weight-decay groups; a DeepSpeed JSON with its own "optimizer" gets accelerate's placeholder."""
    betas = (cfg.beta1, cfg.beta2)
    if setup.deepspeed and "optimizer" in setup.accelerator.state.deepspeed_plugin.deepspeed_config:
        from accelerate.utils import DummyOptim

        return DummyOptim(optim.param_groups(model, cfg.weight_decay), lr=cfg.lr, weight_decay=cfg.weight_decay)
    return optim.build_adamw(model, cfg.lr, cfg.weight_decay, betas)


def attention_module(model):
    """The first attention module of a causal LM (what transformers passes to the attention function)."""
    for module in model.modules():
        if module is not model and hasattr(module, "is_causal") and hasattr(module, "config") \
                and "attention" in type(module).__name__.lower():
            return module
    raise ValueError(f"{type(model).__name__} has no attention module with is_causal and config")


def resolve_packing(cfg, model) -> tuple[bool, str]:
    """(documents?, why) for cfg.packing given what the model's attention does with packed rows."""
    if cfg.packing == "stream":
        return False, "packing stream: documents attend across EOS (GPT-2 style)"
    ok, why = attention_choice.packed_documents_supported(model)
    impl = model.config._attn_implementation
    if ok and cfg.sequence_parallel_size > 1:
        # under Ulysses the core attention gets no mask and the whole sequence's position ids: check that route
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        ok, why = sequence_parallel.keeps_documents_apart(ALL_ATTENTION_FUNCTIONS[impl], attention_module(model))
        if not ok:
            why = f"under sequence parallelism: {why}"
    if ok:
        return True, f"packing documents: position ids restart at each document; {impl} keeps documents apart"
    if cfg.packing == "documents":
        _fail(f"packing documents: attention {impl!r} does not keep packed documents apart ({why}); use "
              "--packing stream, or --no-patch")
    log.warning("packing auto -> stream: attention %r does not keep packed documents apart (%s), so documents "
                "attend across each other; --packing documents refuses to run instead", impl, why)
    return False, f"packing stream (auto: {impl} cannot separate packed documents)"


def main(argv=None, prog: str = "gpt_long.py") -> dict:
    """Run the recipe; returns summary.json's contents (:func:`~volta_train.training.trainer.run_recipe`)."""
    _prog[0] = prog
    return run_recipe(argv, _start, _prepare, _train, lambda cfg: cfg.out_dir, _fail)


def _prepare(cfg, state):
    """Everything before the first step: data, model, accelerator, trainer (a failure here leaves no files)."""
    tokenizer, train_tokens, val_tokens = _load_data(cfg, state)
    try:
        zero3 = distributed.zero3_init_config(mixed_precision=cfg.mixed_precision, grad_accum=cfg.grad_accum,
                                              batch_size=cfg.batch_size, grad_clip=cfg.grad_clip,
                                              deepspeed_spec=cfg.deepspeed)
    except config.ConfigError as e:
        _fail(str(e))
    with distributed.partitioned_build(zero3):  # ZeRO-3: no process ever holds the whole model
        model = _build_model(cfg, state, tokenizer)
    shape = gpt.describe(model)
    impl = model.config._attn_implementation
    documents, packing_note = resolve_packing(cfg, model)
    n_params = sum(distributed.param_numel(p) for p in model.parameters())
    flops = metrics.FlopCounter(metrics.matmul_parameters(model), shape["n_layer"], shape["n_head"] * shape["head_dim"])
    log.info(
        "model: %s (n_layer %d, n_head %d, n_kv_head %d, hidden %d), %.2fM parameters, seq_len %d, attention %s%s",
        shape["model_type"], shape["n_layer"], shape["n_head"], shape["n_kv_head"], shape["hidden"], n_params / 1e6,
        cfg.seq_len, impl, ", gradient checkpointing" if cfg.gradient_checkpointing else "",
    )
    log.info("data: %s tokens for training, %s for validation; %s", f"{train_tokens.size:,}", f"{val_tokens.size:,}",
             packing_note)
    chunked, loss_note = chunked_loss.resolve(cfg.chunked_loss, model, cfg.loss_chunk_tokens)
    log.info("%s", loss_note)
    eos = tokenizer.eos_token_id
    train_set = data.PackedDataset(train_tokens, cfg.seq_len, documents=documents, eos_token_id=eos)
    val_set = data.PackedDataset(val_tokens, cfg.seq_len, documents=documents, eos_token_id=eos)

    setup, grad_factor = _accelerator(cfg, state, model)
    accelerator = setup.accelerator
    log.info("device: %s x %d process(es), %s, %d torch threads", accelerator.device, accelerator.num_processes,
             setup.precision, torch.get_num_threads())
    optimizer = make_optimizer(setup, model, cfg)
    with sequence_parallel.kv_heads_alias(model.config):  # DeepSpeed reads num_key_value_heads, which GPT-2 lacks
        model, optimizer = accelerator.prepare(model, optimizer)
    step = _StepFunctions(cfg, model, accelerator, train_set, val_set, flops, impl, grad_factor, chunked)

    replicas = step.layout.dp
    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum * replicas
    log.info(
        "training: %d steps x %s tokens (batch %d x accum %d x %d replica(s) x seq %d), lr %.1e, warmup %d, "
        "%d sequences per epoch",
        cfg.steps, f"{tokens_per_step:,}", cfg.batch_size, cfg.grad_accum, replicas, cfg.seq_len, cfg.lr,
        cfg.warmup_steps, step.batches_per_epoch * cfg.batch_size * replicas,
    )
    # what "auto" options resolved to (the options themselves are the settings)
    run_info = {"packing": "documents" if documents else "stream", "chunked_loss": chunked}
    saved_tokenizer = data.saveable_tokenizer(tokenizer)  # AutoTokenizer.from_pretrained(checkpoint) loads it
    settings = trajectory_settings(config.to_dict(cfg), NOT_TRAJECTORY, lambda name: "--" + name.replace("_", "-"))
    trainer = Trainer(setup, model, optimizer, _loop_config(cfg), batches=step.batches, flops=step.count,
                      evaluate=step.evaluate if step.val_batches else None, run_info=run_info,
                      tokenizer=saved_tokenizer, loss_fn=step.loss, settings=settings, fixed_settings=FIXED)
    return trainer, (model, impl, n_params, documents, chunked, setup, replicas, saved_tokenizer)


def _train(cfg, trainer, model, impl, n_params, documents, chunked, setup, replicas, saved_tokenizer) -> dict:
    out_dir, accelerator = Path(cfg.out_dir), setup.accelerator
    result = run_or_fail(trainer, _fail)
    previous = finished_earlier(trainer, result, log, final_expected=cfg.save)
    if previous is not None:
        return previous

    val_loss = result.pop("eval_loss", None)  # None (null in summary.json): no validation ran
    summary = {
        **result, "val_loss": val_loss, "attention": impl, "parameters": n_params,
        "packing": "documents" if documents else "stream", "precision": setup.precision,
        "zero_stage": setup.zero_stage, "processes": accelerator.num_processes,
        "sequence_parallel_size": cfg.sequence_parallel_size, "data_parallel_size": replicas, "chunked_loss": chunked,
        "checkpoint": str(out_dir / "final") if cfg.save and result["completed"] else None,
    }
    offloaded = activation_offload.report(accelerator.unwrap_model(model))
    if offloaded is not None:
        summary["activation_offload"] = offloaded
    save_final_and_summary(accelerator, model, out_dir, summary, "checkpoint", cfg, saved_tokenizer, _fail)
    _log_done(summary, val_loss, impl, out_dir)
    end_training(accelerator)
    return summary


def _start(argv, held: list):
    """The resolved config and the process state; out_dir locked for this run, logging and seeds set up."""
    try:
        argv = resources.resolve_config_option(sys.argv[1:] if argv is None else list(argv), "gpt_long")
    except FileNotFoundError as e:
        config.usage_error(_prog[0], str(e))
    cfg = config.parse_config(gpt.GPTTrainConfig, argv, description=__doc__)
    allocator_note = distributed.cuda_allocator_env()  # before anything initialises CUDA
    try:
        logs.check_tensorboard(cfg.tensorboard)
    except ImportError as e:
        _fail(str(e))
    try:
        state = distributed.init_state(cfg.cpu, cfg.deepspeed)
        cfg = gpt.resolve(cfg, state.device.type, state.num_processes)
        distributed.check_mixed_precision(cfg.mixed_precision, state.device, "mixed_precision")
        gpt.check_sequence_parallel(cfg, state.num_processes)
    except config.ConfigError as e:
        config.usage_error(_prog[0], str(e))
    resume_problem = resume_option_problem(cfg.resume, "--resume")
    if resume_problem:
        config.usage_error(_prog[0], resume_problem)
    out_dir = Path(cfg.out_dir)
    try:  # before anything is written there: one run per out_dir
        held.append(runlock.acquire_for_run(out_dir, state.is_main_process, state.num_processes, state.device))
    except runlock.RunLockError as e:
        _fail(str(e))
    logs.setup_logging(state.is_main_process, out_dir / "train.log", deferred=True)  # written once the run begins
    if state.device.type == "cuda":
        log.info("%s", allocator_note)
    transformers.utils.logging.disable_progress_bar()  # no "Writing model shards" bars between log lines
    if cfg.cpu_threads:
        torch.set_num_threads(cfg.cpu_threads)
    set_seed(cfg.seed)
    logs.log_config(log, config.to_dict(cfg), out_dir, state.is_main_process, write=False)
    return cfg, state


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
    """The model, then its attention: volta_train's (patch) or stock SDPA; its heads checked against the processes."""
    sp = cfg.sequence_parallel_size
    try:
        model = gpt.build_model(cfg, tokenizer)
        if cfg.patch:
            attention_choice.apply_patch(model)
        heads, kv_heads = sequence_parallel.heads_of(model.config)
        names = ("n_head", "n_kv_head") if not (cfg.model_path or cfg.model_config) else (
            "the model config's num_attention_heads", "num_key_value_heads")
        sequence_parallel.check_degree(sp, heads, kv_heads, state.num_processes, heads_name=names[0], kv_name=names[1])
        if sp > 1 and cfg.attn_pdrop > 0:
            log.warning("attn_pdrop %g with sequence_parallel_size %d: each process draws dropout masks for its own "
                        "heads from the same generator state, so heads on different processes share mask patterns",
                        cfg.attn_pdrop, sp)
    except (config.ConfigError, attention_choice.AttentionSetupError, OSError, ValueError) as e:
        _fail(str(e))
    return model


def _accelerator(cfg, state, model):
    """(accelerate setup, gradient factor of sequence parallelism under ZeRO-3)."""
    sp = cfg.sequence_parallel_size
    try:
        parallelism = sequence_parallel.parallelism_config(sp, state.num_processes, model) if sp > 1 else None
        setup = distributed.build_accelerator(
            cpu=cfg.cpu, mixed_precision=cfg.mixed_precision, grad_accum=cfg.grad_accum, batch_size=cfg.batch_size,
            grad_clip=cfg.grad_clip, deepspeed_spec=cfg.deepspeed, loss_scale_init=cfg.loss_scale_init,
            loss_scale_window=cfg.loss_scale_window, parallelism_config=parallelism,
        )
        grad_factor = sequence_parallel.gradient_factor(setup.accelerator.state.deepspeed_plugin.deepspeed_config, sp) \
            if sp > 1 else 1.0
    except (config.ConfigError, sequence_parallel.SequenceParallelError) as e:
        _fail(str(e))
    return setup, grad_factor


class _StepFunctions:
    """What the trainer calls per step: the batches from a micro-batch index on, their token and FLOP counts, the
    loss of a micro-batch and the evaluation; under sequence parallelism each process sees its shard of a sequence."""

    def __init__(self, cfg, model, accelerator, train_set, val_set, flops, impl: str, grad_factor: float,
                 chunked: bool):
        self.cfg, self.model, self.accelerator = cfg, model, accelerator
        self.train_set, self.val_set, self.flops, self.impl = train_set, val_set, flops, impl
        self.grad_factor, self.chunked = grad_factor, chunked
        rank, world = accelerator.process_index, accelerator.num_processes
        self.layout = layout = sequence_parallel.layout(rank, world, cfg.sequence_parallel_size)
        self.uattn = None
        if layout.enabled:
            self.uattn = sequence_parallel.install(impl)
            log.info("%s%s", sequence_parallel.describe(layout, cfg.seq_len),
                     f"; gradients x{grad_factor:g} for ZeRO-3's reduce-scatter" if grad_factor != 1 else "")
        # processes of a sequence-parallel group read the same batches
        self.replicas, self.replica = layout.dp, layout.dp_rank
        try:
            probe = data.ShardedBatchSampler(len(train_set), cfg.batch_size, self.replicas, self.replica, seed=cfg.seed)
        except ValueError as e:
            _fail(f"{e}: give more data or a shorter seq_len")
        self.batches_per_epoch = probe.batches_per_epoch
        self.pin = accelerator.device.type == "cuda"
        self.shards: list[sequence_parallel.ShardedBatches] = []
        self.val_batches = data.eval_indices(len(val_set), cfg.batch_size, cfg.eval_batches, self.replicas,
                                             self.replica)

    def batches(self, start: int):
        cfg = self.cfg
        sampler = data.ShardedBatchSampler(len(self.train_set), cfg.batch_size, self.replicas, self.replica,
                                           seed=cfg.seed, start=start)
        loader = data.micro_batches(self.train_set, sampler, num_workers=cfg.num_workers, pin_memory=self.pin)
        if not self.layout.enabled:
            return loader
        self.shards[:] = [sequence_parallel.ShardedBatches(loader, self.layout, self.flops)]
        return self.shards[0]

    def count(self, batch: dict) -> tuple[int, float]:
        return self.shards[0].counts(batch) if self.layout.enabled else self.flops(batch)

    def loss(self, engine, batch: dict) -> torch.Tensor:
        """Mean token loss of a micro-batch (of this process's shard of it under sequence parallelism)."""
        cfg = self.cfg
        if self.layout.enabled:
            sequence_parallel.ensure_installed(self.impl, self.uattn)
            return sequence_parallel.sharded_loss(engine, batch, self.layout.group, self.grad_factor,
                                                  chunked=self.chunked, chunk_tokens=cfg.loss_chunk_tokens)
        if self.chunked:
            return chunked_loss.causal_lm_loss(engine, batch, chunk_tokens=cfg.loss_chunk_tokens)
        return engine(**batch).loss

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        model, layout = self.model, self.layout
        model.eval()
        losses = []
        for idx in self.val_batches:
            batch = torch.utils.data.default_collate([self.val_set[i] for i in idx])
            if layout.enabled:
                batch = sequence_parallel.shard_batch(batch, layout.sp, layout.sp_rank)
            batch = {k: v.to(self.accelerator.device) for k, v in batch.items()}
            loss = self.loss(model, batch)
            losses.append(loss.float())
        model.train()
        return {"loss": self.accelerator.reduce(torch.stack(losses).mean(), "mean").item()}


def _loop_config(cfg) -> LoopConfig:
    return LoopConfig(
        steps=cfg.steps, grad_accum=cfg.grad_accum, lr=cfg.lr, warmup_steps=cfg.warmup_steps,
        min_lr_ratio=cfg.min_lr_ratio, grad_clip=cfg.grad_clip, log_interval=cfg.log_interval,
        eval_interval=cfg.eval_interval, checkpoint_interval=cfg.checkpoint_interval,
        keep_checkpoints=cfg.keep_checkpoints, resume=cfg.resume, time_limit_min=cfg.time_limit_min,
        out_dir=cfg.out_dir, progress=cfg.progress, tensorboard=cfg.tensorboard, peak_tflops=cfg.peak_tflops,
        max_consecutive_skips=cfg.max_consecutive_skips, allow_missing_rng=cfg.resume_without_rng,
        steps_flag="--steps", resume_flag="--resume", final_model=cfg.save,
    )


def _log_done(summary: dict, val_loss: float | None, impl: str, out_dir: Path) -> None:
    mem = summary.get("peak_memory_bytes", math.nan)
    log.info(
        "done: %d steps, %s tokens in %.1f s (%s tok/s) | train loss %.4f | val loss %s | peak mem %s (%s)%s"
        " | attention %s%s | checkpoint %s | %s",
        summary["steps"], f"{summary['tokens']:,}", summary["seconds"], f"{summary['tokens_per_second']:,.0f}",
        summary["train_loss"], "n/a" if val_loss is None else f"{val_loss:.4f}", metrics.format_bytes(mem), summary.get("peak_memory_kind", ""),
        f" | {summary['skipped_steps']} fp16 steps skipped" if summary["skipped_steps"] else "",
        impl, f" | stopped early: {summary['stopped']}" if summary.get("stopped") else "", summary["checkpoint"],
        logs.run_files(out_dir),
    )


if __name__ == "__main__":
    main()

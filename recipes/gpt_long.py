"""Train a GPT (GPT-2 architecture, random init) on long sequences, attention through volta_train.

    accelerate launch recipes/gpt_long.py            # GPU: GPT-2 small, 4096 tokens, fp16; CPU: a tiny model
    python recipes/gpt_long.py --config configs/gpt_long/v100_gpt2_small_4k.yaml --steps 200
    python recipes/gpt_long.py --no-patch            # stock PyTorch SDPA attention, to compare

Every option is a flag and a YAML key (see --help); flags override --config. Options left
"auto" are chosen for the device the run lands on (volta_train/training/gpt.py: AUTO).
The corpus is generated or read locally, tokenised to bytes once and cached; nothing is downloaded.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from pathlib import Path

# OpenMP threads that spin while they wait take the core their partner needs whenever anything else
# runs: on 2 cores next to one busy process, the CPU run took 0.76 s/step spinning and 0.38 s/step
# passive (idle machine: 0.23 vs 0.28). Set before torch loads OpenMP; your own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import transformers  # noqa: E402
from accelerate import Accelerator, PartialState  # noqa: E402
from accelerate.utils import GradientAccumulationPlugin, set_seed  # noqa: E402
from torch.utils.data import DataLoader, Subset  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import volta_train  # noqa: E402
from volta_train.training import checkpoint, config, data, gpt, logs, metrics, optim  # noqa: E402

log = logging.getLogger("gpt_long")


@torch.no_grad()
def evaluate(model, loader, accelerator) -> float:
    """Mean loss over the (small, fixed) validation loader, averaged over processes."""
    model.eval()
    losses = [model(**batch).loss.float() for batch in loader]
    model.train()
    return accelerator.reduce(torch.stack(losses).mean(), "mean").item()


def main(argv=None) -> dict:
    cfg = config.parse_config(gpt.GPTTrainConfig, argv, description=__doc__)
    state = PartialState(cpu=cfg.cpu)
    try:
        cfg = gpt.resolve(cfg, state.device.type, state.num_processes)
    except config.ConfigError as e:
        sys.exit(f"gpt_long.py: error: {e}")
    accelerator = Accelerator(
        cpu=cfg.cpu,
        mixed_precision=cfg.mixed_precision,
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=cfg.grad_accum, sync_with_dataloader=False),
    )
    out_dir = Path(cfg.out_dir)
    logs.setup_logging(accelerator.is_main_process, out_dir / "train.log")
    transformers.utils.logging.disable_progress_bar()  # no "Writing model shards" bars between log lines
    if cfg.cpu_threads:
        torch.set_num_threads(cfg.cpu_threads)
    if cfg.mixed_precision == "fp16" and accelerator.device.type == "cpu":
        log.warning("mixed_precision fp16 on CPU: accelerate has no fp16 autocast there, the run is fp32 (try bf16)")
    set_seed(cfg.seed)
    log.info("config: %s", json.dumps(config.to_dict(cfg)))
    log.info(
        "device: %s x %d process(es), mixed precision %s, %d torch threads",
        accelerator.device, accelerator.num_processes, accelerator.mixed_precision, torch.get_num_threads(),
    )

    # data: bytes -> cached token stream -> fixed-length sequences
    tokenizer = data.ByteTokenizer()
    try:
        with accelerator.local_main_process_first():
            tokens = data.load_tokens(cfg.data, cfg.cache_dir, tokenizer, synthetic_bytes=int(cfg.synthetic_mb * 1e6))
        train_tokens, val_tokens = data.split_tokens(tokens, cfg.val_fraction, cfg.seq_len)
    except (OSError, ValueError) as e:
        sys.exit(f"gpt_long.py: error: {e}")
    train_set = data.PackedDataset(train_tokens, cfg.seq_len)
    if len(train_set) < cfg.batch_size * accelerator.num_processes:
        sys.exit(f"gpt_long.py: error: {len(train_set)} training sequences: fewer than one batch on every process")
    train_loader = DataLoader(train_set, cfg.batch_size, shuffle=True, drop_last=True,
                              pin_memory=accelerator.device.type == "cuda")
    val_set = data.PackedDataset(val_tokens, cfg.seq_len)
    n_val = min(len(val_set), cfg.eval_batches * cfg.batch_size * accelerator.num_processes)
    val_loader = DataLoader(Subset(val_set, range(n_val)), cfg.batch_size) if n_val else None

    # model: GPT-2 architecture from a config, then volta_train's attention
    model = gpt.build_model(cfg, tokenizer)
    if cfg.patch:
        try:
            patch = volta_train.patch
        except ImportError as e:
            sys.exit(f"gpt_long.py: error: volta_train.patch is unavailable ({e}); run with --no-patch")
        patch(model)
    n_params, attention = sum(p.numel() for p in model.parameters()), model.config._attn_implementation
    log.info(
        "model: GPT-2 %s (n_layer %d, n_head %d, n_embd %d), %.2fM parameters, seq_len %d, attention %s",
        cfg.model, cfg.n_layer, cfg.n_head, cfg.n_embd, n_params / 1e6, cfg.seq_len, attention,
    )
    optimizer = optim.build_adamw(model, cfg.lr, cfg.weight_decay, (cfg.beta1, cfg.beta2))
    model, optimizer, train_loader = accelerator.prepare(model, optimizer, train_loader)
    if val_loader is not None:
        val_loader = accelerator.prepare(val_loader)

    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum * accelerator.num_processes
    log.info(
        "training: %d steps x %s tokens (batch %d x accum %d x %d process(es) x seq %d), lr %.1e, warmup %d",
        cfg.steps, f"{tokens_per_step:,}", cfg.batch_size, cfg.grad_accum, accelerator.num_processes,
        cfg.seq_len, cfg.lr, cfg.warmup_steps,
    )
    batches = data.forever(train_loader)
    meter = metrics.Throughput(accelerator.device)
    bar = logs.progress_bar(cfg.steps, accelerator.is_main_process and cfg.progress)
    loss_sum, n_micro, skipped = torch.zeros((), device=accelerator.device), 0, 0
    train_loss = val_loss = math.nan
    model.train()
    for step in range(cfg.steps):
        lr = optim.lr_at(step, cfg.steps, cfg.lr, cfg.warmup_steps, cfg.min_lr_ratio)
        optim.set_lr(optimizer, lr)
        for _ in range(cfg.grad_accum):
            with accelerator.accumulate(model):  # syncs gradients (DDP) on the last micro-batch only
                loss = model(**next(batches)).loss
                accelerator.backward(loss)  # divides by grad_accum; fp16: scales the loss
            loss_sum += loss.detach().float()
            n_micro += 1
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.grad_clip) if cfg.grad_clip > 0 else None
        optimizer.step()  # fp16: skipped when the gradients overflowed, and the loss scale drops
        optimizer.zero_grad(set_to_none=True)
        skipped += int(accelerator.optimizer_step_was_skipped)
        meter.add(tokens_per_step)
        bar.update()
        done = step + 1
        if done % cfg.log_interval == 0 or done == cfg.steps:
            train_loss = accelerator.reduce(loss_sum, "mean").item() / n_micro
            loss_sum.zero_()
            n_micro = 0
            mem, _ = metrics.peak_memory(accelerator.device)
            extra = "" if accelerator.scaler is None else f" | loss scale {accelerator.scaler.get_scale():.0f}"
            norm = float("nan") if grad_norm is None else float(grad_norm)
            log.info(
                "step %d/%d | loss %.4f | lr %.2e | grad norm %.3f | %s tok/s | peak mem %s%s",
                done, cfg.steps, train_loss, lr, norm, f"{meter.lap():,.0f}", metrics.format_bytes(mem), extra,
            )
            bar.set_postfix(loss=f"{train_loss:.3f}")
        if val_loader is not None and cfg.eval_interval and done % cfg.eval_interval == 0 and done < cfg.steps:
            log.info("eval step %d | val loss %.4f", done, evaluate(model, val_loader, accelerator))
    bar.close()
    seconds = meter.elapsed()
    if val_loader is not None:
        val_loss = evaluate(model, val_loader, accelerator)
        log.info("eval step %d | val loss %.4f", cfg.steps, val_loss)

    mem, mem_kind = metrics.peak_memory(accelerator.device)
    summary = {
        "steps": cfg.steps, "tokens": meter.tokens, "seconds": round(seconds, 2),
        "tokens_per_second": round(meter.tokens / seconds, 1), "train_loss": train_loss, "val_loss": val_loss,
        "skipped_steps": skipped, "peak_memory_bytes": mem, "peak_memory_kind": mem_kind,
        "attention": attention, "parameters": n_params,
        "checkpoint": str(out_dir / "final") if cfg.save else None,
    }
    if cfg.save:
        checkpoint.save_model(accelerator, model, out_dir / "final", cfg, extra=summary)
    if accelerator.is_main_process:
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    log.info(
        "done: %d steps, %s tokens in %.1f s (%s tok/s) | train loss %.4f | val loss %.4f | peak mem %s (%s)%s"
        " | attention %s | checkpoint %s",
        cfg.steps, f"{meter.tokens:,}", seconds, f"{summary['tokens_per_second']:,.0f}", train_loss, val_loss,
        metrics.format_bytes(mem), mem_kind, f" | {skipped} fp16 steps skipped" if skipped else "",
        summary["attention"], summary["checkpoint"],
    )
    accelerator.end_training()
    return summary


if __name__ == "__main__":
    main()

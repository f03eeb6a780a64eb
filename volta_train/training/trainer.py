"""The training loop both recipes share: accumulation, fp16, clipping, logs, evaluation, checkpoints, resume.

The recipe builds the model, optimizer, data and Accelerator (:mod:`.distributed`);
:class:`Trainer` runs the optimizer steps::

    trainer = Trainer(setup, model, optimizer, loop, batches=..., evaluate=..., flops=...)
    summary = trainer.run()

Per optimizer step: the learning rate from the schedule, ``grad_accum`` micro-batches
under ``accelerator.accumulate`` (gradients synchronised on the last one; DeepSpeed
steps inside ``backward`` there), clipping (its norm is logged), the optimizer step
(skipped by the loss scaler when fp16 gradients overflowed, and counted). Every
``log_interval`` steps a log line and a row of ``train.csv``/TensorBoard: loss (mean
over micro-batches and processes), lr, gradient norm, tokens/s (all processes),
peak memory (largest process), loss scale, model TFLOP/s per device and MFU
against the device's peak (V100: 125 TFLOP/s).

Resume: ``loop.resume`` ``"auto"`` continues from the newest complete checkpoint in
``out_dir/checkpoints`` if there is one. The data order is a function of the number of
micro-batches consumed (``batches(start)``), the learning rate one of the step, and the
generator states are restored last, so a resumed run repeats the interrupted run's
trajectory. ``SIGTERM`` (what schedulers send before killing a job) and
``time_limit_min`` stop the run at the next step boundary with a checkpoint.

Non-finite values: every step checks its loss and gradient norm (one small all-reduce, shared
with the stop flag, when several processes run). Without a dynamic loss scaler a non-finite value
stops the run before the optimizer applies it (under DeepSpeed, which steps inside ``backward``,
right after); with one (fp16), the scaler skips such steps, and ``max_consecutive_skips`` of them
in a row stop the run. The weights are also checked before every checkpoint and at the end. A
stop for non-finite values writes ``summary.json`` with ``"completed": false`` and the reason, saves
nothing (no checkpoint, no final model; the last good checkpoint stays) and raises
:class:`TrainingFailed`, which the recipes turn into a non-zero exit.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from . import checkpoint, chunked_loss, config, fsio, logs, metrics, optim, runlock
from .distributed import Setup, loss_scale

logger = logging.getLogger("volta_train.trainer")


class TrainingFailed(RuntimeError):
    """The run stopped on a non-finite loss, gradient or weight; summary.json records it."""


class RunStateError(RuntimeError):
    """out_dir's checkpoints do not fit this run (a checkpoint past the planned steps, a setting that cannot change
    on resume); the message names both values and what to do."""


# The exit status of a run that stopped before its planned steps with a checkpoint (SIGTERM, time_limit_min):
# sysexits' EX_TEMPFAIL, "try again later": rerunning the same command continues it. docs/recipes.md lists them all.
STOPPED_EXIT = 75


@dataclass
class LoopConfig:
    steps: int
    grad_accum: int
    lr: float
    warmup_steps: int
    min_lr_ratio: float = 0.1
    schedule: str = "cosine"
    grad_clip: float = 1.0
    log_interval: int = 10
    eval_interval: int = 0
    checkpoint_interval: int = 0
    keep_checkpoints: int = 2
    resume: str = "auto"
    time_limit_min: float = 0.0
    out_dir: str = "out"
    progress: bool = True
    tensorboard: bool = False  # opt-in: --tensorboard
    peak_tflops: float | None = None
    max_consecutive_skips: int = 32  # fp16: optimizer steps skipped in a row (non-finite gradients) before stopping
    allow_missing_rng: bool = False  # resume from a checkpoint without this process's generator states
    steps_flag: str = "--steps"  # how the recipe's user sets steps and resume, for messages
    resume_flag: str = "--resume"
    final_model: bool = True  # the recipe saves a final model (out_dir/final) at the end of a completed run


class Trainer:
    """Runs :class:`LoopConfig`'s steps on a prepared model and optimizer (see the module doc)."""

    def __init__(
        self,
        setup: Setup,
        model,
        optimizer,
        loop: LoopConfig,
        batches: Callable[[int], Iterator[dict]],
        flops: Callable[[dict], tuple[int, float]],
        evaluate: Callable[[], dict[str, float]] | None = None,
        run_info: dict | None = None,
        tokenizer=None,
        loss_fn: Callable[[object, dict], torch.Tensor] | None = None,
        settings: dict | None = None,
        fixed_settings: tuple[str, ...] = (),
    ):
        self.setup, self.accelerator = setup, setup.accelerator
        self.model, self.optimizer, self.loop = model, optimizer, loop
        self.batches, self.flops, self.evaluate = batches, flops, evaluate
        self.run_info = run_info or {}
        # every option that changes the trajectory, by the name the user sets it with; saved with each checkpoint
        # and compared on resume (a change warns; one of ``fixed_settings`` refuses: the weights would not fit)
        self.settings, self.fixed_settings = dict(settings or {}), tuple(fixed_settings)
        self._train_loss = math.nan  # the last logged training loss, saved with checkpoints
        self.tokenizer = tokenizer  # saved inside checkpoints when it is a HuggingFace tokenizer
        # loss of one micro-batch on the device (default: the model's own); sequence parallelism passes its own
        self.loss_fn = loss_fn or (lambda model, batch: model(**batch).loss)
        self.out_dir = Path(loop.out_dir)
        self.checkpoint_root = self.out_dir / checkpoint.CHECKPOINTS
        self._stop_reason: str | None = None
        self._finished = False  # resume auto found out_dir's finished run (no checkpoint): nothing to train
        self._finishing = False  # past the last step: SIGTERM lets the run finish (its final save is the fastest end)
        device = self.accelerator.device
        self.peak = loop.peak_tflops if loop.peak_tflops else metrics.peak_tflops(device)

    # ---------------------------------------------------------------------------------------------
    def _resume_path(self) -> Path | None:
        """The checkpoint to resume from, chosen (and verified) by the main process and shared with the others."""
        spec = self.loop.resume
        if spec in ("never", "", None):
            if self.accelerator.is_main_process:
                self._set_aside_previous_run()
            return None
        choice: list = [None, None, None]  # path, error, "finished"
        if self.accelerator.is_main_process:
            try:
                choice[0] = self._choose_checkpoint(spec)
                if choice[0] is None and spec == "auto":
                    choice[2] = "finished" if self._finished_without_checkpoints() else None
            except (checkpoint.CheckpointError, FileNotFoundError) as e:
                choice[1] = f"{type(e).__name__}|{e}"
        if self.accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            choice = broadcast_object_list([None if c is None else str(c) for c in choice], from_process=0)
        if choice[1] is not None:
            kind, message = str(choice[1]).split("|", 1)
            raise (FileNotFoundError if kind == "FileNotFoundError" else checkpoint.CheckpointError)(message)
        self._finished = choice[2] is not None
        return Path(choice[0]) if choice[0] is not None else None

    def _finished_without_checkpoints(self) -> bool:
        """resume auto, and out_dir holds no checkpoint: True when it holds this very run, finished (summary.json
        completed at this run's steps with the same settings, its final model whole); otherwise an earlier run there
        (a final model or summary.json) is set aside as :meth:`_set_aside_previous_run` does, never overwritten."""
        if not ((self.out_dir / "final").exists() or (self.out_dir / "summary.json").exists()):
            return False
        problems = finished_run_problems(self.out_dir, self.loop.steps, self.loop.final_model)
        try:
            saved = json.loads((self.out_dir / "summary.json").read_text(encoding="utf-8")).get("settings")
        except (OSError, ValueError, AttributeError):
            saved = None
        if not problems and saved == self.settings:
            return True
        if not problems:
            changed = [k for k in self.settings if not isinstance(saved, dict) or saved.get(k) != self.settings[k]]
            problems = [f"it was run with other settings ({', '.join(changed) or 'not recorded'})"]
        self._set_aside_previous_run(f"{self.loop.resume_flag} auto: {self.out_dir} holds an earlier run and no "
                                     f"checkpoint to continue it from ({'; '.join(problems)})")
        return False

    PREVIOUS_RUN_FILES = (checkpoint.CHECKPOINTS, "final", "summary.json", "train.csv", "eval.csv", "loss.png",
                          "tensorboard")

    def _set_aside_previous_run(self, why: str = "") -> None:
        """Starting over (resume never, or resume auto without a checkpoint) in an out_dir that holds an earlier
        run: its checkpoints, final model, summary and metrics move to ``out_dir/previous-run-N`` so that the two
        runs never mix (``why``: the log line's reason)."""
        found = [self.out_dir / name for name in self.PREVIOUS_RUN_FILES if (self.out_dir / name).exists()]
        steps = [p.name for p in sorted(self.checkpoint_root.glob("step-*"))] if self.checkpoint_root.is_dir() else []
        if not steps and not (self.out_dir / "final").exists() and not (self.out_dir / "summary.json").exists():
            return
        n = 1
        while (self.out_dir / f"previous-run-{n}").exists():
            n += 1
        target = self.out_dir / f"previous-run-{n}"
        with fsio.writing(target, "the earlier run's files"):
            target.mkdir()
            for path in found:
                os.replace(path, target / path.name)
        if why:
            logger.warning("%s: moved %s to %s, starting over (delete it once it is not needed)", why,
                           ", ".join(p.name for p in found), target)
            return
        logger.warning("%s never: %s held an earlier run (%s); moved %s to %s (delete it once it is not needed)",
                       self.loop.resume_flag, self.out_dir, ", ".join(steps) if steps else "no checkpoints",
                       ", ".join(p.name for p in found), target)

    def _check_resumable(self, path: Path) -> None:
        """The checkpoint's step is within this run's steps, and its settings agree (:meth:`_compare_settings`)."""
        with checkpoint._reading(path / checkpoint.STATE):
            state = json.loads((path / checkpoint.STATE).read_text(encoding="utf-8"))
        start_step, steps = int(state["step"]), self.loop.steps
        self._compare_settings(path, state)
        if start_step > steps:
            planned = state.get("planned_steps")
            finish = (f"{self.loop.steps_flag} {planned} to finish that run (the steps it was planned for)"
                      if isinstance(planned, int) and planned >= start_step else
                      f"{self.loop.steps_flag} {start_step} or more to continue that run")
            raise RunStateError(f"{path} is at step {start_step}, past the {steps} steps this run plans "
                                f"({self.loop.steps_flag} {steps}): pass {finish}, or start over with "
                                f"{self.loop.resume_flag} never (or another out_dir)")

    def _compare_settings(self, path: Path, state: dict) -> None:
        """Warn about each setting that differs from the checkpoint's (naming it, old and new value); refuse one of
        ``fixed_settings``."""
        saved = state.get("settings")
        if not self.settings:
            return
        if not isinstance(saved, dict):
            logger.warning("%s records no run settings (written by an older version): a changed learning rate, "
                           "seed or model config cannot be detected", path)
            return
        for key, value in self.settings.items():
            if key not in saved or saved[key] == value:
                continue
            if key in self.fixed_settings:
                raise RunStateError(
                    f"cannot resume {path}: it was written with {key} {saved[key]!r}, this run has {value!r}; use "
                    f"{saved[key]!r}, or start over with {self.loop.resume_flag} never (or another out_dir)")
            logger.warning("resuming %s with %s %r; the checkpoint was written with %r: the run continues on a "
                           "different trajectory from step %s", path, key, value, saved[key], state.get("step"))

    def _choose_checkpoint(self, spec: str) -> Path | None:
        allow = self.loop.allow_missing_rng
        if spec == "auto":
            return checkpoint.select_resume(self.checkpoint_root, allow_missing_rng=allow)
        path = Path(spec)
        if path.is_dir() and not (path / checkpoint.COMPLETE).exists():
            for root in (path, path / checkpoint.CHECKPOINTS):  # an out_dir/checkpoints directory, or an out_dir
                if checkpoint.complete_checkpoints(root) or any(root.glob("step-*")):
                    return checkpoint.select_resume(root, allow_missing_rng=allow)
        if not (path / checkpoint.COMPLETE).is_file():
            raise FileNotFoundError(resume_option_problem(spec, self.loop.resume_flag) or
                                    f"resume {spec!r}: not a complete checkpoint directory")
        problems, notes = checkpoint.verify_checkpoint(path)
        if allow:
            problems = [p for p in problems if "random-generator state" not in p]
        if problems:
            raise checkpoint.CheckpointError(f"resume {spec!r}: the checkpoint cannot be resumed from: "
                                             f"{'; '.join(problems)}")
        for note in notes:
            logger.warning("%s", note)
        return path

    def _on_sigterm(self, signum, frame):  # noqa: ARG002
        self._stop_reason = "SIGTERM"
        if self._finishing:
            logger.warning("SIGTERM after the last step: finishing the final evaluation, model and summary.json first")
        else:
            logger.warning("SIGTERM: stopping after this step with a checkpoint")

    def _agree(self, started: float, nonfinite: torch.Tensor) -> tuple[bool, str | None]:
        """(a non-finite value on any process, the stop reason all processes agree on): one all-reduce per step
        when several processes run. ``nonfinite`` is this process's 0-d bool tensor."""
        reason = self._stop_reason
        limit = self.loop.time_limit_min * 60
        if reason is None and limit and time.perf_counter() - started > limit:
            reason = f"time limit ({self.loop.time_limit_min:g} min)"
        if self.accelerator.num_processes == 1:
            return bool(nonfinite.item()), reason
        flags = torch.stack([nonfinite.float().reshape(()),
                             torch.tensor(1.0 if reason else 0.0, device=nonfinite.device)])
        flags = self.accelerator.reduce(flags, "max").tolist()
        return flags[0] > 0, (reason or "another process stopped") if flags[1] > 0 else None

    def _weights_finite(self) -> bool:
        """Every parameter this process holds is finite (all processes agree; ZeRO-3 partitions are skipped)."""
        flags = [torch.isfinite(p.detach()).all() for p in self.model.parameters() if p.numel()]
        ok = torch.stack(flags).all().float() if flags else torch.ones((), device=self.accelerator.device)
        if self.accelerator.num_processes > 1:
            ok = self.accelerator.reduce(ok.reshape(1).to(self.accelerator.device), "min")
        return bool(ok.item() > 0)

    def _fail(self, reason: str, done: int, summary: dict, writer) -> None:
        """Record the failure in summary.json (main process) and raise :class:`TrainingFailed`; nothing is saved."""
        last = checkpoint.find_latest(self.checkpoint_root)
        message = (f"{reason}; stopped at step {done}/{self.loop.steps} without saving anything: "
                   + (f"the last good checkpoint is {last}" if last else "there is no checkpoint"))
        logger.error("%s", message)
        writer.close()
        if self.accelerator.is_main_process:
            record = {**summary, "steps": done, "planned_steps": self.loop.steps, "completed": False,
                      "failed": True, "reason": reason, "stopped": "non-finite values", "last_checkpoint":
                      str(last) if last else None, "checkpoint": None, "model": None}
            fsio.write_text_atomic(self.out_dir / "summary.json", fsio.strict_json(record), fsync=False)
        raise TrainingFailed(message)

    def _save(self, step: int, totals: dict) -> None:
        last_loss = self._train_loss if math.isfinite(self._train_loss) else None
        state = {**totals, "micro_batches": step * self.loop.grad_accum, **self.run_info, "settings": self.settings,
                 "planned_steps": self.loop.steps, "train_loss": last_loss}
        checkpoint.save_checkpoint(self.accelerator, self.model, self.optimizer, self.checkpoint_root, step, state,
                                   self.loop.keep_checkpoints, tokenizer=self.tokenizer)

    # ---------------------------------------------------------------------------------------------
    def run(self) -> dict:
        """Resume (or start), train to ``loop.steps`` or a stop, evaluate; returns the summary. SIGTERM is handled
        throughout: before and during the steps it stops the run at the next step boundary with a checkpoint,
        after them it lets the final evaluation finish (the recipe then writes the final model and summary.json)."""
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            return self._run()
        finally:
            signal.signal(signal.SIGTERM, previous)

    def _run(self) -> dict:
        acc, loop = self.accelerator, self.loop
        device = acc.device
        totals = {"tokens": 0, "flops": 0.0, "seconds": 0.0, "skipped_steps": 0}
        start_step, resumed_from, rng = 0, None, None
        path = self._resume_path()
        if path is not None:
            self._check_resumable(path)  # before loading: weights of another shape fail with a less helpful error
            state = checkpoint.load_checkpoint(acc, self.model, self.optimizer, path,
                                               allow_missing_rng=loop.allow_missing_rng)
            start_step, rng, resumed_from = int(state["step"]), state.pop("rng"), str(path)
            totals = {k: state.get(k, v) for k, v in totals.items()}
            if state.get("world_size") != acc.num_processes:
                logger.warning("%s was written by %s process(es), this run has %d: the data order differs from the "
                               "interrupted run's", path, state.get("world_size"), acc.num_processes)
            for key, value in self.run_info.items():
                if key in state and state[key] != value:
                    logger.warning("resuming with %s = %r; the checkpoint was written with %r", key, value, state[key])
            logger.info("resumed from %s at step %d/%d (%s tokens so far)", path, start_step, loop.steps,
                        f"{totals['tokens']:,}")

        if self._finished:
            start_step, state = loop.steps, {}
            logger.info("%s holds this run, finished (step %d, same settings): nothing to train", self.out_dir,
                        start_step)
        summary_base = {"resumed_from": resumed_from, "start_step": start_step, "settings": self.settings}
        if start_step >= loop.steps:  # the recipe checks whether the final model and summary.json are there
            if not self._finished:
                logger.info("the checkpoint is at the last step (%d): nothing to train", start_step)
            mem, mem_kind = metrics.peak_memory(device)
            last_loss = state.get("train_loss")
            return {**summary_base, "steps": start_step, "planned_steps": loop.steps, "tokens": 0, "seconds": 0.0,
                    "tokens_per_second": 0.0, "train_loss": math.nan if last_loss is None else last_loss,
                    "skipped_steps": totals["skipped_steps"], "peak_memory_bytes": mem, "peak_memory_kind": mem_kind,
                    "total_tokens": totals["tokens"], "model_tflops_per_device": 0.0, "completed": True,
                    "stopped": None}

        writer = logs.MetricsWriter(self.out_dir, acc.is_main_process, start_step, loop.tensorboard)
        batches = self.batches(start_step * loop.grad_accum)
        if rng is not None:
            checkpoint.set_rng_state(rng)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        bar = logs.progress_bar(loop.steps, acc.is_main_process and loop.progress)
        bar.update(start_step)

        loss_sum = torch.zeros((), device=device)
        counts = torch.zeros(2, dtype=torch.float64, device=device)  # tokens, FLOPs since the last log line
        n_micro, skipped, session_tokens = 0, 0, 0
        train_loss = math.nan
        grad_norm = None
        clip = loop.grad_clip if loop.grad_clip > 0 else float("inf")
        started = last = time.perf_counter()
        stopped, done = None, start_step
        scaled = loss_scale(self.setup, self.model) is not None  # a dynamic loss scaler skips non-finite steps
        consecutive_skips = 0
        step_loss = torch.zeros((), device=device)
        self.model.train()
        try:
            for step in range(start_step, loop.steps):
                lr = optim.lr_at(step, loop.steps, loop.lr, loop.warmup_steps, loop.min_lr_ratio, loop.schedule)
                optim.set_lr(self.optimizer, lr)
                step_loss.zero_()
                for _ in range(loop.grad_accum):
                    batch = next(batches)
                    n_tokens, n_flops = self.flops(batch)
                    counts[0] += n_tokens
                    counts[1] += n_flops
                    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
                    with acc.accumulate(self.model):  # syncs gradients (DDP) on the last micro-batch only
                        loss = self.loss_fn(self.model, batch)
                        acc.backward(loss)  # divides by grad_accum; fp16: scales the loss; DeepSpeed: steps
                    step_loss += loss.detach().float()
                    n_micro += 1
                loss_sum += step_loss
                if not self.setup.deepspeed:
                    grad_norm = acc.clip_grad_norm_(self.model.parameters(), clip)
                failed = None
                if not scaled and not self.setup.deepspeed:  # decide before the optimizer applies anything
                    nonfinite, stopped = self._agree(started, self._nonfinite(step_loss, grad_norm))
                    if nonfinite:
                        failed = self._describe_nonfinite(step + 1, step_loss, grad_norm)
                if failed is None:
                    self.optimizer.step()  # fp16: skipped when the gradients overflowed, and the loss scale drops
                self.optimizer.zero_grad(set_to_none=True)
                if self.setup.deepspeed:
                    grad_norm = acc.clip_grad_norm_(self.model.parameters(), clip)  # DeepSpeed's norm of this step
                if scaled or self.setup.deepspeed:
                    nonfinite, stopped = self._agree(started, self._nonfinite(step_loss, grad_norm))
                    was_skipped = scaled and bool(acc.optimizer_step_was_skipped)
                    consecutive_skips = consecutive_skips + 1 if was_skipped else 0
                    if nonfinite and not was_skipped:
                        failed = self._describe_nonfinite(step + 1, step_loss, grad_norm)
                    elif consecutive_skips >= loop.max_consecutive_skips:
                        failed = (f"{consecutive_skips} optimizer steps in a row (to step {step + 1}) were skipped "
                                  "for non-finite fp16 gradients (max_consecutive_skips "
                                  f"{loop.max_consecutive_skips}; loss scale now "
                                  f"{loss_scale(self.setup, self.model)}): the run diverged")
                if failed is not None:
                    self._fail(failed, step, {**summary_base, "skipped_steps": totals["skipped_steps"] + skipped,
                                              "train_loss": None}, writer)
                skipped += int(acc.optimizer_step_was_skipped)
                bar.update()
                done = step + 1

                if done % loop.log_interval == 0 or done == loop.steps:
                    train_loss = acc.reduce(loss_sum, "mean").item() / n_micro
                    self._train_loss = train_loss
                    totals_now = acc.reduce(counts, "sum").tolist()
                    now = time.perf_counter()
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                        now = time.perf_counter()
                    dt = max(now - last, 1e-9)
                    last = now
                    mem = acc.reduce(torch.tensor([metrics.peak_memory(device)[0]], device=device), "max").item()
                    tok_s = totals_now[0] / dt
                    tflops = totals_now[1] / dt / acc.num_processes / 1e12
                    mfu = tflops / self.peak if self.peak else None
                    scale = loss_scale(self.setup, self.model)
                    norm = float(grad_norm) if grad_norm is not None else math.nan
                    session_tokens += int(totals_now[0])
                    totals["tokens"] += int(totals_now[0])
                    totals["flops"] += totals_now[1]
                    loss_sum.zero_()
                    counts.zero_()
                    n_micro = 0
                    extra = f" | loss scale {scale:g}" if scale is not None else ""
                    extra += f" | {tflops:.2f} TFLOP/s" + (f" | MFU {100 * mfu:.1f}%" if mfu is not None else "")
                    logger.info(
                        "step %d/%d | loss %.4f | lr %.2e | grad norm %.3f | %s tok/s | peak mem %s%s",
                        done, loop.steps, train_loss, lr, norm, f"{tok_s:,.0f}", metrics.format_bytes(mem), extra,
                    )
                    writer.write("train", done, {
                        "loss": train_loss, "lr": lr, "grad_norm": norm, "tokens_per_s": tok_s, "tflops": tflops,
                        "mfu": mfu, "peak_mem_bytes": mem, "loss_scale": scale,
                        "skipped_steps": totals["skipped_steps"] + skipped, "tokens": totals["tokens"],
                    })
                    bar.set_postfix(loss=f"{train_loss:.3f}")

                if self.evaluate is not None and loop.eval_interval and done % loop.eval_interval == 0 \
                        and done < loop.steps:
                    self._eval(done, writer)

                at_interval = bool(loop.checkpoint_interval) and done % loop.checkpoint_interval == 0
                if at_interval or stopped or done == loop.steps:
                    if not self._weights_finite():
                        self._fail(f"the weights became non-finite in step {done}'s optimizer update (lr {lr:.3g})",
                                   done - 1, {**summary_base, "train_loss": None}, writer)
                if at_interval or stopped or (done == loop.steps and loop.checkpoint_interval):
                    saving = time.perf_counter()
                    self._save(done, {**totals, "seconds": totals["seconds"] + saving - started,
                                      "skipped_steps": totals["skipped_steps"] + skipped})
                    last += time.perf_counter() - saving  # saving is not training time for tok/s
                if stopped:
                    logger.warning("stopping at step %d/%d: %s", done, loop.steps, stopped)
                    break
        finally:
            self._finishing = True
            bar.close()

        seconds = time.perf_counter() - started
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            seconds = time.perf_counter() - started
        final_eval = {}
        if self.evaluate is not None and not stopped:
            final_eval = self._eval(done, writer)
        writer.close()
        mem, mem_kind = metrics.peak_memory(device)
        return {
            **summary_base,
            "steps": done, "planned_steps": loop.steps, "tokens": session_tokens, "seconds": round(seconds, 2),
            "tokens_per_second": round(session_tokens / max(seconds, 1e-9), 1), "train_loss": train_loss,
            "skipped_steps": totals["skipped_steps"] + skipped, "peak_memory_bytes": mem, "peak_memory_kind": mem_kind,
            "total_tokens": totals["tokens"], "model_tflops_per_device": round(
                totals["flops"] / max(seconds + totals["seconds"], 1e-9) / acc.num_processes / 1e12, 3),
            "completed": done == loop.steps, "stopped": stopped, **{f"eval_{k}": v for k, v in final_eval.items()},
        }

    @staticmethod
    def _nonfinite(step_loss: torch.Tensor, grad_norm) -> torch.Tensor:
        bad = ~torch.isfinite(step_loss)
        if isinstance(grad_norm, torch.Tensor):
            bad = bad | ~torch.isfinite(grad_norm.detach().to(bad.device).float())
        elif grad_norm is not None:
            bad = bad | (not math.isfinite(float(grad_norm)))
        return bad

    def _describe_nonfinite(self, step: int, step_loss: torch.Tensor, grad_norm) -> str:
        loss = step_loss.item() / self.loop.grad_accum
        norm = float(grad_norm) if grad_norm is not None else math.nan
        where = f"loss {loss:.4g}, gradient norm {norm:.4g}"
        if self.accelerator.num_processes > 1 and math.isfinite(loss) and math.isfinite(norm):
            where += " here; non-finite on another process"
        targets = chunked_loss.describe_bad_targets()  # the chunked loss on a GPU turns out-of-range labels into NaN
        return f"non-finite values at step {step} ({where})" + (f": the chunked loss's {targets}" if targets else "")

    def _eval(self, step: int, writer) -> dict[str, float]:
        values = self.evaluate()
        logger.info("eval step %d | %s", step, " | ".join(
            f"{('val ' + k) if k == 'loss' else k} {'n/a' if v is None else f'{v:.4f}'}" for k, v in values.items()))
        writer.write("eval", step, values)
        return values


def resume_option_problem(spec: str, flag: str = "--resume") -> str | None:
    """What is wrong with a ``--resume`` value that can be seen before the run begins (a path that does not exist
    or holds no checkpoint), saying what the option accepts; None when nothing is."""
    if spec in ("auto", "never", "", None):
        return None
    path = Path(spec)
    accepted = (f"{flag} accepts auto (the newest complete checkpoint in out_dir/checkpoints; none: a fresh start), "
                "never (start over; an earlier run moves to out_dir/previous-run-N) or a path: a checkpoint "
                "(out_dir/checkpoints/step-N), a checkpoints directory, or an out_dir that holds one")
    if not path.exists():
        return f"{flag} {spec!r}: no such file or directory; {accepted}"
    if (path / checkpoint.COMPLETE).is_file():
        return None
    if path.is_dir() and any(any(root.glob("step-*")) for root in (path, path / checkpoint.CHECKPOINTS)):
        return None  # a checkpoints directory or an out_dir: verified when the run begins
    return f"{flag} {spec!r}: neither a complete checkpoint nor a directory of checkpoints; {accepted}"


# ---- the end of a recipe's run (gpt_long, finetune): run, or report the run out_dir already finished; save, summarise


def run_or_fail(trainer: Trainer, fail: Callable[[str], None]) -> dict:
    """``trainer.run()``; a stop for non-finite values, a file that cannot be written, a checkpoint that cannot be
    resumed or one that does not fit this run ends in ``fail(message)`` (the recipes exit with it); anything else
    propagates."""
    try:
        return trainer.run()
    except (TrainingFailed, RunStateError, fsio.WriteError) as e:
        fail(str(e))
    except (FileNotFoundError, RuntimeError) as e:
        if "checkpoint" in str(e) or "resume" in str(e):
            fail(str(e))
        raise


def end_training(accelerator) -> None:
    """Ends the run on every process together: a barrier, then accelerate's end_training (trackers, process group).
    Without the barrier a process that tears its group down while the main one still writes summary.json can make
    gloo abort the main process (SIGABRT in its socket loop) after a run that succeeded."""
    accelerator.wait_for_everyone()
    accelerator.end_training()


def finished_run_problems(out_dir: Path, planned_steps: int, final_expected: bool) -> list[str]:
    """Why out_dir does not hold the finished run of ``planned_steps`` steps (empty: it does): summary.json must
    say completed at that step and, when a final model is expected, ``final/`` must be whole (it loads)."""
    summary_file = out_dir / "summary.json"
    try:
        summary = json.loads(summary_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return [f"{summary_file}: missing"]
    except (OSError, ValueError) as e:
        return [f"{summary_file}: unreadable ({type(e).__name__}: {e})"]
    problems = []
    if not isinstance(summary, dict) or summary.get("completed") is not True or summary.get("steps") != planned_steps:
        shown = {k: summary.get(k) for k in ("completed", "steps")} if isinstance(summary, dict) else summary
        problems.append(f"{summary_file}: not a completed run of {planned_steps} steps ({shown})")
    if final_expected:
        problems += checkpoint.verify_model(out_dir / "final")
    return problems


def finished_earlier(trainer: Trainer, result: dict, log: logging.Logger, final_expected: bool) -> dict | None:
    """When this call trained nothing because out_dir's checkpoint is at the last step: if out_dir holds the finished
    run (:func:`finished_run_problems`), logs so, ends training and returns its summary.json. Otherwise (a final
    save that failed or was killed) None, after the final evaluation, so that the recipe writes the final model and
    summary.json from the checkpoint. None as well when this call trained."""
    if result["start_step"] < result["planned_steps"]:
        return None
    accelerator, out_dir = trainer.accelerator, trainer.out_dir
    problems: list = [None]
    if accelerator.is_main_process:
        problems[0] = finished_run_problems(out_dir, result["planned_steps"], final_expected)
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        problems = broadcast_object_list(problems, from_process=0)
    if not problems[0]:
        log.info("%s already holds the finished run (step %d): its final model and summary.json stay. %s never "
                 "starts over", out_dir, result["start_step"], trainer.loop.resume_flag)
        end_training(accelerator)
        return json.loads((out_dir / "summary.json").read_text(encoding="utf-8"))
    log.warning("%s: the checkpoint is at the last step (%d) but the run was not finished (%s): writing its final "
                "model and summary.json from %s", out_dir, result["start_step"], "; ".join(problems[0]),
                result["resumed_from"])
    if trainer.evaluate is not None:
        result.update({f"eval_{k}": v for k, v in trainer.evaluate().items()})
    return None


def save_final_and_summary(accelerator, model, out_dir: Path, summary: dict, final_key: str, cfg, tokenizer,
                           fail: Callable[[str], None]) -> None:
    """The final model into ``out_dir/final`` when ``summary[final_key]`` names it, then ``summary.json`` (main
    process); a write error ends in ``fail(message)`` (one line naming the path and the free space), and the run
    is not counted finished (a rerun writes both from the last checkpoint)."""
    try:
        if summary[final_key]:
            checkpoint.save_model(accelerator, model, out_dir / "final", cfg, extra=summary, tokenizer=tokenizer)
        if accelerator.is_main_process:
            fsio.write_text_atomic(out_dir / "summary.json", fsio.strict_json(summary), fsync=False)
    except fsio.WriteError as e:
        fail(str(e))


def exit_status(summary: dict) -> int:
    """0 for a completed run, :data:`STOPPED_EXIT` for one that stopped early with a checkpoint."""
    return 0 if summary.get("completed") else STOPPED_EXIT


# ---- the start of a recipe's run: nothing is left in out_dir by a run that stops before it begins


def begin_run(out_dir: Path, options: dict, is_main: bool) -> None:
    """The run begins: train.log gets the lines logged so far (and every later one), config.yaml is written. A write
    error removes what this call created and raises :class:`fsio.WriteError` naming the file."""
    if not is_main:
        return
    for name in ("summary.json", "config.yaml", "train.csv", "eval.csv"):  # what a SIGKILL mid-write left
        fsio.remove_stale_temporaries(out_dir / name)
    created = [p for p in (out_dir / "train.log", out_dir / "config.yaml") if not p.exists()]
    try:
        logs.commit_log_file()
        logs.write_config(options, out_dir)
    except fsio.WriteError:
        logs.discard_log_file()
        for path in created:
            path.unlink(missing_ok=True)
        raise


def abandon_start(held: list) -> None:
    """The run stopped before it began: no train.log, and the lock file and out_dir go if this run created them."""
    logs.discard_log_file()
    for lock in held:
        if lock is not None:
            lock.discard()


class _Sigterm:
    """SIGTERM outside :meth:`Trainer.run`: before the run begins it stops the run at once (exit
    :data:`STOPPED_EXIT`, nothing left behind); once training has begun (the final model and summary.json are being
    written) it lets them finish, the fastest way to a resumable state."""

    def __init__(self):
        self.training = False

    def __call__(self, signum, frame):  # noqa: ARG002
        if not self.training:
            logger.warning("SIGTERM before the first step: stopping (nothing was written; rerun to start)")
            raise SystemExit(STOPPED_EXIT)
        logger.warning("SIGTERM after the last step: finishing the final model and summary.json first")


def trajectory_settings(options: dict, exclude: set[str], flag: Callable[[str], str]) -> dict:
    """The options that change a run's trajectory, keyed by their flag (``flag(name)``): ``options`` less
    ``exclude``; a section (a dict at the top level, as finetune's) is flattened to ``section.name``."""
    flat: dict = {}
    for key, value in options.items():
        items = [(f"{key}.{k}", v) for k, v in value.items()] if isinstance(value, dict) else [(key, value)]
        for name, item in items:
            if name not in exclude and key not in exclude:
                flat[flag(name)] = json.loads(json.dumps(item))  # as it reads back from trainer_state.json
    return flat


def run_recipe(argv, start: Callable, prepare: Callable, train: Callable, out_dir_of: Callable,
               fail: Callable[[str], None] | None = None) -> dict:
    """The steps of every recipe: ``start(argv, held)`` parses options and locks out_dir, ``prepare(cfg, state)``
    builds everything before the first step and the run begins (train.log, config.yaml): a failure or SIGTERM up to
    there leaves no files (a write error ends in ``fail(message)``). Then ``train(cfg, trainer, *parts)`` returns
    summary.json's contents. A run that stopped before its planned steps with a checkpoint (SIGTERM, a time limit)
    exits with :data:`STOPPED_EXIT` once that is written."""
    sigterm = _Sigterm()
    try:
        previous = signal.signal(signal.SIGTERM, sigterm)
    except ValueError:  # not the main thread: signals stay as they are
        previous = None
    try:
        with runlock.held_locks() as held:  # out_dir's lock (main process), released however the run ends
            try:
                cfg, state = start(argv, held)
                trainer, parts = prepare(cfg, state)
                begin_run(Path(out_dir_of(cfg)), config.to_dict(cfg), state.is_main_process)
            except fsio.WriteError as e:
                abandon_start(held)
                if fail is None:
                    raise
                fail(str(e))
            except BaseException:
                abandon_start(held)
                raise
            sigterm.training = True
            summary = train(cfg, trainer, *parts)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if exit_status(summary):
        raise SystemExit(exit_status(summary))
    return summary

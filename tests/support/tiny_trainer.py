"""A Trainer around a nano GPT on random byte batches, for the tests of runs, checkpoints and resumes."""

from __future__ import annotations

from pathlib import Path

import torch

from volta_train.training import data, distributed, gpt, optim
from volta_train.training.trainer import LoopConfig, Trainer


def make_setup(mixed_precision: str = "no") -> distributed.Setup:
    return distributed.build_accelerator(cpu=True, mixed_precision=mixed_precision, grad_accum=1, batch_size=2,
                                         grad_clip=1.0, deepspeed_spec=None, loss_scale_init=1024.0)


def make_trainer(out: Path, setup, steps=6, interval=1, keep=2, loss_fn=None, resume="auto", settings=None, fixed=(),
                 renamed=None, **loop_kwargs) -> Trainer:
    """``steps`` steps of batch 2 x 16 tokens, micro-batch m seeded by m, a checkpoint every ``interval`` steps."""
    torch.manual_seed(0)
    model = gpt.build_model(gpt.resolve(gpt.GPTTrainConfig(model="nano", seq_len=16), "cpu"), data.ByteTokenizer())
    opt = optim.build_adamw(model, 1e-3, 0.1)
    model, opt = setup.accelerator.prepare(model, opt)

    def batches(start: int):
        m = start
        while True:
            ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(m))
            yield {"input_ids": ids, "labels": ids}
            m += 1

    loop = LoopConfig(steps=steps, grad_accum=1, lr=1e-3, warmup_steps=0, schedule="constant", log_interval=1,
                      checkpoint_interval=interval, keep_checkpoints=keep, out_dir=str(out), progress=False,
                      tensorboard=False, resume=resume, **loop_kwargs)
    return Trainer(setup, model, opt, loop, batches=batches, flops=lambda b: (b["input_ids"].numel(), 0.0),
                   loss_fn=loss_fn, settings=settings, fixed_settings=fixed, renamed_settings=renamed)

"""One process of a two-process recipe run under ZeRO-3, started by tests/training/test_zero3_build.py with accelerate launch:
``zero3_build_child.py gpt_long|finetune [--unpartitioned] <recipe options>``. ``--unpartitioned`` builds the model
whole before prepare() (the build without ``distributed.partitioned_build``). The process writes what the model held
when the optimizer was made (after the build, before prepare()), its random generator's state and the
weight-decay groups to
``<out-dir>/build-rank<r>.json``."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import torch

from volta_train.recipes import finetune, gpt_long
from volta_train.training import distributed, optim


def main(argv: list[str]) -> None:
    recipe = {"gpt_long": gpt_long, "finetune": finetune}[argv[0]]
    unpartitioned = "--unpartitioned" in argv
    argv = [a for a in argv[1:] if a != "--unpartitioned"]
    out_flag = "--out-dir" if recipe is gpt_long else "--logging.out-dir"
    out = Path(argv[argv.index(out_flag) + 1])
    if unpartitioned:
        distributed.zero3_init_config = lambda **kwargs: None
    seen = {}
    groups = optim.param_groups

    def recorded_groups(model, weight_decay):
        params = dict(model.named_parameters())
        seen["ds_id"] = all(hasattr(p, "ds_id") for p in params.values())
        seen["held"] = sum(p.numel() for p in params.values())  # elements in this process's parameter tensors
        seen["partition"] = sum(p.ds_tensor.numel() for p in params.values() if hasattr(p, "ds_tensor"))
        seen["full"] = sum(distributed.param_numel(p) for p in params.values())
        seen["vocab"] = model.config.vocab_size
        seen["rng"] = hashlib.sha1(torch.get_rng_state().numpy().tobytes()).hexdigest()  # the generator after the build
        names = {id(p): n for n, p in params.items()}
        result = groups(model, weight_decay)
        seen["decay"] = sorted(names[id(p)] for p in result[0]["params"])
        seen["no_decay"] = sorted(names[id(p)] for p in result[1]["params"])
        return result

    optim.param_groups = recorded_groups
    recipe.main(argv)
    (out / f"build-rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main(sys.argv[1:])

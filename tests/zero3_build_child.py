"""One process of a two-process gpt_long run under ZeRO-3 (started by tests/test_zero3_build.py with accelerate launch):
``--unpartitioned`` builds the model whole before prepare() (the build without :func:`partitioned_build`); the
process writes what it saw right after the build and the optimizer's weight-decay groups to
``<out-dir>/build-rank<r>.json``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from volta_train.recipes import gpt_long
from volta_train.training import distributed, optim


def main(argv: list[str]) -> None:
    unpartitioned = "--unpartitioned" in argv
    argv = [a for a in argv if a != "--unpartitioned"]
    out = Path(argv[argv.index("--out-dir") + 1])
    seen = {}
    if unpartitioned:
        distributed.zero3_init_config = lambda **kwargs: None
    build = gpt_long._build_model

    def recorded_build(cfg, state, tokenizer):
        model = build(cfg, state, tokenizer)
        params = dict(model.named_parameters())
        seen["ds_id"] = all(hasattr(p, "ds_id") for p in params.values())
        seen["held"] = sum(p.numel() for p in params.values())  # elements in this process's parameter tensors
        seen["partition"] = sum(p.ds_tensor.numel() for p in params.values() if hasattr(p, "ds_tensor"))
        seen["full"] = sum(distributed.param_numel(p) for p in params.values())
        seen["names"] = {id(p): n for n, p in params.items()}
        return model

    groups = optim.param_groups

    def recorded_groups(model, weight_decay):
        result = groups(model, weight_decay)
        seen["decay"] = sorted(seen["names"][id(p)] for p in result[0]["params"])
        seen["no_decay"] = sorted(seen["names"][id(p)] for p in result[1]["params"])
        return result

    gpt_long._build_model = recorded_build
    optim.param_groups = recorded_groups
    gpt_long.main(argv)
    seen.pop("names")
    (out / f"build-rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main(sys.argv[1:])

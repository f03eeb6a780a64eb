"""One process of a two-process gloo world under ZeRO-3, started by tests/training/test_zero3_build.py with accelerate launch:
``zero3_packing_child.py <out.json> <gpt_long model options>``. For fp16 and fp32 mixed precision it builds the
model as gpt_long does, partitioned (ZeRO-3) and whole, takes gpt_long's packed-document decision for each, and
records the decision, the dtype the weights are stored in, the dtype of the logits the decision's check
computed, and the chunked loss's log line (its vocabulary). Process 0 writes the records to out.json."""

from __future__ import annotations

import json
import os
import sys

import torch

from volta_train.recipes import gpt_long
from volta_train.training import chunked_loss, config, data, distributed, gpt


def decision(argv: list[str], state, tokenizer, zero3: bool) -> dict:
    cfg = gpt.resolve(config.parse_config(gpt.GPTTrainConfig, argv), "cpu", state.num_processes)
    section = getattr(cfg, "precision", cfg)  # the option sits in a precision section where the recipes have one
    init = distributed.zero3_init_config(mixed_precision=section.mixed_precision, grad_accum=1, batch_size=1,
                                         grad_clip=1.0, deepspeed_spec="zero3") if zero3 else None
    with distributed.partitioned_build(init):
        model = gpt_long._build_model(cfg, state, tokenizer)
    seen = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, a, out: seen.append(str(out.dtype)))
    documents, note = gpt_long.resolve_packing(cfg, model)
    hook.remove()
    return {"documents": documents, "note": note, "weights": str(next(model.parameters()).dtype),
            "loss": chunked_loss.resolve(True, model)[1], "vocab": model.config.vocab_size,
            "partitioned": hasattr(next(model.parameters()), "ds_id"), "logits": sorted(set(seen))}


def main(out: str, argv: list[str]) -> None:
    state = distributed.init_state(True, "zero3")
    tokenizer = data.load_tokenizer("bytes")
    records = {}
    for precision in ("fp16", "no"):
        options = [*argv, "--mixed-precision", precision]
        for zero3 in (True, False):
            records[f"{precision} {'zero3' if zero3 else 'whole'}"] = decision(options, state, tokenizer, zero3)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out, "w", encoding="utf-8") as f:
            json.dump(records, f)
    torch.distributed.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])

"""One process of the sequence-parallel check in test_sequence_parallel.py (launched by torch.distributed.run).

Every process builds the same small random causal LM (seeded), patches its attention with
volta_train, and keeps an unprepared copy. The copy computes, on the full micro-batch and in this
process alone, the reference: transformers' own loss and every parameter's gradient. The model then
goes through Accelerate + DeepSpeed (ZeRO stage from the command line; ``--plain-deepspeed``:
``sequence_parallel.register`` and ``deepspeed.initialize(mpu=...)`` without Accelerate) with Ulysses sequence
parallelism of degree ``--sp`` (volta_train as the core attention); each process trains on its shard
of its data-parallel group's micro-batch with ``sequence_parallel.sharded_loss``. Written to ``--out`` (rank 0): the reference and sharded losses
of several steps and the largest gradient difference of the first step, as JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from volta_train.training import distributed, sequence_parallel  # noqa: E402


LR = 0.5


def build(arch: str, seq_len: int, heads: int, kv_heads: int):
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    if arch == "gpt2":
        config = GPT2Config(vocab_size=96, n_positions=seq_len, n_embd=64, n_layer=2, n_head=heads, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    else:
        config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=seq_len,
                             use_cache=False)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", default="gpt2", choices=["gpt2", "llama"])
    parser.add_argument("--sp", type=int, default=2)
    parser.add_argument("--zero", default="zero3")
    parser.add_argument("--seq-len", type=int, default=63)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--documents", action="store_true", help="position ids restarting inside rows")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plain-deepspeed", action="store_true",
                        help="sequence_parallel.register + deepspeed.initialize(mpu=...) instead of Accelerate")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)

    import volta_train
    from accelerate.utils import set_seed

    state = distributed.init_state(cpu=True, deepspeed_spec=args.zero)
    set_seed(1234)
    model = build(args.arch, args.seq_len, args.heads, args.kv_heads)
    volta_train.patch(model)
    reference = copy.deepcopy(model)

    # random micro-batches, the same on every process: steps x data-parallel groups
    dp = state.num_processes // args.sp
    gen = torch.Generator().manual_seed(args.seed)
    batches = []
    for _ in range(args.steps * dp):
        ids = torch.randint(0, 96, (args.batch_size, args.seq_len), generator=gen)
        labels = ids.clone()
        batch = {"input_ids": ids, "labels": labels}
        if args.documents:
            cut = int(torch.randint(5, args.seq_len - 5, (1,), generator=gen))
            positions = torch.cat([torch.arange(cut), torch.arange(args.seq_len - cut)]).expand(args.batch_size, -1)
            labels[:, cut] = -100
            batch["position_ids"] = positions.contiguous()
        batches.append(batch)

    # the reference: this process alone, the full sequences, transformers' loss (plain SGD for the next steps)
    ref_losses, ref_grads = [], {}
    initial = {n: p.detach().clone() for n, p in reference.named_parameters()}
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    for step in range(args.steps):
        loss = sum(reference(**b, use_cache=False).loss for b in batches[step * dp:(step + 1) * dp]) / dp
        loss.backward()
        if step == 0:
            ref_grads = {n: p.grad.detach().clone() for n, p in reference.named_parameters()}
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())

    if args.plain_deepspeed:  # the documented use without Accelerate
        import deepspeed

        mpu = sequence_parallel.register(model, args.sp, micro_batch_size=args.batch_size)
        uattn = sequence_parallel.ensure_installed(model.config._attn_implementation)
        ds_config = json.loads((Path(distributed.resolve_deepspeed_spec(args.zero))).read_text())
        ds_config.update(train_micro_batch_size_per_gpu=args.batch_size, gradient_accumulation_steps=1,
                         train_batch_size=args.batch_size * dp, gradient_clipping=0.0, fp16={"enabled": False},
                         bf16={"enabled": False}, zero_allow_untested_optimizer=True)
        ds_config["zero_optimization"] = {k: v for k, v in ds_config["zero_optimization"].items() if v != "auto"}
        engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(),
                                                                                              lr=LR),
                                                       config=ds_config, mpu=mpu)
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()

        def backward(loss):
            engine.backward(loss)
            engine.step()
    else:
        pc = sequence_parallel.parallelism_config(args.sp, state.num_processes, model)
        setup = distributed.build_accelerator(cpu=True, mixed_precision="no", grad_accum=1,
                                              batch_size=args.batch_size, grad_clip=0.0, deepspeed_spec=args.zero,
                                              parallelism_config=pc)
        acc = setup.accelerator
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        with sequence_parallel.kv_heads_alias(model.config):
            engine, optimizer = acc.prepare(model, optimizer)
        uattn = sequence_parallel.install(model.config._attn_implementation)
        ds_config = acc.state.deepspeed_plugin.deepspeed_config
        rank, world = acc.process_index, acc.num_processes

        def backward(loss):
            acc.backward(loss)  # Accelerate runs DeepSpeed's step inside backward
            optimizer.step()
            optimizer.zero_grad()
    assert "num_key_value_heads" not in model.config.to_dict() or args.arch != "gpt2"
    lay = sequence_parallel.layout(rank, world, args.sp)
    factor = sequence_parallel.gradient_factor(ds_config, args.sp)

    from deepspeed.utils import safe_get_full_fp32_param

    # DeepSpeed steps right after backward: the gradient is read from the first SGD update,
    # (initial - updated) / lr, on the full fp32 weights (gathered under ZeRO-3)
    losses, grad_err, grad_scale, grads_seen = [], 0.0, 0.0, 0
    for step in range(args.steps):
        batch = batches[step * dp + lay.dp_rank]
        shard = sequence_parallel.shard_batch(batch, lay.sp, lay.sp_rank)
        loss = sequence_parallel.sharded_loss(engine, shard, lay.group, factor)
        backward(loss)
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / world)
        if step == 0:
            for name, param in engine.module.named_parameters():
                updated = safe_get_full_fp32_param(param)
                grads_seen += 1
                grad = (initial[name] - updated.float().cpu()) / LR
                grad_err = max(grad_err, (grad - ref_grads[name]).abs().max().item())
                grad_scale = max(grad_scale, ref_grads[name].abs().max().item())
    sequence_parallel.ensure_installed(model.config._attn_implementation, uattn)
    if rank == 0:
        Path(args.out).write_text(json.dumps({
            "reference": ref_losses, "sharded": losses, "grad_max_abs_diff": grad_err, "grad_max_abs": grad_scale,
            "grads_compared": grads_seen, "parameters": len(ref_grads), "layout": [lay.sp, lay.dp],
            "attention": model.config._attn_implementation,
        }))
    torch.distributed.barrier()


if __name__ == "__main__":
    main()

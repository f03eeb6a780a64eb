"""What both training recipes (``volta_train/recipes/``) share, one concept per module; each recipe is one file
read top to bottom (parse, build, train, save).

Components both recipes embed as the same YAML section, each with its options (a dataclass with help), its checks
and one function that applies it:

* :mod:`.memory`: gradient checkpointing, tiled MLP (:mod:`.tiled_mlp`), lean RMSNorm (:mod:`.rms_norm`),
  activation offload (:mod:`.activation_offload`), chunked loss (:mod:`.chunked_loss`).
* :mod:`.parallel`: DeepSpeed ZeRO stage and offload, DeepSpeed-Ulysses sequence parallelism
  (:mod:`.sequence_parallel`).
* :mod:`.precision`: mixed precision and fp16 loss scaling.

The rest:

* :mod:`.config`: one dataclass per recipe (sections for nested YAML), filled from defaults < YAML
  (``--config``, read with ``yaml.safe_load``) < flags; errors name the bad key.
* :mod:`.gpt`: the gpt_long recipe's options, per-device "auto" defaults, GPT-2 / Llama-style model builder.
* :mod:`.finetune_config`: the finetune recipe's options; :mod:`.examples` its jsonl records, tokenised and
  cached; :mod:`.example_batches` its padded or packed batches; :mod:`.evaluation` its evaluation.
* :mod:`.models`: loading a model (pretrained or random) the same way in both recipes, tokenizer choice.
* :mod:`.steps`: the micro-batches and the loss the trainer calls, sharded under sequence parallelism.
* :mod:`.data`: byte and local HuggingFace tokenizers, cached token streams, packing with or without
  document boundaries (position ids), the resumable sharded sampler.
* :mod:`.corpus`: the deterministic synthetic corpus (no downloads).
* :mod:`.attention_choice`: ``volta_train.patch`` for the recipes, and the check that packed documents stay apart.
* :mod:`.distributed`: the Accelerator: one process, DDP or DeepSpeed ZeRO 1-3, fp16 loss scaling.
* :mod:`.trainer`: the shared loop (accumulation, clipping, logs, evaluation, checkpoints, resume), and the
  frame of a run (out_dir locked, no file left by a run that stops before it begins).
* :mod:`.sequence_parallel`: DeepSpeed-Ulysses with volta_train's attention, and the shards and loss around it.
* :mod:`.chunked_loss`, :mod:`.tiled_mlp`, :mod:`.rms_norm`, :mod:`.activation_offload`: the long-context memory
  savers (the loss without whole logits, the MLP over token tiles, the lean RMSNorm, checkpointed activations in
  host memory), configured through :mod:`.memory`.
* :mod:`.checkpoint`: final models (safetensors) and atomic resumable checkpoints, loaded without pickle code.
* :mod:`.runlock`: one run per output directory (an ``flock`` held for the run's life).
* :mod:`.fsio`: writes whose errors name the file (disk full), atomic text writes.
* :mod:`.optim`: optimizers with weight-decay groups, learning-rate schedules as functions of the step.
* :mod:`.logs`, :mod:`.metrics`, :mod:`.plots`: log lines next to a tqdm bar, CSV + TensorBoard; tokens/s, memory,
  FLOPs, MFU; a run's ``loss.png``.

Importing this package does not import transformers or accelerate.
"""

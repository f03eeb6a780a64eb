"""Reusable pieces of the training recipes (``recipes/``); the recipes keep only their wiring.

* :mod:`.config`: dataclasses filled from defaults < YAML (``--config``, read with ``yaml.safe_load``) < flags; errors
  name the bad key.
* :mod:`.gpt`: the GPT recipe's options, per-device "auto" defaults, GPT-2 / Llama-style model builder.
* :mod:`.finetune_setup`: the fine-tuning recipe's YAML schema, jsonl formats, batching, models and evaluation.
* :mod:`.models`: model helpers both recipes share (precision "auto", the padded vocabulary, a local model config).
* :mod:`.data`: byte and local HuggingFace tokenizers, cached token streams, packing with or without
  document boundaries (position ids), the resumable sharded sampler.
* :mod:`.corpus`: the deterministic synthetic corpus (no downloads).
* :mod:`.attention_choice`: which attention a recipe's model runs, and the check that packed documents stay apart.
* :mod:`.distributed`: the Accelerator: one process, DDP or DeepSpeed ZeRO 1-3, fp16 loss scaling.
* :mod:`.sequence_parallel`: DeepSpeed-Ulysses with volta_train's attention, and the shards and loss around it.
* :mod:`.chunked_loss`, :mod:`.tiled_mlp`, :mod:`.rms_norm`, :mod:`.activation_offload`: the long-context memory
  savers (the loss without whole logits, the MLP over token tiles, the lean RMSNorm, checkpointed activations in
  host memory).
* :mod:`.trainer`: the shared loop (accumulation, clipping, logs, evaluation, checkpoints, resume).
* :mod:`.checkpoint`: final models (safetensors) and atomic resumable checkpoints, loaded without pickle code.
* :mod:`.runlock`: one run per output directory (an ``flock`` held for the run's life).
* :mod:`.fsio`: writes whose errors name the file (disk full), atomic text writes.
* :mod:`.optim`: optimizers with weight-decay groups, learning-rate schedules as functions of the step.
* :mod:`.logs`, :mod:`.metrics`, :mod:`.plots`: log lines next to a tqdm bar, CSV + TensorBoard; tokens/s, memory,
  FLOPs, MFU; a run's ``loss.png``.

Importing this package does not import transformers or accelerate.
"""

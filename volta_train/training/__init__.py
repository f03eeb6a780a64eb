"""Reusable pieces of the training recipes (``recipes/``); the recipes keep only their wiring.

* :mod:`.config`: one dataclass per recipe (sections for nested YAML), filled from defaults < YAML
  (``--config``, read with ``yaml.safe_load``) < flags; errors name the bad key.
* :mod:`.gpt`: the GPT recipe's options, per-device "auto" defaults, GPT-2 / Llama-style model builder.
* :mod:`.finetune`: the fine-tuning recipe's YAML schema, jsonl formats, batching, models and evaluation.
* :mod:`.data`: byte and local HuggingFace tokenizers, cached token streams, packing with or without
  document boundaries (position ids), the resumable sharded sampler.
* :mod:`.corpus`: the deterministic synthetic corpus (no downloads).
* :mod:`.attention`: ``volta_train.patch`` for the recipes, and the check that packed documents stay apart.
* :mod:`.distributed`: the Accelerator: one process, DDP or DeepSpeed ZeRO 1-3, fp16 loss scaling.
* :mod:`.trainer`: the shared loop (accumulation, clipping, logs, evaluation, checkpoints, resume).
* :mod:`.checkpoint`: final models (safetensors) and atomic resumable checkpoints, loaded without pickle code.
* :mod:`.runlock`: one run per output directory (an ``flock`` held for the run's life).
* :mod:`.fsio`: writes whose errors name the file (disk full), atomic text writes.
* :mod:`.optim`: optimizers with weight-decay groups, learning-rate schedules as functions of the step.
* :mod:`.logs`, :mod:`.metrics`: log lines next to a tqdm bar, CSV + TensorBoard; tokens/s, memory, FLOPs, MFU.

Importing this package does not import transformers or accelerate.
"""

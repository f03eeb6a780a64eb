"""Reusable pieces of the training recipes (``recipes/``); the recipes keep only their training loop.

* :mod:`.config`: one dataclass per recipe, filled from defaults < YAML (``--config``) < flags.
* :mod:`.gpt`: the GPT recipe's options, per-device "auto" defaults, model presets and model builder.
* :mod:`.data`: byte tokenizer, cached token streams, fixed-length packing.
* :mod:`.corpus`: the deterministic synthetic corpus (no downloads).
* :mod:`.optim`: AdamW parameter groups and the warmup + cosine learning rate.
* :mod:`.logs`, :mod:`.metrics`: one-line-per-event logging next to a tqdm bar; tokens/s and peak memory.
* :mod:`.checkpoint`: safetensors weights + configs through ``save_pretrained``.

Importing this package does not import transformers or accelerate.
"""

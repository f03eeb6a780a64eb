"""The training recipes: ``gpt_long`` (pretrain a GPT on long sequences) and ``finetune`` (from a YAML file).

Each module's ``main(argv)`` runs the recipe and returns its summary. Entry points: ``volta-train train`` /
``volta-train finetune``, ``accelerate launch -m volta_train.recipes.gpt_long``, and in a checkout
``accelerate launch recipes/gpt_long.py``.
"""

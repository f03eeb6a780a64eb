"""Integrations of volta_train with training frameworks.

* :mod:`volta_train.integrations.hf`: HuggingFace transformers models, through
  transformers' attention interface (``volta_train.patch(model)`` /
  ``volta_train.unpatch(model)``, or ``attn_implementation="volta_train"`` at load
  time after ``volta_train.integrations.hf.register()``).

Submodules are imported on demand only: importing this package does not import
transformers.
"""

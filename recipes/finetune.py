"""Checkout entry point of the finetune recipe: `accelerate launch recipes/finetune.py ...` or `python recipes/finetune.py ...`.

The recipe itself is volta_train/recipes/finetune.py; installed, the same runs as `volta-train finetune ...` or
`accelerate launch -m volta_train.recipes.finetune ...`. See --help.
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP: see volta_train/recipes/finetune.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's volta_train, installed or not

from volta_train.recipes.finetune import main  # noqa: E402

if __name__ == "__main__":
    main()

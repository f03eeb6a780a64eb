"""Checkout entry point of the gpt_long recipe: `accelerate launch recipes/gpt_long.py ...` or `python recipes/gpt_long.py ...`.

The recipe itself is volta_train/recipes/gpt_long.py; installed, the same runs as `volta-train train ...` or
`accelerate launch -m volta_train.recipes.gpt_long ...`. See --help.
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP: see volta_train/recipes/gpt_long.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's volta_train, installed or not

from volta_train.recipes.gpt_long import main  # noqa: E402

if __name__ == "__main__":
    main()

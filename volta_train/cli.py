"""The ``volta-train`` command: one entry point for the things a user runs.

    volta-train env                      # what this machine has; exit 0 ready, 1 not ready, 3 CPU only (no NVRTC)
    volta-train train [gpt_long options] # pretrain a GPT (volta_train/recipes/gpt_long.py), one process
    volta-train finetune --config NAME   # fine-tune from a YAML file or a shipped config's name
    volta-train bench                    # attention speed and accuracy against PyTorch's SDPA backends (GPU)
    volta-train precompile [--arch sm_70]  # compile every shipped kernel into the cache (NVRTC, no GPU)
    volta-train plot RUN_DIR             # draw RUN_DIR/loss.png from the run's train.csv / eval.csv
    volta-train configs                  # where the shipped configs are, by name

Several processes: ``accelerate launch [--config_file FILE] -m volta_train.recipes.gpt_long [options]`` (or
``...recipes.finetune``); ``volta-train configs`` prints the accelerate/DeepSpeed config files to pass.
Each subcommand has its own ``--help``.
"""

from __future__ import annotations

import argparse
import os
import sys

# Before anything loads torch (and OpenMP): see volta_train/recipes/gpt_long.py. Your own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# (none of these loads torch: each subcommand imports the torch-loading modules it runs, after the line above)
from . import __version__  # noqa: E402
from .resources import configs_dir  # noqa: E402
from .training.plots import plot_run  # noqa: E402

COMMANDS = {
    "env": "what volta_train sees here: torch, GPU, kernel sources, NVRTC, cache, backend, transformers",
    "train": "pretrain a GPT on long sequences (the gpt_long recipe); all its options follow",
    "finetune": "fine-tune from a YAML config (the finetune recipe); all its options follow",
    "bench": "attention speed (TFLOP/s) and accuracy of volta_train against PyTorch SDPA backends on this GPU",
    "precompile": "compile every shipped kernel variant into the kernel cache (needs NVRTC, no GPU)",
    "plot": "draw RUN_DIR/loss.png (train/val loss, learning rate, tokens/s) from a run directory",
    "configs": "list the shipped configs (accelerate, deepspeed, gpt_long, finetune) with their paths",
}
PASS_THROUGH = ("train", "finetune", "bench", "env")  # these parse their own options (and --help)


def _plot(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="volta-train plot", description=COMMANDS["plot"])
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run's out_dir (holds train.csv)")
    parser.add_argument("--out", help="PNG to write (default RUN_DIR/loss.png)")
    args = parser.parse_args(argv)
    try:
        path = plot_run(args.run_dir, args.out)
    except FileNotFoundError as error:
        parser.exit(1, f"volta-train plot: error: {error}\n")
    print(f"wrote {path}")
    return 0


def _precompile(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="volta-train precompile", description=COMMANDS["precompile"] + (
        ". Compiles from the kernel source directory that `volta-train env` names, into the kernel cache "
        "(VOLTA_TRAIN_CACHE_DIR). Several processes share the work through the cache's per-kernel locks."))
    parser.add_argument("--arch", default="sm_70", help="target architecture, e.g. sm_70 (default) or sm_90")
    parser.add_argument("--jobs", type=int, default=1, help="compile in this many processes (default 1)")
    parser.add_argument("--head-dims", type=int, nargs="+",
                        help="only the kernels of these head dims, e.g. 64 128 (default: every shipped kernel)")
    args = parser.parse_args(argv)
    from .kernels import nvrtc
    from .kernels.precompile import precompile_all

    try:
        precompile_all(args.arch, jobs=args.jobs, head_dims=args.head_dims)
    except (FileNotFoundError, nvrtc.NvrtcNotFoundError, ValueError) as error:
        parser.exit(1, f"volta-train precompile: error: {error}\n")
    return 0


def _configs(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="volta-train configs", description=COMMANDS["configs"] + (
        ". `volta-train train --config NAME` and `volta-train finetune --config NAME` take the names; "
        "DeepSpeed shorthands (`--deepspeed zero2`) the deepspeed ones."))
    parser.add_argument("family", nargs="?", choices=["accelerate", "deepspeed", "gpt_long", "finetune"],
                        help="only this directory")
    args = parser.parse_args(argv)
    root = configs_dir()
    for family in [args.family] if args.family else ["accelerate", "deepspeed", "gpt_long", "finetune"]:
        files = sorted(p for p in (root / family).iterdir() if p.suffix in (".yaml", ".json"))
        print(f"{family}: {root / family}")
        for path in files:
            print(f"  {path.stem:28s} {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="volta-train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"volta_train {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=name not in PASS_THROUGH)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] not in COMMANDS:
        parser.parse_args(argv)  # --help, --version, or an error naming the accepted commands
        parser.print_help()
        return 2
    command, rest = argv[0], argv[1:]
    if command == "env":
        from . import env

        return env.main(rest)
    if command in ("train", "finetune"):
        from .recipes import finetune, gpt_long

        recipe = gpt_long if command == "train" else finetune
        sys.argv = [f"volta-train {command}", *rest]  # argparse's usage line names the command
        recipe.main(rest, prog=f"volta-train {command}")  # exits non-zero itself when the run did not finish
        return 0
    if command == "bench":
        from . import bench

        return bench.main(rest, prog="volta-train bench")
    return {"plot": _plot, "precompile": _precompile, "configs": _configs}[command](rest)


if __name__ == "__main__":
    sys.exit(main())

"""Write the recipes' synthetic corpus to a file, to read it or to train on it as a file.

    python data/make_corpus.py --mb 1 --out out/synthetic.jsonl     # one {"text": ...} document per line
    python recipes/gpt_long.py --data out/synthetic.jsonl

The recipes generate the same documents on the fly (--data synthetic, the default), so nothing here
needs to be run for training; see volta_train/training/corpus.py for what the documents are.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from volta_train.training.corpus import synthetic_documents  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=1.0, help="corpus size in MB (default: 1)")
    parser.add_argument("--seed", type=int, default=0, help="generator seed (the recipes use 0)")
    parser.add_argument("--out", required=True, help="output file: .jsonl (one document per line) or .txt")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    docs = synthetic_documents(int(args.mb * 1e6), args.seed)
    with out.open("w", encoding="utf-8") as f:
        for n, doc in enumerate(docs, 1):
            f.write(json.dumps({"text": doc}) + "\n" if out.suffix == ".jsonl" else doc + "\n")
    print(f"wrote {n} documents to {out}")


if __name__ == "__main__":
    main()

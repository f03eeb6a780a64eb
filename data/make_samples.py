"""Regenerate the fine-tuning samples and tiny tokenizers shipped in the repository (deterministic, offline).

    python data/make_samples.py            # rewrites data/samples/*.jsonl and configs/finetune/models/*/tokenizer*

Writes:

* ``data/samples/instructions_{train,eval}.jsonl``: {"instruction", "input", "output"} records
  (arithmetic, reversing, sorting and counting words, recalling a fact from the input);
* ``data/samples/stories.jsonl``: {"text"} documents of the synthetic corpus (short ones);
* ``data/samples/sentiment_{train,eval}.jsonl``: {"text", "label": positive|negative} reviews;
* ``data/samples/pairs_{train,eval}.jsonl``: {"premise", "hypothesis", "label":
  entailment|contradiction} sentence pairs;
* ``configs/finetune/models/tiny_bert/``: a WordPiece tokenizer (lower case, ~600 ids) trained
  on the sentiment and pair samples; ``configs/finetune/models/tiny_roberta/``: a byte-level BPE
  tokenizer (~600 ids) trained on the same text. The model configs (``config.json``) next to
  them are written by hand; their ``vocab_size`` must cover the tokenizer.

Everything comes from seeded ``random.Random`` generators, so reruns give identical files
(tokenizer training is deterministic for a given input).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from volta_train.training.corpus import (  # noqa: E402
    _ADJECTIVES, _NAMES, _OBJECTS, _PLACES, _WORDS, synthetic_documents,
)

SAMPLES = ROOT / "data" / "samples"
MODELS = ROOT / "configs" / "finetune" / "models"


def _write(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"wrote {len(records)} records to {path.relative_to(ROOT)}")


def instructions(rng: random.Random, n: int) -> list[dict]:
    out = []
    for _ in range(n):
        kind = rng.randrange(6)
        if kind == 0:
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            out.append({"instruction": "Add the two numbers.", "input": f"{a} + {b}", "output": str(a + b)})
        elif kind == 1:
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            out.append({"instruction": "Subtract the second number from the first.", "input": f"{a} - {b}",
                        "output": str(a - b)})
        elif kind == 2:
            words = rng.sample(_WORDS, rng.randint(3, 6))
            out.append({"instruction": "Reverse the order of the words.", "input": " ".join(words),
                        "output": " ".join(reversed(words))})
        elif kind == 3:
            words = rng.sample(_WORDS, rng.randint(3, 6))
            out.append({"instruction": "Sort the words alphabetically.", "input": " ".join(words),
                        "output": " ".join(sorted(words))})
        elif kind == 4:
            words = [rng.choice(_WORDS) for _ in range(rng.randint(2, 9))]
            out.append({"instruction": "How many words are there?", "input": " ".join(words),
                        "output": str(len(words))})
        else:
            name, obj, place = rng.choice(_NAMES), rng.choice(_OBJECTS), rng.choice(_PLACES)
            adjective = rng.choice(_ADJECTIVES)
            out.append({"instruction": f"Where does {name} keep the {obj}?",
                        "input": f"{name} keeps the {adjective} {obj} in {place}.", "output": place})
    return out


_GOOD = "great wonderful excellent lovely superb delightful sturdy reliable beautiful perfect".split()
_BAD = "awful terrible broken flimsy useless disappointing ugly cheap faulty poor".split()
_OPENERS = ["The {obj} was {adj}.", "This {obj} is {adj}.", "I found the {obj} {adj}.",
            "Honestly, a {adj} {obj}.", "What a {adj} {obj}!", "My new {obj} turned out {adj}."]
_CLOSERS = ["I would buy it again.", "Never again.", "It arrived on Tuesday.", "The box was {col}.",
            "{name} agreed with me.", "It came from {place}.", ""]


def sentiment(rng: random.Random, n: int) -> list[dict]:
    out = []
    for _ in range(n):
        positive = rng.random() < 0.5
        adj = rng.choice(_GOOD if positive else _BAD)
        obj = rng.choice(_OBJECTS)
        text = rng.choice(_OPENERS).format(obj=obj, adj=adj)
        if rng.random() < 0.3:  # a second, weaker cue of the same polarity
            text += f" Quite {rng.choice(_GOOD if positive else _BAD)} overall."
        closer = rng.choice(_CLOSERS)
        if closer == "I would buy it again." and not positive:
            closer = "Never again."
        elif closer == "Never again." and positive:
            closer = "I would buy it again."
        closer = closer.format(col=rng.choice(["red", "blue", "green"]), name=rng.choice(_NAMES),
                               place=rng.choice(_PLACES))
        out.append({"text": (text + " " + closer).strip(), "label": "positive" if positive else "negative"})
    return out


def pairs(rng: random.Random, n: int) -> list[dict]:
    colours = ["red", "blue", "green", "silver", "copper"]
    out = []
    for _ in range(n):
        name, obj, place = rng.choice(_NAMES), rng.choice(_OBJECTS), rng.choice(_PLACES)
        colour = rng.choice(colours)
        premise = f"{name} keeps the {colour} {obj} in {place}."
        entail = rng.random() < 0.5
        kind = 0 if rng.random() < 0.8 else rng.randrange(1, 3)
        if kind == 0:
            c = colour if entail else rng.choice([x for x in colours if x != colour])
            hypothesis = f"The {obj} that {name} keeps is {c}."
        elif kind == 1:
            p = place if entail else rng.choice([x for x in _PLACES if x != place])
            hypothesis = f"The {obj} is kept in {p}."
        else:
            who = name if entail else rng.choice([x for x in _NAMES if x != name])
            hypothesis = f"{who} keeps a {obj}."
        out.append({"premise": premise, "hypothesis": hypothesis,
                    "label": "entailment" if entail else "contradiction"})
    return out


def stories(n: int) -> list[dict]:
    docs = [d for d in synthetic_documents(2_000_000, seed=7) if len(d) <= 1500]
    return [{"text": d} for d in docs[:n]]


def tokenizers(texts: list[str]) -> None:
    from tokenizers.implementations import BertWordPieceTokenizer, ByteLevelBPETokenizer
    from transformers import BertTokenizerFast, RobertaTokenizerFast

    wp = BertWordPieceTokenizer(lowercase=True)
    wp.train_from_iterator(texts, vocab_size=600, min_frequency=1,
                           special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    bert = BertTokenizerFast(tokenizer_object=wp._tokenizer, model_max_length=256)
    bert.save_pretrained(MODELS / "tiny_bert")
    print(f"tiny_bert tokenizer: {len(bert)} ids")

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=600, min_frequency=2,
                            special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    roberta = RobertaTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<s>", eos_token="</s>",
                                   sep_token="</s>", cls_token="<s>", pad_token="<pad>", unk_token="<unk>",
                                   mask_token="<mask>", model_max_length=256)
    roberta.save_pretrained(MODELS / "tiny_roberta")
    print(f"tiny_roberta tokenizer: {len(roberta)} ids")


def main() -> None:
    rng = random.Random(2026)
    _write(SAMPLES / "instructions_train.jsonl", instructions(rng, 480))
    _write(SAMPLES / "instructions_eval.jsonl", instructions(rng, 48))
    _write(SAMPLES / "stories.jsonl", stories(160))
    sent_train, sent_eval = sentiment(rng, 480), sentiment(rng, 96)
    _write(SAMPLES / "sentiment_train.jsonl", sent_train)
    _write(SAMPLES / "sentiment_eval.jsonl", sent_eval)
    pair_train, pair_eval = pairs(rng, 480), pairs(rng, 96)
    _write(SAMPLES / "pairs_train.jsonl", pair_train)
    _write(SAMPLES / "pairs_eval.jsonl", pair_eval)
    texts = [r["text"] for r in sent_train] + [r["premise"] + " " + r["hypothesis"] for r in pair_train]
    tokenizers(texts)


if __name__ == "__main__":
    main()

"""A deterministic synthetic text corpus, so that the recipes need no download.

Four kinds of documents, mixed, each built from a seeded ``random.Random``:

* ``story``: short sentences from a small grammar, with a cast of named
  characters introduced at the top and reused further down (local syntax, plus
  names to carry over a few hundred bytes);
* ``registry``: a numbered list of items and their owners and places, then
  questions about them, answered from the list (recall over up to ~10 KB);
* ``copy``: a run of random words that is repeated later in the document
  (an induction-head task; whatever precedes the repeat has to be attended to);
* ``sums``: lines of small-number arithmetic (``48 + 17 = 65``).

The words, the mix and the lengths are fixed here, so a (seed, size) pair
always gives the same bytes. Documents are separated by the tokenizer's EOS,
not by any text.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

GENERATOR_VERSION = 1  # bump when the output for a given seed changes (invalidates caches)

_NAMES = (
    "Ada Bram Cora Dario Edda Fenn Greta Hugo Ilse Jonas Kira Lars Mira Nils Oona Pavel Quinn Rosa Sven "
    "Tilda Ugo Vera Wim Xenia Yusuf Zora"
).split()
_ROLES = "baker miller smith weaver sailor farmer teacher doctor potter carpenter fisher painter".split()
_PLACES = "Elmstead Harrowgate Lindford Marsh_End Oakridge Pinecliff Redwater Stonebridge Thornby Westfold".split()
_PLACES = [p.replace("_", " ") for p in _PLACES]
_OBJECTS = (
    "kettle lantern map compass ladder basket rope anchor drum flute saddle mirror clock shovel bell quilt "
    "barrel candle hammer needle"
).split()
_ADJECTIVES = "old red small heavy bright wooden copper silver green broken quiet round blue tall".split()
_VERBS_PAST = "found carried fixed painted sold lost borrowed cleaned hid weighed".split()
_MOTIONS = "walked ran sailed rode climbed wandered hurried".split()
_DESTINATIONS = "the river|the market|the hill|the harbour|the mill|the forest|the square|the old bridge".split("|")
_TIMES = "In the morning|At noon|That evening|The next day|After the rain|Before dawn|Later".split("|")
_FEELINGS = "happy tired curious worried proud calm".split()
_WORDS = (
    "alder birch cedar delta ember flint grove heron indigo juniper kestrel lumen maple nectar onyx pollen "
    "quartz raven sorrel thistle umber vesper willow xylem yarrow zephyr"
).split()


def _story(rng: random.Random, target: int) -> str:
    cast = rng.sample(_NAMES, rng.randint(2, 4))
    roles = {name: rng.choice(_ROLES) for name in cast}
    home = rng.choice(_PLACES)
    parts = [f"A story from {home}.\n\n"]
    parts += [f"{name} was a {roles[name]} in {home}. " for name in cast]
    parts.append("\n")
    size = sum(map(len, parts))
    while size < target:
        name = rng.choice(cast)
        kind = rng.random()
        if kind < 0.35:
            line = f"{rng.choice(_TIMES)} {name} {rng.choice(_MOTIONS)} to {rng.choice(_DESTINATIONS)}. "
        elif kind < 0.7:
            line = f"{name} {rng.choice(_VERBS_PAST)} the {rng.choice(_ADJECTIVES)} {rng.choice(_OBJECTS)}. "
        elif kind < 0.85:
            line = f"The {roles[name]} felt {rng.choice(_FEELINGS)}. "
        else:
            other = rng.choice([c for c in cast if c != name])
            line = f"{name} gave the {rng.choice(_OBJECTS)} to {other}, the {roles[other]}.\n"
        parts.append(line)
        size += len(line)
    return "".join(parts).rstrip() + "\n"


def _registry(rng: random.Random, target: int) -> str:
    town = rng.choice(_PLACES)
    n_items = max(4, target // 90)
    items = []
    for i in range(n_items):
        thing = f"{rng.choice(_ADJECTIVES)} {rng.choice(_OBJECTS)}"
        items.append((i + 1, thing, rng.choice(_NAMES), rng.randint(1, 99)))
    lines = [f"Registry of {town}.\n"]
    lines += [f"item {i:03d}: the {thing}, kept by {owner} on shelf {shelf}.\n" for i, thing, owner, shelf in items]
    lines.append("\nQuestions.\n")
    for _ in range(max(2, n_items // 3)):
        i, thing, owner, shelf = rng.choice(items)
        if rng.random() < 0.5:
            lines.append(f"Who keeps item {i:03d}? {owner}.\n")
        else:
            lines.append(f"Which shelf holds item {i:03d}? Shelf {shelf}.\n")
    return "".join(lines)


def _copy(rng: random.Random, target: int) -> str:
    n_words = max(8, target // 14)
    words = [rng.choice(_WORDS) for _ in range(n_words)]
    text = " ".join(words)
    return f"Remember these words:\n{text}\nNow repeat them:\n{text}\n"


def _sums(rng: random.Random, target: int) -> str:
    lines = ["Arithmetic practice.\n"]
    size = len(lines[0])
    while size < target:
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        line = f"{a} - {b} = {a - b}\n" if rng.random() < 0.3 else f"{a} + {b} = {a + b}\n"
        lines.append(line)
        size += len(line)
    return "".join(lines)


_KINDS = ((_story, 0.4), (_registry, 0.3), (_copy, 0.15), (_sums, 0.15))


def synthetic_documents(n_bytes: int, seed: int = 0) -> Iterator[str]:
    """Yield documents until their total length reaches ``n_bytes`` (ASCII, so bytes == characters)."""
    rng = random.Random(seed)
    makers, weights = zip(*_KINDS)
    total = 0
    while total < n_bytes:
        # log-uniform lengths from 300 B to 12 KB: mostly short documents, some that span a long sequence
        target = int(300 * (40 ** rng.random()))
        doc = rng.choices(makers, weights)[0](rng, target)
        total += len(doc)
        yield doc

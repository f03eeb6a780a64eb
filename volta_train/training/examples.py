"""The finetune recipe's examples: jsonl records read strictly, tokenised for the task and cached.

Data are tokenised once and cached (``data.cache_dir``) as ``.npz`` arrays read with ``allow_pickle=False``:
``ids`` (all examples concatenated), ``offsets``, ``prompt`` (leading tokens that are not targets), ``split``
(where a second text starts) and ``label``. :mod:`.example_batches` turns them into batches.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from . import data
from .data import ByteTokenizer, data_files

if TYPE_CHECKING:
    from .finetune_config import DataSection, FinetuneConfig

logger = logging.getLogger(__name__)


def _decode_line(raw: bytes, f: Path, n: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{f}:{n}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                         "data files must be UTF-8 text, one JSON object per line") from None


def read_records(spec: str) -> list[dict]:
    """The JSON objects of every file ``spec`` names, each tagged with ``_where`` (``file:line``).

    Refused with ``file:line``: lines that are not UTF-8 or not a JSON object; files with no record.
    """
    records = []
    for f in data_files(spec):
        before = len(records)
        with f.open("rb") as lines:
            for n, raw in enumerate(lines, 1):
                line = _decode_line(raw, f, n)
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{f}:{n}: not valid JSON ({e})") from None
                if not isinstance(record, dict):
                    raise ValueError(f"{f}:{n}: expected a JSON object, got {type(record).__name__}")
                record["_where"] = f"{f}:{n}"
                records.append(record)
        if len(records) == before:
            raise ValueError(f"{f}: no records (the file is empty); expected one JSON object per line")
    return records


def _field(record: dict, name: str, key: str, required: bool = True):
    if name not in record:
        if required:
            raise ValueError(f"{record['_where']}: no field {name!r} (set {key} to the field's name)")
        return None
    return record[name]


def _text(record: dict, name: str, key: str, required: bool = True) -> str | None:
    """A text field: a string (an optional field may also be absent or null; then None)."""
    value = _field(record, name, key, required)
    if value is None and not required:
        return None
    if not isinstance(value, str):
        shown = "null" if value is None else f"{type(value).__name__} {json.dumps(value)[:60]}"
        raise ValueError(f"{record['_where']}: field {name!r} is {shown}; expected a string")
    data.check_encodable(value, record["_where"], f"field {name!r}")
    return value


def _label_kind(value) -> str:
    if isinstance(value, bool) or value is None or not isinstance(value, (int, str)):
        return "bad"
    return "int" if isinstance(value, int) else "str"


def _check_label_types(records: list[dict], d: DataSection) -> str | None:
    """'int' or 'str': the one type every record's label has (refused: mixed types, null, floats, lists...)."""
    first: dict[str, dict] = {}
    for r in records:
        value = _field(r, d.label_field, "data.label_field")
        kind = _label_kind(value)
        if kind == "bad":
            raise ValueError(f"{r['_where']}: label {json.dumps(value)} ({'null' if value is None else type(value).__name__}"
                             "); expected a label name (string) or a class index (integer >= 0)")
        if kind == "int" and value < 0:
            raise ValueError(f"{r['_where']}: label {value} is negative; class indices start at 0")
        first.setdefault(kind, r)
        if len(first) > 1:
            a, b = first["int"], first["str"]
            raise ValueError(f"labels mix integers and strings: {a['_where']} has {a[d.label_field]!r}, "
                             f"{b['_where']} has {b[d.label_field]!r}; use one type throughout (names, or indices "
                             "into data.labels)")
    return next(iter(first), None)


def label_names(records: list[dict], d: DataSection) -> list[str]:
    """data.labels, or the labels of ``records``: indices 0..max when they are integers, sorted names otherwise."""
    if d.labels:
        return list(d.labels)
    if not records:
        raise ValueError("no records to infer the labels from; set data.labels")
    kind = _check_label_types(records, d)
    values = {r[d.label_field] for r in records}
    if kind == "int":
        return [str(i) for i in range(max(values) + 1)]
    return sorted(values)


def _label_id(record: dict, d: DataSection, names: list[str]) -> int:
    value = _field(record, d.label_field, "data.label_field")
    source = "data.labels" if d.labels else "the labels of data.train"
    if isinstance(value, int) and not isinstance(value, bool):
        if not 0 <= value < len(names):
            raise ValueError(f"{record['_where']}: label {value} outside 0..{len(names) - 1} (indices into {source} "
                             f"{names})")
        if str(value) in names and names.index(str(value)) != value:
            raise ValueError(f"{record['_where']}: label {value} is ambiguous: index {value} of {source} is "
                             f"{names[value]!r} but {str(value)!r} is also a name; write the name as a string")
        return value
    if value not in names:
        raise ValueError(f"{record['_where']}: label {value!r} is not one of {source} {names}")
    return names.index(value)


def _encode_classification(tokenizer, text: str, pair: str | None, max_length: int) -> tuple[list[int], int]:
    """(ids with the model's special tokens, index where the second segment starts or 0)."""
    if isinstance(tokenizer, ByteTokenizer):
        first = tokenizer.encode(text).tolist()
        second = tokenizer.encode(pair).tolist() if pair is not None else []
        budget = max_length - (3 if pair is not None else 2)
        if pair is not None:
            while len(first) + len(second) > budget:
                (first if len(first) >= len(second) else second).pop()
        else:
            first = first[:budget]
        ids = [tokenizer.cls_token_id, *first, tokenizer.sep_token_id]
        split = len(ids) if pair is not None else 0
        if pair is not None:
            ids += [*second, tokenizer.sep_token_id]
        return ids, split
    enc = tokenizer.tokenizer(text, pair, truncation=True, max_length=max_length, return_token_type_ids=True)
    ids = enc["input_ids"]
    types = enc.get("token_type_ids") or [0] * len(ids)
    split = types.index(1) if 1 in types else 0
    if pair is not None and split == 0:  # tokenizers without token types (RoBERTa): after the first </s></s>
        sep = tokenizer.sep_token_id
        positions = [i for i, t in enumerate(ids) if t == sep]
        split = positions[1] + 1 if len(positions) >= 2 else 0
    return ids, split


def _encode_text(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text).tolist()


def tokenize(records: list[dict], cfg: FinetuneConfig, tokenizer, names: list[str]) -> dict[str, np.ndarray]:
    """Arrays of the tokenised examples: ``ids`` (all examples concatenated), ``offsets``, ``prompt`` (tokens
    that are not targets at the start of each example), ``split`` (second segment start), ``label``."""
    d = cfg.data
    eos = tokenizer.eos_token_id
    ids, offsets, prompt, split, label = [], [0], [], [], []
    if d.format == "classification":
        _check_label_types(records, d)
    for r in records:
        p, s, y = 0, 0, -100
        if d.format == "text":
            text = _text(r, d.text_field, "data.text_field")
            example = _encode_text(tokenizer, text) + [eos]
        elif d.format == "instruction":
            inst = _text(r, d.instruction_field, "data.instruction_field")
            extra = _text(r, d.input_field, "data.input_field", required=False)
            response = _text(r, d.response_field, "data.response_field")
            template = d.prompt_template_with_input if extra else d.prompt_template
            try:
                head = template.format(instruction=inst, input=extra or "")
            except (KeyError, IndexError) as e:
                raise ValueError(f"data prompt template: unknown placeholder {e} (use {{instruction}}, {{input}})")
            head_ids = _encode_text(tokenizer, head)
            example = head_ids + _encode_text(tokenizer, response) + [eos]
            p = 0 if d.train_on_prompt else len(head_ids)
        else:
            text = _text(r, d.text_field, "data.text_field")
            pair = _text(r, d.text_pair_field, "data.text_pair_field") if d.text_pair_field else None
            example, s = _encode_classification(tokenizer, text, pair, d.max_length)
            y = _label_id(r, d, names)
        example = example[: d.max_length]
        ids += example
        offsets.append(len(ids))
        prompt.append(min(p, len(example)))
        split.append(s)
        label.append(y)
    dtype = np.uint32 if tokenizer.vocab_size > 65535 else np.uint16
    return {"ids": np.asarray(ids, dtype=dtype), "offsets": np.asarray(offsets, dtype=np.int64),
            "prompt": np.asarray(prompt, dtype=np.int32), "split": np.asarray(split, dtype=np.int32),
            "label": np.asarray(label, dtype=np.int64)}


def _cache_key(spec: str, cfg: FinetuneConfig, tokenizer, names: list[str]) -> str:
    d = cfg.data
    # v2: records checked strictly (null / non-string text, label types); caches of v1 are rebuilt
    h = hashlib.sha256(f"v2|{tokenizer.name}|{tokenizer.eos_token_id}|{cfg.task}|{names}".encode())
    for key in ("format", "max_length", "text_field", "text_pair_field", "label_field", "instruction_field",
                "input_field", "response_field", "prompt_template", "prompt_template_with_input", "train_on_prompt"):
        h.update(f"|{key}={getattr(d, key)!r}".encode())
    for f in data_files(spec):  # contents, not mtimes: an edit that keeps the mtime (cp -p, rsync -t) is seen
        h.update(f"|{f.resolve()}|{data.sha256_file(f)}".encode())
    return h.hexdigest()[:16]


def load_examples(spec: str, cfg: FinetuneConfig, tokenizer, names: list[str]) -> dict[str, np.ndarray]:
    """:func:`tokenize` of the records ``spec`` names, cached as an .npz (atomic write, read without pickle)."""
    key = _cache_key(spec, cfg, tokenizer, names)
    path = Path(cfg.data.cache_dir) / f"finetune-{Path(spec).stem or 'data'}-{key}.npz"

    def build() -> dict[str, np.ndarray]:
        arrays = tokenize(read_records(spec), cfg, tokenizer, names)
        logger.info("tokenised %s: %d examples, %s tokens -> %s", spec, arrays["offsets"].size - 1,
                    f"{arrays['ids'].size:,}", path)
        return arrays

    def read(p: Path) -> dict[str, np.ndarray]:
        with np.load(p, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}

    arrays = data.cached(path, build, lambda value, f: np.savez(f, **value), read, "tokenised dataset")
    return drop_targetless(arrays, cfg, spec)


def target_counts(arrays: dict[str, np.ndarray]) -> np.ndarray:
    """Tokens each causal-LM example is trained to predict: after its first token and its prompt."""
    lengths = np.diff(arrays["offsets"])
    return lengths - np.maximum(arrays["prompt"].astype(np.int64), 1)


def drop_targetless(arrays: dict[str, np.ndarray], cfg: FinetuneConfig, spec: str) -> dict[str, np.ndarray]:
    """Causal LM: the examples with at least one target token; the others are counted and reported (a batch of
    them only would have a loss of 0/0). None left is an error naming the cause."""
    if cfg.task != "causal_lm":
        return arrays
    n = arrays["offsets"].size - 1
    keep = np.flatnonzero(target_counts(arrays) > 0)
    if keep.size == n:
        return arrays
    why = (f"the prompt fills data.max_length {cfg.data.max_length}" if cfg.data.format == "instruction" and
           not cfg.data.train_on_prompt else "the text is empty")
    if keep.size == 0:
        raise ValueError(f"{spec}: none of its {n} examples has a token to learn ({why}); raise data.max_length, "
                         "shorten the prompts, or set data.train_on_prompt")
    logger.warning("%s: %d of %d examples have no token to learn (%s) and are left out", spec, n - keep.size, n, why)
    return select(arrays, keep.tolist())


def select(arrays: dict[str, np.ndarray], indices) -> dict[str, np.ndarray]:
    """The examples at ``indices``, as arrays of the same layout."""
    starts, ends = arrays["offsets"][:-1], arrays["offsets"][1:]
    pieces = [arrays["ids"][starts[i]:ends[i]] for i in indices]
    lengths = [p.size for p in pieces]
    return {"ids": np.concatenate(pieces) if pieces else arrays["ids"][:0],
            "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            **{k: arrays[k][list(indices)] for k in ("prompt", "split", "label")}}



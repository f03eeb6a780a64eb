"""Text in, fixed-length token sequences out: tokenizers, a token cache, packing and a resumable sampler.

* :class:`ByteTokenizer`: the 256 byte values plus one end-of-document token.
  Nothing to download or train; any UTF-8 text round-trips.
* :class:`HFTokenizer`: a HuggingFace tokenizer saved in a local directory
  (``tokenizer.json`` & co.), for models that come with their own vocabulary.
* :func:`load_tokens`: tokenises a corpus once (documents joined by EOS) into
  a ``.npy`` under a cache directory, keyed by what the tokens depend on,
  and memory-maps it on every later run.
* :class:`PackedDataset`: cuts a token stream into back-to-back sequences of
  ``seq_len`` tokens. ``documents=False``: GPT-2 style, tokens attend across the
  EOS between documents. ``documents=True``: each item also carries
  ``position_ids`` that restart at 0 at every document start (and at the start of
  the window), and the first token of each document is not a target, so no
  token attends to or is predicted from another document; transformers turns
  such ``position_ids`` into a block-diagonal causal mask (sdpa/eager) or the
  varlen path (flash-style implementations such as volta_train).
* :class:`ShardedBatchSampler`: the order of micro-batches as a pure function of
  (seed, micro-batch index, rank), so a resumed run reads exactly the batches
  the interrupted one would have read.

A corpus is ``"synthetic"`` (see :mod:`volta_train.training.corpus`), a
``.txt`` file (one document), a ``.jsonl`` file (one document per line, in its
``"text"`` field) or a directory of those (files in sorted order).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from . import fsio
from .corpus import GENERATOR_VERSION, synthetic_documents

logger = logging.getLogger(__name__)

SYNTHETIC = "synthetic"
CACHE_CHECK_SUFFIX = ".check.json"  # beside each cache file: its size and sha256
_TEXT_SUFFIXES = (".txt", ".jsonl")


class ByteTokenizer:
    """UTF-8 bytes as token ids 0-255, ``eos_token_id`` = 256 between documents, and three ids for fine-tuning.

    ``pad_token_id`` (257) fills padded batches (always masked out), ``cls_token_id`` (258) and
    ``sep_token_id`` (259) frame the input of a sequence classifier. Models get a vocabulary of
    ``padded_vocab(vocab_size)`` = 320 rows; ids the tokenizer never produces are never seen.
    """

    name = "bytes+eos"
    eos_token_id = 256
    pad_token_id = 257
    cls_token_id = 258
    sep_token_id = 259
    vocab_size = 260

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        out, doc = [], bytearray()
        for i in ids:
            if i == self.eos_token_id:
                out.append(doc.decode("utf-8", errors="replace"))
                doc = bytearray()
            elif 0 <= i < 256:
                doc.append(i)
            # special ids other than EOS, and ids >= 260 (padding of the model's vocabulary), decode to nothing
        out.append(doc.decode("utf-8", errors="replace"))
        return "<|eos|>".join(out)

    def to_hf(self):
        """The same tokenizer as a HuggingFace fast tokenizer, saved with byte-tokenizer models.

        ``AutoTokenizer.from_pretrained`` of a saved model directory then loads it: text encodes to its UTF-8
        bytes (ids 0-255) and decodes back; ``<|eos|>``, ``<|pad|>``, ``<|cls|>``, ``<|sep|>`` are ids 256-259.
        """
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        chars = _byte_chars()
        backend = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.decoder = decoders.ByteLevel()
        specials = dict(eos_token="<|eos|>", pad_token="<|pad|>", cls_token="<|cls|>", sep_token="<|sep|>")
        backend.add_special_tokens([AddedToken(t, special=True) for t in specials.values()])
        tok = PreTrainedTokenizerFast(tokenizer_object=backend, model_max_length=2**31 - 1, **specials)
        ids = (tok.eos_token_id, tok.pad_token_id, tok.cls_token_id, tok.sep_token_id)
        if ids != (self.eos_token_id, self.pad_token_id, self.cls_token_id, self.sep_token_id):
            raise RuntimeError(f"byte tokenizer export: special ids {ids}, expected 256-259")
        return tok


def _byte_chars() -> dict[int, str]:
    """Byte -> printable character, the byte-level alphabet of ``tokenizers``' ByteLevel pre-tokenizer: printable
    Latin-1 bytes stand for themselves, the other bytes for the characters from U+0100 on, in order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    chars, shifted = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(0x100 + shifted)
            shifted += 1
    return chars


def saveable_tokenizer(tokenizer):
    """The HuggingFace tokenizer to save with a model: an :class:`HFTokenizer`'s own, a ByteTokenizer's export."""
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.to_hf()
    return getattr(tokenizer, "tokenizer", None)


class HFTokenizer:
    """A HuggingFace tokenizer from a local directory (nothing is downloaded), with the ByteTokenizer interface.

    ``eos_token_id`` is the tokenizer's EOS, else its SEP (BERT-style vocabularies); ``pad_token_id``
    its PAD, else the EOS. ``name`` hashes the tokenizer files, so that token caches follow the vocabulary.
    """

    def __init__(self, path: str | os.PathLike):
        from transformers import AutoTokenizer

        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"tokenizer directory {str(path)!r} does not exist")
        accepted = ("expected a HuggingFace tokenizer directory: tokenizer.json, or vocab.json + merges.txt, "
                    "vocab.txt, tokenizer.model, with tokenizer_config.json")
        if not any(f.is_file() for f in path.iterdir()):
            raise ValueError(f"tokenizer directory {path} is empty; {accepted}")
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as e:  # noqa: BLE001 - transformers raises many kinds; re-raised naming the directory
            detail = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            raise ValueError(f"tokenizer directory {path}: cannot be loaded ({detail}); {accepted}") from e
        tok = self.tokenizer
        h = hashlib.sha256()
        for f in sorted(path.iterdir()):
            if f.is_file() and ("token" in f.name or f.suffix in (".txt", ".model") or f.name == "merges.txt"):
                h.update(f.name.encode() + b"|" + f.read_bytes())
        self.name = f"hf-{h.hexdigest()[:12]}"
        self.eos_token_id = tok.eos_token_id if tok.eos_token_id is not None else tok.sep_token_id
        if self.eos_token_id is None:
            raise ValueError(f"tokenizer {path} has neither an EOS nor a SEP token to separate documents")
        self.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else self.eos_token_id
        self.cls_token_id = tok.cls_token_id if tok.cls_token_id is not None else tok.bos_token_id
        self.sep_token_id = tok.sep_token_id if tok.sep_token_id is not None else self.eos_token_id
        self.vocab_size = len(tok)

    def encode(self, text: str) -> np.ndarray:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return np.asarray(ids, dtype=np.uint32 if self.vocab_size > 65535 else np.uint16)

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids])


def load_tokenizer(spec: str | None):
    """``"bytes"`` (or None): :class:`ByteTokenizer`; otherwise a local HuggingFace tokenizer directory."""
    if spec in (None, "", "bytes"):
        return ByteTokenizer()
    return HFTokenizer(spec)


def _source_files(path: Path) -> list[Path]:
    if path.is_file():
        if path.stat().st_size == 0:
            raise ValueError(f"data file {path} is empty (0 bytes): give a file that holds text, or {SYNTHETIC!r}")
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in _TEXT_SUFFIXES)
        if files:
            return files
        raise FileNotFoundError(f"no {' or '.join(_TEXT_SUFFIXES)} files under {path}")
    raise FileNotFoundError(f"data source {str(path)!r} is neither {SYNTHETIC!r} nor an existing file or directory")


def _not_utf8(f: Path, n: int, raw: bytes, e: UnicodeDecodeError) -> ValueError:
    return ValueError(f"{f}:{n}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); corpus files "
                      "must be UTF-8 text")


def check_encodable(text: str, where: str, what: str) -> None:
    """ValueError naming ``where`` (file:line) when ``text`` holds a lone surrogate (a JSON ``\\ud83d`` escape without
    its pair), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        raise ValueError(f"{where}: {what} holds a lone surrogate \\u{code:04x} at character {e.start + 1} "
                         "(a \\uD800-\\uDFFF escape without its pair), which is not text; write the character "
                         "itself or its full surrogate pair") from None


def _file_documents(files: list[Path]):
    """Documents of .txt (one per file) and .jsonl files (one per line, its string "text"); errors say file:line."""
    for f in files:
        if f.suffix == ".jsonl":
            with f.open("rb") as lines:
                for n, raw in enumerate(lines, 1):
                    try:
                        line = raw.decode("utf-8")
                    except UnicodeDecodeError as e:
                        raise _not_utf8(f, n, raw, e) from None
                    if line.strip():
                        try:
                            text = json.loads(line)["text"]
                        except (json.JSONDecodeError, KeyError, TypeError) as e:
                            raise ValueError(f"{f}:{n}: expected a JSON object with a 'text' field ({e})") from e
                        if not isinstance(text, str):
                            raise ValueError(f"{f}:{n}: 'text' is {'null' if text is None else type(text).__name__}; "
                                             "expected a string")
                        check_encodable(text, f"{f}:{n}", "'text'")
                        yield text
        else:
            raw = f.read_bytes()
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError as e:
                line_start = raw.rfind(b"\n", 0, e.start) + 1
                n = raw.count(b"\n", 0, e.start) + 1
                line = raw[line_start:]
                raise _not_utf8(f, n, line, UnicodeDecodeError(e.encoding, e.object, e.start - line_start,
                                                               e.end - line_start, e.reason)) from None


def corpus_key(source: str, tokenizer, synthetic_bytes: int = 0, seed: int = 0) -> tuple[str, str]:
    """(a short human-readable name, a hash of everything the tokens depend on): for files, their paths and the
    sha256 of their contents (not their mtimes, which ``cp -p``, ``rsync -t`` or ``tar x`` keep across an edit)."""
    h = hashlib.sha256(f"{tokenizer.name}|{tokenizer.eos_token_id}".encode())
    if source == SYNTHETIC:
        h.update(f"|synthetic|v{GENERATOR_VERSION}|{synthetic_bytes}|{seed}".encode())
        return f"synthetic-{synthetic_bytes / 1e6:g}MB-seed{seed}", h.hexdigest()[:16]
    for f in _source_files(Path(source)):
        h.update(f"|{f.resolve()}|{sha256_file(f)}".encode())
    return Path(source).stem or "corpus", h.hexdigest()[:16]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def cache_check_path(path: Path) -> Path:
    return path.with_name(path.name + CACHE_CHECK_SUFFIX)


def cache_problem(path: Path) -> str | None:
    """What is wrong with cache file ``path`` against its check file (size and sha256), or None."""
    check = cache_check_path(path)
    try:
        expected = json.loads(check.read_text(encoding="utf-8"))
        size, digest = int(expected["bytes"]), str(expected["sha256"])
    except FileNotFoundError:
        return f"{check.name} is missing (an interrupted write, or a cache from an older version)"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{check} is unreadable ({type(e).__name__}: {e})"
    actual = path.stat().st_size
    if actual != size:
        return f"{actual:,} bytes, {check.name} says {size:,} (truncated or overwritten)"
    if sha256_file(path) != digest:
        return f"its contents differ from the sha256 in {check.name} (corrupted)"
    return None


def cached(path: Path, build: Callable[[], object], save: Callable[[object, object], None],
           read: Callable[[Path], object], what: str = "token cache"):
    """``read(path)`` when ``path`` is whole (:func:`cache_problem`); otherwise ``build()``, written with
    ``save(value, file)`` through :func:`fsio.atomic_file` (nothing is left on a write error, which names the
    path and the free space) and a check file, then read back. A damaged file is rebuilt with a warning naming it."""
    path = Path(path)
    fsio.remove_stale_temporaries(path)
    if path.exists():
        problem = cache_problem(path)
        if problem is None:
            try:
                return read(path)
            except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
                problem = f"unreadable ({type(e).__name__}: {str(e)[:200]})"
        logger.warning("%s %s is damaged (%s): rebuilding it", what, path, problem)
    value = build()
    with fsio.writing(path, f"the {what}"):
        path.parent.mkdir(parents=True, exist_ok=True)
    with fsio.atomic_file(path, f"the {what}") as f:
        save(value, f)
    check = json.dumps({"bytes": path.stat().st_size, "sha256": sha256_file(path)}) + "\n"
    fsio.write_text_atomic(cache_check_path(path), check)
    return read(path)


def load_tokens(
    source: str,
    cache_dir: str | os.PathLike,
    tokenizer,
    synthetic_bytes: int = 0,
    seed: int = 0,
) -> np.ndarray:
    """The corpus as one token stream (each document followed by EOS), memory-mapped from the cache.

    uint16 for vocabularies up to 65,536 ids, uint32 above.
    The first call for a given corpus tokenises it and writes ``<cache_dir>/<name>-<hash>.npy`` (:func:`cached`:
    atomically, with a size and sha256 check file), so processes sharing a cache directory never read a
    half-written file, and a damaged file is rebuilt.
    """
    name, key = corpus_key(source, tokenizer, synthetic_bytes, seed)
    path = Path(cache_dir) / f"{name}-{key}.npy"
    built = []

    def build() -> np.ndarray:
        if source == SYNTHETIC:
            docs = synthetic_documents(synthetic_bytes, seed)
        else:
            docs = _file_documents(_source_files(Path(source)))
        dtype = np.uint16 if tokenizer.vocab_size <= 65536 else np.uint32
        eos = np.array([tokenizer.eos_token_id], dtype=dtype)
        pieces = []
        for doc in docs:
            pieces += [tokenizer.encode(doc).astype(dtype, copy=False), eos]
        if not any(piece.size for piece in pieces[::2]):
            raise ValueError(f"data source {source} holds no text (its files are empty or hold only blank lines)")
        built.append(True)
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype)

    tokens = cached(path, build, lambda value, f: np.save(f, value), lambda p: np.load(p, mmap_mode="r"))
    if built:
        logger.info("tokenised %s: %s tokens -> %s", source, f"{tokens.size:,}", path)
    logger.info("corpus %s: %s tokens (cache %s)", source, f"{tokens.size:,}", path)
    return tokens


def split_tokens(tokens: np.ndarray, val_fraction: float, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """The last ``val_fraction`` of the stream (at least one sequence when > 0) is held out for validation."""
    n_val = 0
    if val_fraction > 0:
        n_val = max(int(tokens.size * val_fraction), seq_len)
    if tokens.size - n_val < seq_len:
        raise ValueError(
            f"the corpus has {tokens.size:,} tokens: too few for one training sequence of {seq_len} "
            f"plus validation ({val_fraction:.0%}); give more data or a shorter seq_len"
        )
    return tokens[: tokens.size - n_val], tokens[tokens.size - n_val :]


def document_positions(window: np.ndarray, eos_token_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(position_ids, starts) of a window of a packed stream: positions restart at 0 at the window start and
    after every EOS; ``starts`` is True where a document begins (index 0 included)."""
    n = window.shape[0]
    starts = np.zeros(n, dtype=bool)
    starts[0] = True
    starts[1:] = window[:-1] == eos_token_id
    idx = np.arange(n, dtype=np.int64)
    last_start = np.maximum.accumulate(np.where(starts, idx, 0))
    return idx - last_start, starts


class PackedDataset(Dataset):
    """Back-to-back ``seq_len``-token windows of a token stream (the remainder is dropped).

    Items are ``{"input_ids", "labels"}`` int64 tensors; labels equal the inputs
    because HuggingFace causal-LM models shift them internally.

    With ``documents=True`` items also hold ``position_ids`` restarting at 0 at the window
    start and after each EOS, and ``labels`` are -100 at each document's first token (the
    previous document's EOS does not learn to predict it): training then never
    crosses a document boundary, provided the attention honours ``position_ids``
    (see :func:`volta_train.training.attention_choice.packed_documents_supported`).
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, documents: bool = False, eos_token_id: int | None = None):
        if documents and eos_token_id is None:
            raise ValueError("documents=True needs the eos_token_id that separates documents")
        self.tokens = tokens
        self.seq_len = seq_len
        self.documents = documents
        self.eos_token_id = eos_token_id

    def __len__(self) -> int:
        return self.tokens.size // self.seq_len

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        window = np.asarray(self.tokens[i * self.seq_len : (i + 1) * self.seq_len])
        ids = torch.from_numpy(window.astype(np.int64))
        if not self.documents:
            return {"input_ids": ids, "labels": ids}
        positions, starts = document_positions(window, self.eos_token_id)
        labels = ids.clone()
        starts[0] = False  # the window's first token is never a target anyway
        labels[torch.from_numpy(starts)] = -100
        return {"input_ids": ids, "labels": labels, "position_ids": torch.from_numpy(positions)}


class ShardedBatchSampler:
    """Micro-batches of dataset indices for one process, as a pure function of the micro-batch number.

    Micro-batch ``m`` of epoch ``e = m // batches_per_epoch`` is slice ``rank`` of the ``m``-th group of
    ``batch_size * num_replicas`` indices of the permutation drawn from ``seed + e`` (or of
    ``range(n)`` with ``shuffle=False``); the last incomplete group of an epoch is dropped. Iterating
    starts at micro-batch ``start`` and never ends: a resumed run passes the number of micro-batches
    already consumed and reads exactly what the interrupted run would have read next.
    """

    def __init__(self, n_items: int, batch_size: int, num_replicas: int = 1, rank: int = 0, seed: int = 0,
                 shuffle: bool = True, start: int = 0):
        self.n_items, self.batch_size, self.num_replicas, self.rank = n_items, batch_size, num_replicas, rank
        self.seed, self.shuffle, self.start = seed, shuffle, start
        self.batches_per_epoch = n_items // (batch_size * num_replicas)
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"{n_items} sequences: fewer than one batch of {batch_size} on each of {num_replicas} process(es)"
            )
        self._epoch, self._perm = -1, None

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            if self.shuffle:
                gen = torch.Generator().manual_seed(self.seed + epoch)
                self._perm = torch.randperm(self.n_items, generator=gen)
            else:
                self._perm = torch.arange(self.n_items)
            self._epoch = epoch
        return self._perm

    def batch(self, m: int) -> list[int]:
        epoch, k = divmod(m, self.batches_per_epoch)
        group = self.batch_size * self.num_replicas
        first = k * group + self.rank * self.batch_size
        return self._permutation(epoch)[first : first + self.batch_size].tolist()

    def __iter__(self):
        m = self.start
        while True:
            yield self.batch(m)
            m += 1


def micro_batches(dataset, sampler: ShardedBatchSampler, collate_fn=None, num_workers: int = 0,
                  pin_memory: bool = False):
    """An endless iterator of collated micro-batches (CPU tensors) in ``sampler``'s order."""
    from torch.utils.data import DataLoader

    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate_fn, num_workers=num_workers,
                        pin_memory=pin_memory, persistent_workers=False)
    return iter(loader)


def eval_indices(n_items: int, batch_size: int, n_batches: int, num_replicas: int = 1,
                 rank: int = 0) -> list[list[int]]:
    """The fixed validation micro-batches of one process: the first ``n_batches * batch_size * num_replicas``
    items, split between processes (fewer batches when the set is smaller)."""
    per_group = batch_size * num_replicas
    groups = min(n_batches, n_items // per_group)
    return [list(range(g * per_group + rank * batch_size, g * per_group + (rank + 1) * batch_size))
            for g in range(groups)]


def forever(loader):
    """Iterate a DataLoader epoch after epoch, calling ``set_epoch`` so each epoch is reshuffled."""
    epoch = 0
    while True:
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        yield from loader
        epoch += 1

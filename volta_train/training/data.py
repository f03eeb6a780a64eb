"""Text in, fixed-length token sequences out: a byte tokenizer, a token cache and packing.

* :class:`ByteTokenizer`: the 256 byte values plus one end-of-document token.
  Nothing to download or train; any UTF-8 text round-trips.
* :func:`load_tokens`: tokenises a corpus once (documents joined by EOS) into
  a uint16 ``.npy`` under a cache directory, keyed by what the tokens depend on,
  and memory-maps it on every later run.
* :class:`PackedDataset`: cuts a token stream into back-to-back sequences of
  ``seq_len`` tokens (documents packed across sequence boundaries, GPT-2 style:
  tokens attend across the EOS between documents).

A corpus is ``"synthetic"`` (see :mod:`volta_train.training.corpus`), a
``.txt`` file (one document), a ``.jsonl`` file (one document per line, in its
``"text"`` field) or a directory of those (files in sorted order).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from .corpus import GENERATOR_VERSION, synthetic_documents

logger = logging.getLogger(__name__)

SYNTHETIC = "synthetic"
_TEXT_SUFFIXES = (".txt", ".jsonl")


class ByteTokenizer:
    """UTF-8 bytes as token ids 0-255, and ``eos_token_id`` = 256 between documents."""

    name = "bytes+eos"
    eos_token_id = 256
    vocab_size = 257

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
            # ids >= 257 (padding of the model's vocabulary) decode to nothing
        out.append(doc.decode("utf-8", errors="replace"))
        return "<|eos|>".join(out)


def _source_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in _TEXT_SUFFIXES)
        if files:
            return files
        raise FileNotFoundError(f"no {' or '.join(_TEXT_SUFFIXES)} files under {path}")
    raise FileNotFoundError(f"data source {str(path)!r} is neither {SYNTHETIC!r} nor an existing file or directory")


def _file_documents(files: list[Path]):
    for f in files:
        if f.suffix == ".jsonl":
            with f.open(encoding="utf-8") as lines:
                for n, line in enumerate(lines, 1):
                    if line.strip():
                        try:
                            yield json.loads(line)["text"]
                        except (json.JSONDecodeError, KeyError, TypeError) as e:
                            raise ValueError(f"{f}:{n}: expected a JSON object with a 'text' field ({e})") from e
        else:
            yield f.read_text(encoding="utf-8")


def corpus_key(source: str, tokenizer: ByteTokenizer, synthetic_bytes: int = 0, seed: int = 0) -> tuple[str, str]:
    """(a short human-readable name, a hash of everything the tokens depend on)."""
    h = hashlib.sha256(f"{tokenizer.name}|{tokenizer.eos_token_id}".encode())
    if source == SYNTHETIC:
        h.update(f"|synthetic|v{GENERATOR_VERSION}|{synthetic_bytes}|{seed}".encode())
        return f"synthetic-{synthetic_bytes / 1e6:g}MB-seed{seed}", h.hexdigest()[:16]
    for f in _source_files(Path(source)):
        st = f.stat()
        h.update(f"|{f.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    return Path(source).stem or "corpus", h.hexdigest()[:16]


def load_tokens(
    source: str,
    cache_dir: str | os.PathLike,
    tokenizer: ByteTokenizer,
    synthetic_bytes: int = 0,
    seed: int = 0,
) -> np.ndarray:
    """The corpus as one uint16 token stream (each document followed by EOS), memory-mapped from the cache.

    The first call for a given corpus tokenises it and writes ``<cache_dir>/<name>-<hash>.npy``
    atomically, so processes sharing a cache directory never read a half-written file.
    """
    name, key = corpus_key(source, tokenizer, synthetic_bytes, seed)
    path = Path(cache_dir) / f"{name}-{key}.npy"
    if not path.exists():
        if source == SYNTHETIC:
            docs = synthetic_documents(synthetic_bytes, seed)
        else:
            docs = _file_documents(_source_files(Path(source)))
        eos = np.array([tokenizer.eos_token_id], dtype=np.uint16)
        pieces = []
        for doc in docs:
            pieces += [tokenizer.encode(doc), eos]
        tokens = np.concatenate(pieces) if pieces else np.zeros(0, np.uint16)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            np.save(f, tokens)
        os.replace(tmp, path)
        logger.info("tokenised %s: %s tokens -> %s", source, f"{tokens.size:,}", path)
    tokens = np.load(path, mmap_mode="r")
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


class PackedDataset(Dataset):
    """Back-to-back ``seq_len``-token windows of a token stream (the remainder is dropped).

    Items are ``{"input_ids", "labels"}`` int64 tensors; labels equal the inputs
    because HuggingFace causal-LM models shift them internally.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return self.tokens.size // self.seq_len

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        window = self.tokens[i * self.seq_len : (i + 1) * self.seq_len]
        ids = torch.from_numpy(window.astype(np.int64))
        return {"input_ids": ids, "labels": ids}


def forever(loader):
    """Iterate a DataLoader epoch after epoch, calling ``set_epoch`` so each epoch is reshuffled."""
    epoch = 0
    while True:
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        yield from loader
        epoch += 1

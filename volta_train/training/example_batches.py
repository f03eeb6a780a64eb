"""The finetune recipe's batches: one padded example per row, or causal-LM examples packed into rows.

Batches are padded to their longest row with an ``attention_mask`` (the patched attention then runs the varlen
kernel), or, with ``data.packing: true`` (causal LM), examples are packed into ``max_length`` rows with
``position_ids`` restarting at each example, so none attends to another (and a row can be split over a
sequence-parallel group).
"""

from __future__ import annotations

import numpy as np
import torch

class ExampleDataset(torch.utils.data.Dataset):
    """One tokenised example per item: ``input_ids``, ``labels`` (targets or -100, or the class), ``split``."""

    def __init__(self, arrays: dict[str, np.ndarray], task: str):
        self.a, self.task = arrays, task

    def __len__(self) -> int:
        return self.a["offsets"].size - 1

    def __getitem__(self, i: int) -> dict:
        a = self.a
        ids = torch.from_numpy(a["ids"][a["offsets"][i]:a["offsets"][i + 1]].astype(np.int64))
        if self.task == "classification":
            return {"input_ids": ids, "labels": int(a["label"][i]), "split": int(a["split"][i])}
        labels = ids.clone()
        labels[: int(a["prompt"][i])] = -100
        return {"input_ids": ids, "labels": labels}


class PackedExamples(torch.utils.data.Dataset):
    """Causal-LM examples packed in order into rows of ``max_length`` tokens (first fit of the next example).

    Each row's ``position_ids`` restart at 0 at every example; the tail of a row that no example
    fills is padding, given positions of its own and no targets, so no token attends across
    examples and no attention mask is needed.
    """

    def __init__(self, arrays: dict[str, np.ndarray], max_length: int, pad_token_id: int):
        self.a, self.max_length, self.pad = arrays, max_length, pad_token_id
        lengths = np.diff(arrays["offsets"])
        self.rows, row, used = [], [], 0
        for i, n in enumerate(lengths.tolist()):
            if used + n > max_length and row:
                self.rows.append(row)
                row, used = [], 0
            row.append(i)
            used += n
        if row:
            self.rows.append(row)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, r: int) -> dict:
        a = self.a
        ids, labels, positions = [], [], []
        for i in self.rows[r]:
            x = a["ids"][a["offsets"][i]:a["offsets"][i + 1]].astype(np.int64).tolist()
            y = list(x)
            y[0] = -100  # the previous example's last token does not predict this one's first
            for j in range(min(int(a["prompt"][i]), len(y))):
                y[j] = -100
            ids += x
            labels += y
            positions += list(range(len(x)))
        pad = self.max_length - len(ids)
        ids += [self.pad] * pad
        labels += [-100] * pad
        positions += list(range(pad))
        return {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels), "position_ids": torch.tensor(positions)}


class Collator:
    """Pads a list of :class:`ExampleDataset` items to the longest (right padding, ``attention_mask``)."""

    def __init__(self, pad_token_id: int, task: str, token_types: bool):
        self.pad, self.task, self.token_types = pad_token_id, task, token_types

    def __call__(self, items: list[dict]) -> dict[str, torch.Tensor]:
        if "position_ids" in items[0]:  # packed rows: all of max_length already
            return torch.utils.data.default_collate(items)
        length = max(item["input_ids"].numel() for item in items)
        n = len(items)
        ids = torch.full((n, length), self.pad, dtype=torch.long)
        mask = torch.zeros((n, length), dtype=torch.long)
        out = {"input_ids": ids, "attention_mask": mask}
        if self.task == "classification":
            out["labels"] = torch.tensor([item["labels"] for item in items], dtype=torch.long)
            if self.token_types:
                out["token_type_ids"] = torch.zeros((n, length), dtype=torch.long)
        else:
            out["labels"] = torch.full((n, length), -100, dtype=torch.long)
        for row, item in enumerate(items):
            k = item["input_ids"].numel()
            ids[row, :k] = item["input_ids"]
            mask[row, :k] = 1
            if self.task != "classification":
                out["labels"][row, :k] = item["labels"]
            elif self.token_types and item["split"]:
                out["token_type_ids"][row, item["split"]:k] = 1
        return out



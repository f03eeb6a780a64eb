"""pytest plugin that runs flash-attn's own tests/test_flash_attn.py against volta_train (lab/flash_attn_suite/run.sh).

It serves volta_train as ``flash_attn`` (``install_flash_attn()``) before the test file is imported, keeps a
deterministic random sample of each test function's cases (``FA_SUITE_PER_FUNCTION``, seed ``FA_SUITE_SEED``), and
writes per-function pass/fail/skip counts, the failures and the skip reasons to ``$FA_SUITE_OUT``.
"""

from __future__ import annotations

import collections
import json
import os
import random
import time

import volta_train

volta_train.install_flash_attn()

PER_FUNCTION = int(os.environ.get("FA_SUITE_PER_FUNCTION", "120"))
SEED = int(os.environ.get("FA_SUITE_SEED", "0"))
OUT = os.environ.get("FA_SUITE_OUT", "out/flash_attn_suite")
BUDGET_S = float(os.environ.get("FA_SUITE_BUDGET_S", "0"))  # stop starting cases after this long (0: no limit)

_counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
_failures: list[dict] = []
_outcomes: dict[str, str] = {}
_skips: collections.Counter = collections.Counter()
_collected: collections.Counter = collections.Counter()
_kept: collections.Counter = collections.Counter()
_session = None
_began = time.time()


def _function(item_or_report) -> str:
    return item_or_report.nodeid.split("::")[-1].split("[")[0]


def pytest_collection_modifyitems(session, config, items):
    global _session
    _session = session
    groups: dict[str, list] = collections.defaultdict(list)
    for item in items:
        groups[_function(item)].append(item)
    rng = random.Random(SEED)
    kept = []
    for name in sorted(groups):
        _collected[name] = len(groups[name])
        chosen = groups[name] if len(groups[name]) <= PER_FUNCTION else rng.sample(groups[name], PER_FUNCTION)
        _kept[name] = len(chosen)
        kept.extend(chosen)
    rng.shuffle(kept)  # functions interleaved, so that a time budget cuts each of them alike
    items[:] = kept


def pytest_runtest_logreport(report):
    if BUDGET_S and _session is not None and time.time() - _began > BUDGET_S:
        _session.shouldstop = f"FA_SUITE_BUDGET_S={BUDGET_S:g} s spent"
    name = report.nodeid.split("::")[-1].split("[")[0]
    if report.when == "call" or report.skipped or (report.failed and report.when != "call"):
        outcome = "skipped" if report.skipped else report.outcome
        _outcomes[report.nodeid.split("::")[-1]] = outcome
        _counts[name][outcome] += 1
        if report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            _skips[f"{name}: {reason}"] += 1
        elif report.failed:
            message = str(report.longrepr).strip().splitlines()
            _failures.append({"case": report.nodeid.split("::")[-1], "when": report.when,
                              "error": [line for line in message if line.startswith("E ")][:6]})


def pytest_sessionfinish(session, exitstatus):
    os.makedirs(OUT, exist_ok=True)
    rows = []
    for name in sorted(_collected):
        c = _counts.get(name, collections.Counter())
        rows.append({"function": name, "cases": _collected[name], "sampled": _kept[name], "run": sum(c.values()),
                     "passed": c["passed"], "failed": c["failed"], "skipped": c["skipped"]})
    record = {"per_function": PER_FUNCTION, "seed": SEED, "seconds": round(time.time() - _began),
              "rows": rows, "outcomes": _outcomes, "failures": _failures, "skips": dict(_skips.most_common())}
    with open(os.path.join(OUT, "summary.json"), "w") as f:
        json.dump(record, f, indent=1)
    lines = [f"flash-attn 2.8.3 tests/test_flash_attn.py through volta_train.install_flash_attn(): up to "
             f"{PER_FUNCTION} sampled cases per function (seed {SEED}), {record['seconds']} s", "",
             "| function | cases in the suite | sampled | run | passed | failed | skipped |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['function']} | {r['cases']} | {r['sampled']} | {r['run']} | {r['passed']} | {r['failed']} | {r['skipped']} |")
    total = {k: sum(r[k] for r in rows) for k in ("cases", "sampled", "run", "passed", "failed", "skipped")}
    lines.append(f"| **all** | {total['cases']} | {total['sampled']} | {total['run']} | {total['passed']} | {total['failed']} | "
                 f"{total['skipped']} |")
    lines += ["", "Skip reasons (flash-attn's own conditions):", ""]
    lines += [f"- {count} x {reason}" for reason, count in _skips.most_common()]
    with open(os.path.join(OUT, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")

"""The census of volta_train.patch() (tests/hf_census.py) in the suite: a new ``wrong`` or ``crash`` fails.

Every text model type the installed transformers declares flash-attention capable is a test; the recorded results
are volta_train/integrations/hf/census.json (``python tests/hf_census.py`` rewrites it and docs/hf_integration.md).
All of them run under ``-m slow``; by default a deterministic sample runs: every type the census did not find ``ok``
and every SAMPLE_EVERY-th of the others, in name order, to keep the suite within its CPU budget.
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

import hf_census  # noqa: E402

from volta_train.integrations import hf  # noqa: E402

SAMPLE_EVERY = 8
RECORDED = hf.census()
SAME_RELEASE = RECORDED["transformers"] == transformers.__version__
TYPES = hf_census.census_model_types()


def _params():
    results = RECORDED["results"]
    ok = [t for t in TYPES if results.get(t, [None])[0] == "ok"]
    sampled = set(ok[::SAMPLE_EVERY]) | {t for t in TYPES if t not in ok}
    return [t if t in sampled else pytest.param(t, marks=pytest.mark.slow) for t in TYPES]


def test_census_covers_the_installed_release():
    if not SAME_RELEASE:
        pytest.skip(f"census.json is of transformers {RECORDED['transformers']}; {transformers.__version__} is "
                    "installed (python tests/hf_census.py records it)")
    assert sorted(RECORDED["results"]) == sorted(TYPES)


@pytest.mark.parametrize("model_type", _params())
def test_no_new_wrong_or_crash(model_type):
    result = hf_census.check(model_type)
    recorded = RECORDED["results"].get(model_type, [None, ""])[0]
    if result.status in ("wrong", "crash") and result.status != recorded:
        pytest.fail(f"{model_type}: {result.status} (recorded: {recorded}): {result.detail}")
    if SAME_RELEASE and recorded == "ok":
        assert result.status == "ok", f"{model_type} was ok, now {result.status}: {result.detail}"

"""The census of volta_train.patch() (tests/hf_census.py) in the suite: a new ``wrong`` or ``crash`` fails.

Every text model type the installed transformers declares flash-attention capable is a test; the recorded results
are volta_train/integrations/hf/census.json (``python tests/hf_census.py`` rewrites it and docs/hf_integration.md).
The README's test command runs all of them (about a minute). ``-m "not slow"`` runs a deterministic sample: every
type the census did not find ``ok`` and every SAMPLE_EVERY-th of the others, in name order.
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


# Types whose float32 difference from eager exceeds the census's bounds while volta_train in float64 matches the
# float64 truth (docs/hf_integration.md, "Differences that are float32 rounding"): an integration bug would show here.
ROUNDING_ONLY = ["exaone4", "gemma4_text", "gemma4_unified_text", "higgs_audio_v2", "mobilebert", "nemotron_h"]


@pytest.mark.parametrize("model_type", [t if t == "exaone4" else pytest.param(t, marks=pytest.mark.slow)
                                        for t in ROUNDING_ONLY])
def test_float64_agrees_where_float32_differs(model_type):
    if model_type not in TYPES:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    differences = hf_census.float64_check(model_type)
    assert max(differences["volta_train float64"]) < 1e-10, differences


def test_gemma3n_text_padded_batch_matches_eager():
    """gemma3n_text's pad stream is zero but for attention: with eager's rows at the padded queries
    (integrations/hf/padded_rows.py) its gradients stay finite and match eager's."""
    if "gemma3n_text" not in TYPES:
        pytest.skip(f"transformers {transformers.__version__} has no gemma3n_text")
    result = hf_census.check("gemma3n_text")
    assert result.status == "ok", result

"""The census of volta_train.patch() (tests/support/hf_census.py) in the suite: a new ``wrong`` or ``crash`` fails.

Every text model type the installed transformers declares flash-attention capable is a test, whichever release is
installed; the recorded results are one table per release, volta_train/integrations/hf/census/<release>.json
(``python tests/support/hf_census.py`` writes the installed release's table and docs/hf_integration.md). On a release with no
table the nearest older table is the baseline: a type new in that release is checked like one the census never found
``ok``, and the types that came or went are reported.
The README's test command runs all of them (about a minute). ``-m "not slow"`` runs a deterministic sample: every
type the census did not find ``ok`` and every SAMPLE_EVERY-th of the others, in name order.
"""

from __future__ import annotations

import warnings

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
    added = sorted(set(TYPES) - set(RECORDED["results"]))
    gone = sorted(set(RECORDED["results"]) - set(TYPES))
    if SAME_RELEASE:
        assert (added, gone) == ([], []), f"transformers {transformers.__version__}: table out of date"
        return
    # Another release: nothing here is skipped (test_no_new_wrong_or_crash runs every new type), and what changed is
    # said, so a new release shows up in the report rather than passing unnoticed.
    warnings.warn(f"transformers {transformers.__version__} has no census table; compared with "
                  f"{RECORDED['transformers']}'s: {len(added)} new model types ({', '.join(added) or 'none'}), "
                  f"{len(gone)} gone ({', '.join(gone) or 'none'}); `python tests/support/hf_census.py` records its table")


def test_census_table_is_picked_for_the_installed_release():
    from packaging.version import Version

    recorded = hf.census_releases()
    installed = Version(transformers.__version__)
    older = [r for r in recorded if Version(r) <= installed]
    assert RECORDED["transformers"] == (older[-1] if older else recorded[0])
    for release in recorded:
        table = hf.census(release)
        assert table["transformers"] == release and table["results"], release
    with pytest.raises(ValueError, match=r"transformers_release='0\.0\.1': no census table .* recorded: "):
        hf.census("0.0.1")


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

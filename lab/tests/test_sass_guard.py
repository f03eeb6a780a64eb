"""sass_guard's comparison (no compile): kernels pair by key, or by variant name where a name expression was
respelled; a different code hash, a different instantiation or a kernel on one side only is a problem."""

import os

import sass_guard as guard


def _entry(text: str, mangled: str | None = None) -> dict:
    entry = {"text_sha256": text, "text_bytes": 8, "cubin_sha256": text + "-cubin"}
    if mangled is not None:
        entry["mangled"] = mangled
    return entry


def test_respelled_expression_pairs_by_variant_name(capsys):
    code = os.urandom(8).hex()
    before = {"sm_70/fwd_x/k<T<1>>": _entry(code), "sm_90/fwd_x/k<T<1>>": _entry(code)}
    after = {"sm_70/fwd_x/k<T<1, false>>": _entry(code, "_Z1k"), "sm_90/fwd_x/k<T<1>>": _entry(code, "_Z1k")}
    assert guard.compare(before, after) == 0
    assert "1 name expressions respelled" in capsys.readouterr().out


def test_changed_code_missing_kernels_and_other_instantiations_count():
    code, other = os.urandom(8).hex(), os.urandom(8).hex()
    before = {"sm_70/a/k<1>": _entry(code), "sm_70/b/k<2>": _entry(code), "sm_70/c/k<3>": _entry(code, "_Z1c")}
    after = {"sm_70/a/k<1>": _entry(other), "sm_70/d/k<4>": _entry(code), "sm_70/c/k<3>": _entry(code, "_Z2cc")}
    assert guard.compare(before, after) == 4  # a differs, b only before, d only after, c another instantiation

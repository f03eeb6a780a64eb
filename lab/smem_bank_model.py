#!/usr/bin/env python3
"""Offline shared-memory bank-conflict model of the sm_70 tiles (lab/bank_model.py; no GPU).

    python lab/smem_bank_model.py                       # predicted ld / st wavefronts per ideal, every kernel
    python lab/smem_bank_model.py --validate [--md F]   # against the Nsight Compute table (default: the H100 one)
    python lab/smem_bank_model.py --validate --code --md F   # a table measured on the code as it is now
    python lab/smem_bank_model.py --sites NAME          # per access site of the variants whose name contains NAME
    python lab/smem_bank_model.py --plain               # plain rows (before issue 16) -> the code's layouts

The workload is the profiled one (batch 1, 8 heads, seqlen 1024, non-causal). --validate compares instruction
counts, wavefronts and ideal wavefronts (wavefronts - bank conflicts) per launch row of the table and exits 1 when an
instruction or ideal count is off by more than --tol (the access sites or their counts are then wrong); wavefronts
themselves are reported, not checked (the counter adds 0-4% on conflict-free loads, see the model's docstring).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import bank_model as bm
from volta_train.kernels import tiles

ROOT = Path(__file__).resolve().parents[1]

DEFAULT_MD = ROOT / "lab" / "results" / "smem_conflicts_sm70_tiles_h100.md"
GOAL = 1.05


def sm70_variants() -> dict:
    """The sm_70 variants without soft-capping; the decoding kernels (SPLIT_KV) move K, V^T, Q and O
    through the forward's shared-memory tiles, so they are modelled as forward kernels of their tile."""
    variants = {}
    for v in tiles.shipped_variants(70):
        if "tile" in v.meta and not v.meta.get("softcap"):
            variants[v.name] = replace(v, meta={**v.meta, "pass": "fwd"}) if v.meta["pass"] == "decode" else v
    return variants


def predict(variant, layouts=None, plain=False) -> bm.Prediction:
    return bm.predict_variant(variant.meta, dq_atomic="_dqatomic" in variant.name, layouts=layouts, plain=plain)


def read_table(path: Path) -> list[dict]:
    """The full-attention rows of smem_conflicts.md: call, variant and the raw counts."""
    rows = []
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) < 15 or not cells[0].isdigit() or "_causal_" in cells[1]:
            continue
        try:
            n = [int(cells[i].replace(",", "")) for i in (3, 5, 7, 9, 11, 13)]
        except ValueError:
            continue
        rows.append({"call": cells[1], "variant": cells[2], "ld_inst": n[0], "ld_wf": n[1], "ld_ideal": n[1] - n[2],
                     "st_inst": n[3], "st_wf": n[4], "st_ideal": n[4] - n[5]})
    return rows


def validate(path: Path, tol: float, plain: bool = True) -> int:
    variants = sm70_variants()
    rows = [r for r in read_table(path) if r["variant"] in variants]
    if not rows:
        print(f"{path}: no rows of sm_70 variants")
        return 1
    cache, bad = {}, 0
    print("| variant | op | inst model/meas | ideal model/meas | wf model/meas | wf/ideal model | wf/ideal measured |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        # the committed table measured the code before the issue-16 layouts (plain rows); --code: the code's layouts
        p = cache.get(r["variant"]) or cache.setdefault(r["variant"], predict(variants[r["variant"]], plain=plain))
        for op in ("ld", "st"):
            t = p.totals(op)
            ri, rid, rw = t.inst / r[f"{op}_inst"], t.ideal / r[f"{op}_ideal"], t.wf / r[f"{op}_wf"]
            flag = abs(ri - 1) > tol or abs(rid - 1) > tol
            bad += flag
            print(f"| {r['variant']} | {op} | {ri:.4f} | {rid:.4f} | {rw:.3f} | {t.factor:.3f} | "
                  f"{r[f'{op}_wf'] / r[f'{op}_ideal']:.3f} |{' **count off**' if flag else ''}")
    print(f"\n{len(rows)} launches, {bad} op rows with an instruction or ideal count off by more than {tol:.1%}")
    return 1 if bad else 0


def show(variants: dict, needle: str | None, sites: bool, layouts_for=None, plain_too=False) -> None:
    for name, v in variants.items():
        if needle and needle not in name:
            continue
        p = predict(v)
        line = f"{name:64s} ld {p.totals('ld').factor:.3f}  st {p.totals('st').factor:.3f}"
        if plain_too:
            o = predict(v, plain=True)
            line = f"{name:64s} ld {o.totals('ld').factor:.3f}  st {o.totals('st').factor:.3f}  (plain rows) -> " \
                   f"ld {p.totals('ld').factor:.3f}  st {p.totals('st').factor:.3f}"
        if layouts_for is not None:
            lay = layouts_for(v)
            if lay:
                q = predict(v, lay)
                line += f"  ->  ld {q.totals('ld').factor:.3f}  st {q.totals('st').factor:.3f}"
        print(line)
        if sites:
            for site, c in p.sites.items():
                print(f"    {site:22s} {c.op} {8 * c.width:3d}-bit inst {c.inst:>10,} wf {c.wf:>11,} "
                      f"ideal {c.ideal:>11,} x{c.factor:.3f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--validate", action="store_true")
    ap.add_argument("--md", type=Path, default=DEFAULT_MD)
    ap.add_argument("--code", action="store_true",
                    help="--validate a table measured on the code as it is (default: plain rows, the committed table)")
    ap.add_argument("--tol", type=float, default=0.02, help="accepted relative error of instruction / ideal counts")
    ap.add_argument("--sites", metavar="NAME", help="per-site breakdown of the variants whose name contains NAME")
    ap.add_argument("--plain", action="store_true",
                    help="also the factors with plain rows (the layouts before issue 16) -> the code's")
    args = ap.parse_args(argv)
    if args.validate:
        return validate(args.md, args.tol, plain=not args.code)
    variants = sm70_variants()
    show(variants, args.sites, args.sites is not None, plain_too=args.plain)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Fingerprint the machine code of every shipped kernel, to show that a source change leaves the SASS untouched.

Compiles, with the local NVRTC (no GPU needed), every variant the dispatcher can launch:

- ``sm_70``: the sm_70 tile tables (``shipped_fwd_variants(70)`` + ``shipped_bwd_variants(70)``) for sm_70;
- ``sm_90``: the sm_80+ tile tables (``shipped_*_variants(90)``) for sm_90;
- ``sm70-tiles@sm_90``: the sm_70 tile tables compiled for sm_90 (the sm_90 build of the V100 shapes);
- with ``--decode``, also the decoding kernels, split combines and backward preprocess kernels
  (``shipped_decode_variants``, ``shipped_combine_variants`` and ``shipped_preprocess_variants``) in each group.

and writes a JSON mapping ``<group>/<variant name>/<name expression>`` to the sha256 of that kernel's executable
code (the bytes of the cubin's ``.text.<mangled name>`` ELF section), its mangled name and, for reference, the sha256
of the whole cubin. ``--compare BEFORE.json`` reports which kernels are identical and which differ; a variant whose
one name expression was respelled (the same instantiation written another way) is matched by its variant name.

    python lab/sass_guard.py --out /tmp/before.json
    # ... change csrc/ ...
    python lab/sass_guard.py --out /tmp/after.json --compare /tmp/before.json

Each program is compiled as the package compiles it, with the launch geometry the kernels export
(csrc/launch_geometry.cuh); only the kernels are fingerprinted. The compiles bypass the kernel cache (a stale entry
cannot hide a change); NVRTC releases the GIL, so ``--jobs`` threads compile in parallel.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# No stale or foreign cache is consulted (the compiles below call NVRTC directly; this covers any import-time use).
os.environ.setdefault("VOLTA_TRAIN_CACHE_DIR", tempfile.mkdtemp(prefix="volta_sass_guard_"))

try:
    from volta_train.kernels import tiles  # noqa: E402
except ImportError:  # a checkout from before the tile tables' module was named for them (the guard's baseline)
    from volta_train.kernels import configs as tiles  # noqa: E402
from volta_train.kernels.nvrtc import compile_program, find_nvrtc  # noqa: E402
from volta_train.kernels.variants import KernelVariant, csrc_dir  # noqa: E402

GROUPS = (("sm_70", 70, 70), ("sm_90", 90, 90), ("sm70-tiles@sm_90", 70, 90))  # (name, tile-table arch, target)


def elf_sections(image: bytes) -> dict[str, bytes]:
    """Section name -> contents of a cubin."""
    try:
        from volta_train.kernels.cubin import sections
    except ImportError:  # a checkout from before the package read cubins (the guard's baseline)
        return _elf_sections(image)
    return sections(image)


def _elf_sections(image: bytes) -> dict[str, bytes]:
    if image[:4] != b"\x7fELF" or image[4] != 2 or image[5] != 1:
        raise ValueError("not a little-endian ELF64 image")
    (shoff,) = struct.unpack_from("<Q", image, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", image, 0x3A)
    headers = []
    for index in range(shnum):
        name, kind, _flags, _addr, offset, size = struct.unpack_from("<IIQQQQ", image, shoff + index * shentsize)
        headers.append((name, kind, offset, size))
    _, _, names_offset, names_size = headers[shstrndx]
    names = image[names_offset : names_offset + names_size]
    sections = {}
    for name, kind, offset, size in headers:
        label = names[name : names.index(b"\0", name)].decode()
        sections[label] = b"" if kind == 8 else image[offset : offset + size]  # SHT_NOBITS holds no bytes
    return sections


def fingerprint(variant: KernelVariant, arch: int) -> dict[str, dict[str, str]]:
    # the kernels and their exported launch geometry, as the package compiles them (older checkouts: the kernels)
    expressions = getattr(variant, "compiled_expressions", variant.name_expressions)
    program = compile_program(
        variant.source_text(), expressions, arch, variant.options, [csrc_dir()], variant.sources[0]
    )
    sections = elf_sections(program.cubin)
    result = {}
    for expression in variant.name_expressions:
        mangled = program.lowered_name(expression)
        text = sections.get(f".text.{mangled}")
        if text is None:
            raise RuntimeError(f"{variant.name}: no .text section for {mangled} in the sm_{arch} cubin")
        result[expression] = {
            "text_sha256": hashlib.sha256(text).hexdigest(),
            "text_bytes": len(text),
            "cubin_sha256": hashlib.sha256(program.cubin).hexdigest(),
            "mangled": mangled,
        }
    return result


def collect(jobs: int, only: str | None = None, decode: bool = False) -> dict[str, dict[str, str]]:
    work = []
    for group, table_arch, target in GROUPS:
        variants = tiles.shipped_fwd_variants(table_arch) + tiles.shipped_bwd_variants(table_arch)
        if decode:
            variants += tiles.shipped_decode_variants(table_arch) + tiles.shipped_combine_variants()
            variants += getattr(tiles, "shipped_preprocess_variants", lambda arch: [])(table_arch)  # (older baselines)
        for variant in variants:
            if only is None or only in variant.name:
                work.append((group, variant, target))
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        results = list(pool.map(lambda item: fingerprint(item[1], item[2]), work))
    print(f"compiled {len(work)} programs in {time.perf_counter() - started:.0f} s with {jobs} threads", file=sys.stderr)
    kernels = {}
    for (group, variant, _), per_expression in zip(work, results):
        for expression, digest in per_expression.items():
            kernels[f"{group}/{variant.name}/{expression}"] = digest
    return kernels


def _variant_key(key: str) -> str:
    """``<group>/<variant name>`` of a ``<group>/<variant name>/<name expression>`` key."""
    return "/".join(key.split("/", 2)[:2])


def _paired(before: dict, after: dict, group: str) -> list[tuple[str, str | None, str | None]]:
    """(label, before key, after key) of group's kernels: the same key, or, where a variant's one name expression was
    respelled (e.g. defaulted template arguments written out), the same variant name on both sides."""
    def by_variant(kernels: dict) -> dict[str, list[str]]:
        index: dict[str, list[str]] = {}
        for key in kernels:
            if key.startswith(group + "/"):
                index.setdefault(key.split("/", 2)[1], []).append(key)
        return index

    old, new = by_variant(before), by_variant(after)
    pairs = []
    for variant in sorted(set(old) | set(new)):
        keys_before, keys_after = old.get(variant, []), new.get(variant, [])
        if len(keys_before) == 1 and len(keys_after) == 1:
            pairs.append((keys_after[0], keys_before[0], keys_after[0]))
            continue
        for key in sorted(set(keys_before) | set(keys_after)):
            pairs.append((key, key if key in before else None, key if key in after else None))
    return pairs


def compare(before: dict, after: dict) -> int:
    """Print the comparison; return the number of kernels that differ or are missing on one side."""
    problems = 0
    for group, _, _ in GROUPS:
        pairs = _paired(before, after, group)
        both = [(label, b, a) for label, b, a in pairs if b is not None and a is not None]
        same = [(b, a) for _, b, a in both if before[b]["text_sha256"] == after[a]["text_sha256"]]
        cubin_same = [1 for b, a in same if before[b]["cubin_sha256"] == after[a]["cubin_sha256"]]
        respelled = sum(b != a for _, b, a in both)
        print(f"{group}: {len(same)} of {len(pairs)} kernels with identical code ({len(cubin_same)} whole cubins "
              f"identical{f'; {respelled} name expressions respelled, matched by variant name' if respelled else ''})")
        for label, b, a in pairs:
            if b is None or a is None:
                print(f"  only {'after' if a is not None else 'before'}: {label}")
                problems += 1
            elif "mangled" in before[b] and "mangled" in after[a] and before[b]["mangled"] != after[a]["mangled"]:
                print(f"  another instantiation: {label} ({before[b]['mangled']} -> {after[a]['mangled']})")
                problems += 1
            elif before[b]["text_sha256"] != after[a]["text_sha256"]:
                print(f"  differs: {label} ({before[b]['text_bytes']} -> {after[a]['text_bytes']} bytes of code)")
                problems += 1
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write the fingerprints to")
    parser.add_argument("--compare", type=Path, help="an earlier --out file to compare against")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile threads (default: CPUs)")
    parser.add_argument("--only", help="compile only the variants whose name contains this (a quick check)")
    parser.add_argument("--decode", action="store_true",
                        help="also the decoding kernels, split combines and backward preprocess kernels")
    args = parser.parse_args(argv)
    library = find_nvrtc(90)
    kernels = collect(args.jobs, args.only, args.decode)
    document = {"nvrtc": library.version_string, "kernels": kernels}
    args.out.write_text(json.dumps(document, indent=1, sort_keys=True) + "\n")
    print(f"{len(kernels)} kernels fingerprinted with NVRTC {library.version_string} -> {args.out}")
    if args.compare:
        before = json.loads(args.compare.read_text())
        if before.get("nvrtc") != document["nvrtc"]:
            print(f"note: NVRTC {before.get('nvrtc')} before, {document['nvrtc']} now: differences may be the compiler's")
        before_kernels = before["kernels"]
        if args.only:
            variants = {_variant_key(k) for k in kernels}
            before_kernels = {k: v for k, v in before_kernels.items() if _variant_key(k) in variants}
        return 1 if compare(before_kernels, kernels) else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())

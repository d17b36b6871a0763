"""Are two workdirs' reports the same? Every CSV and JSON under ``reports/``, wall-clock fields aside.

Run: .venv/bin/python benchmarks/compare_reports.py BEFORE/reports AFTER/reports [--rtol 0]

For a behaviour-preserving change (a module moved, a file split): run the ``ci`` preset before and
after (``scalelab run all --preset ci --workdir DIR``) and compare. Columns and keys that measure
time or speed (``wall_s``, ``tokens_per_s``, ``mfu``, ``*_s``, ``*seconds*``, timestamps, run ids,
absolute paths) are left out; everything else must match (to ``--rtol`` for floats). Prints one
line per file and exits 1 when any differs.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

import polars as pl

VOLATILE = re.compile(r"(^|[._])(wall|time|seconds|tokens_per_s|items_per_s|mfu|speed|latency|run_id|model_id|"
                      r"written_at|started|ended|timestamp|path|dir|uri)($|[._])|_s$|_ms$", re.IGNORECASE)


def volatile(key: str) -> bool:
    return bool(VOLATILE.search(key))


def same(a, b, rtol: float) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        if math.isnan(a) and math.isnan(b):
            return True
        return a == b or (rtol > 0 and math.isclose(a, b, rel_tol=rtol))
    return a == b


def diff_json(a, b, rtol: float, where: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            if volatile(str(k)):
                continue
            if k not in a or k not in b:
                out.append(f"{where}.{k}: only in {'after' if k not in a else 'before'}")
            else:
                out += diff_json(a[k], b[k], rtol, f"{where}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{where}: {len(a)} vs {len(b)} items"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in diff_json(x, y, rtol, f"{where}[{i}]")]
    return [] if same(a, b, rtol) else [f"{where}: {a!r} vs {b!r}"]


def diff_csv(a: Path, b: Path, rtol: float) -> list[str]:
    fa = pl.read_csv(a, infer_schema_length=None) if a.stat().st_size else pl.DataFrame()
    fb = pl.read_csv(b, infer_schema_length=None) if b.stat().st_size else pl.DataFrame()
    cols = [c for c in fa.columns if not volatile(c)]
    if cols != [c for c in fb.columns if not volatile(c)]:
        return [f"columns differ: {cols} vs {[c for c in fb.columns if not volatile(c)]}"]
    if fa.height != fb.height:
        return [f"{fa.height} vs {fb.height} rows"]
    return diff_json(fa.select(cols).to_dicts(), fb.select(cols).to_dicts(), rtol, "")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--rtol", type=float, default=0.0, help="relative tolerance for floats (default: exact)")
    args = ap.parse_args()
    files = sorted({p.relative_to(args.before) for p in args.before.rglob("*") if p.suffix in (".csv", ".json")}
                   | {p.relative_to(args.after) for p in args.after.rglob("*") if p.suffix in (".csv", ".json")})
    bad = 0
    for rel in files:
        a, b = args.before / rel, args.after / rel
        if not (a.exists() and b.exists()):
            print(f"DIFF {rel}: only in {'after' if not a.exists() else 'before'}")
            bad += 1
            continue
        problems = (diff_csv(a, b, args.rtol) if rel.suffix == ".csv"
                    else diff_json(json.loads(a.read_text()), json.loads(b.read_text()), args.rtol))
        print(("same " if not problems else "DIFF ") + str(rel) + ("" if not problems else f": {problems[0]}"
                                                                  + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else "")))
        bad += bool(problems)
    print(f"{len(files) - bad} of {len(files)} files the same")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

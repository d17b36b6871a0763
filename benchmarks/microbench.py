"""Evaluation subsets: MDAD, Kendall tau and MAE of every subset selector at every size, in one run.

Run: ``.venv/bin/python benchmarks/microbench.py [--matrix FILE] [--workdir DIR] [--sizes 10,25,50,100,250]
[--repeats 100] [--seed 0]``

The matrix: ``--matrix`` when given; else every ``reports/downstream/correctness_<task>.parquet`` the
evaluate stage wrote under ``--workdir`` (default: the repository); else a synthetic 2-parameter
logistic IRT population of 40 models x 1000 items (``irt_population(40, 1000, seed=--seed)``:
ability ~ N(0, 1), difficulty ~ N(0, 1), discrimination ~ LogNormal(0, 0.5), one Bernoulli draw per
cell). Scoring the OLMo task requests on enough models to fill a real matrix is too slow here.
Every selector is fitted and judged under the same cross-validation over models, with the defaults
of :class:`MicrobenchConfig` (p = 0.95, 5 folds) and ``--repeats`` fold splits.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import polars as pl  # noqa: E402

from tasks.evaluation.microbench import (  # noqa: E402
    CorrectnessMatrix, MicrobenchConfig, compare_selectors, irt_population, read_correctness_matrix,
)


def matrices(args: argparse.Namespace) -> list[CorrectnessMatrix]:
    if args.matrix:
        return [read_correctness_matrix(args.matrix)]
    found = sorted((Path(args.workdir) / "reports" / "downstream").glob("correctness_*.parquet"))
    if found:
        return [read_correctness_matrix(p) for p in found]
    return [irt_population(40, 1000, seed=args.seed)]


def pivot(table: pl.DataFrame, column: str, scale: float, digits: int) -> pl.DataFrame:
    """method x n of one metric, as text (``none`` where MDAD is missing)."""
    shown = table.with_columns(pl.when(pl.col(column).is_null()).then(pl.lit("none"))
                               .otherwise((pl.col(column) * scale).round(digits).cast(pl.String)).alias("v"))
    return shown.pivot(on="n", index="method", values="v")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--matrix", type=Path, help="a correctness matrix (CSV or the pipeline's Parquet)")
    ap.add_argument("--workdir", type=Path, default=ROOT, help="a pipeline workdir with reports/downstream/")
    ap.add_argument("--sizes", default="10,25,50,100,250")
    ap.add_argument("--repeats", type=int, default=100, help="fold splits (more than the config's 50: a "
                    "steadier table)")
    ap.add_argument("--seed", type=int, default=0, help="the synthetic population's and the draws' seed")
    args = ap.parse_args()
    cfg = dataclasses.replace(MicrobenchConfig(), repeats=args.repeats, seed=args.seed)
    pl.Config.set_tbl_hide_dataframe_shape(True)
    pl.Config.set_tbl_hide_column_data_types(True)
    pl.Config.set_tbl_rows(20)
    for matrix in matrices(args):
        sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
        kept = [n for n in sizes if n <= len(matrix.items)]
        acc = matrix.accuracy
        print(f"\n{matrix.source}: {len(matrix.models)} models x {len(matrix.items)} items "
              f"(accuracy {acc.min():.3f}..{acc.max():.3f}){'; sizes > items skipped: ' + str(sorted(set(sizes) - set(kept))) if kept != sizes else ''}")
        if len(matrix.models) < 4 or not kept:
            print("  skipped: cross-validation over models needs >= 4 models and a size <= the items")
            continue
        t0 = time.perf_counter()
        res = compare_selectors(matrix, kept, cfg)
        wall = time.perf_counter() - t0
        print(f"{cfg.repeats} repeats x {res.folds} folds, p = {cfg.probability}, {wall:.1f} s"
              + "".join(f"; {n}" for n in res.notes))
        print("MDAD (accuracy points; none = no gap ranked right with p >= 0.95):")
        print(pivot(res.table, "mdad", 100, 1))
        print("Kendall tau (held-out folds):")
        print(pivot(res.table, "kendall_tau", 1, 3))
        print("MAE of the full-accuracy estimate (points):")
        print(pivot(res.table, "mae", 100, 2))


if __name__ == "__main__":
    main()

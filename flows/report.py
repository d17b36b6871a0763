"""What a finished workdir found, said plainly: the findings summary.

``build_summary`` turns the stage reports (:func:`flows.report_data.load_reports`) into a few short
tables (:mod:`flows.report_sections`); ``summary_markdown`` shows it as ``reports/summary.md`` and the
Prefect artifact, ``print_summary`` as rich tables in a terminal. DVC's headline metrics:
:mod:`flows.report_metrics`.

    >>> reports = load_reports(Path("reports"))
    >>> print(summary_markdown(build_summary(reports)))
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from flows.report_data import Reports, load_reports
from flows.report_sections import (Section, compression_section, compute_optimal_section, curation_section,
                                   decision_lines, downstream_section, feasibility_section, law_section,
                                   pruning_section, sparse_section, winner_section)
from tasks.common.io import write_text


@dataclass
class Summary:
    """What one ``reports/`` folder found: headline sentences, the sections, what is missing or failed."""

    folder: Path
    headline: list[str]
    sections: list[Section]
    missing: list[str]
    decisions: list[str] = field(default_factory=list)  # one line per compared series: read first
    failures: list[str] = field(default_factory=list)  # units that failed: read before anything else


def build_summary(reports: Reports) -> Summary:
    """The sections that the files present allow, a few headline sentences, and what is missing."""
    sections, headline = [], []
    if "curation.csv" in reports.tables and reports.tables["curation.csv"].height:
        sections.append(curation_section(reports))
    if "feasibility.csv" in reports.tables and reports.tables["feasibility.csv"].height:
        sec, lines = feasibility_section(reports)
        sections.append(sec)
        headline += lines
    present = set(reports.tables) | set(reports.json)
    # (any of these files present -> the section)
    for needs, make in ((("fits.json",), law_section), (("fits.json", "train.csv"), winner_section),
                        (("compute_optimal.csv",), compute_optimal_section), (("compress.csv",), compression_section),
                        (("sparse_eval.csv",), sparse_section), (("pruning.csv",), pruning_section),
                        (("downstream.csv",), downstream_section)):
        if present & set(needs):
            sec, lines = make(reports)
            sections.append(sec)
            headline += lines
    return Summary(folder=reports.folder, headline=headline, sections=sections, missing=reports.missing_lines(),
                   decisions=decision_lines(reports), failures=reports.failures)


def summary_markdown(summary: Summary, *, images: bool = True) -> str:
    """The summary as Markdown; ``images`` embeds the plots (paths relative to ``reports/``), else
    names them (for places that cannot reach the files, such as a Prefect artifact)."""
    out = ["# What this run found", ""]
    if summary.failures:  # first: every other number below comes from the units that finished
        out += ["## Failures", "", *(f"- {line}" for line in summary.failures),
                "", "Tracebacks: `reports/failures/<stage>.log`; the rows of these units are marked `failed` in the "
                "stage tables.", ""]
    if summary.decisions:
        out += ["## Decisions", "", *(f"- {line}" for line in summary.decisions), ""]
    if summary.missing:
        out += ["**Incomplete workdir:**", "", *(f"- {m}" for m in summary.missing), ""]
    out += [f"- {line}" for line in summary.headline] + [""]
    for sec in summary.sections:
        out += [f"## {sec.title}", ""]
        if sec.rows:
            out.append("| " + " | ".join(sec.columns) + " |")
            out.append("|" + "|".join("---" for _ in sec.columns) + "|")
            out += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in sec.rows]
            out.append("")
        out += [f"- {n}" for n in sec.notes]
        if sec.notes:
            out.append("")
        for p in sec.plots:
            out.append(f"![{Path(p).stem}]({p})" if images else f"- plot: `reports/{p}`")
        if sec.plots:
            out.append("")
    out.append(f"Files: `{summary.folder}` (fits.json, compute_optimal.csv, compress.csv, sparse_eval.csv, "
               f"downstream.csv, train.csv); plots under `{summary.folder / 'plots'}`.")
    return "\n".join(out) + "\n"


def print_summary(summary: Summary, console: Any | None = None) -> None:
    """The summary as rich tables on ``console`` (default: a new ``rich.console.Console``)."""
    console = console or Console()
    console.rule("[bold]What this run found")
    if summary.failures:
        console.print("[bold red]Failures")
        for line in summary.failures:
            console.print(f"[red]✗[/red] {line}", highlight=False)
        console.print()
    if summary.decisions:
        console.print("[bold]Decisions")
        for line in summary.decisions:
            console.print(f"• {line}", highlight=False)
        console.print()
    for line in summary.headline:
        console.print(f"• {line}", highlight=False)
    for sec in summary.sections:
        console.print()
        if sec.rows:
            table = Table(title=sec.title, title_justify="left", show_lines=False)
            for c in sec.columns:
                table.add_column(c, overflow="fold")
            for row in sec.rows:
                table.add_row(*row)
            console.print(table)
        else:
            console.print(f"[bold]{sec.title}")
        for n in sec.notes:
            console.print(f"  {n}", highlight=False)
        if sec.plots:
            console.print("  plots: " + ", ".join(str(summary.folder / p) for p in sec.plots), highlight=False)
    for m in summary.missing:
        console.print(f"[red]missing:[/red] {m}", highlight=False)
    console.print(f"\nFull summary: {summary.folder / 'summary.md'}", highlight=False)


def write_summary(reports_dir: str | Path) -> tuple[Summary, Path]:
    """Build the summary of ``reports_dir`` and write it to ``reports_dir/summary.md``."""
    summary = build_summary(load_reports(reports_dir))
    return summary, write_text(Path(reports_dir) / "summary.md", summary_markdown(summary))

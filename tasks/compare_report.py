"""The comparison for people and for tools: the markdown table with the scaling headline, the flags, the
per-scenario figures of CULane runs, the nightly's decision on runs that were its challengers, the two charts,
and the raw figures (``figures.json`` of ``laneflow compare --out``).
``tasks.compare`` computes what these show."""

from __future__ import annotations

import io
from dataclasses import asdict
from typing import Any

from tasks.compare import Comparison, RunFigures


def render_markdown(comparison: Comparison, charts: dict[str, str] | None = None) -> str:
    """The comparison for people: the table, the scaling summary, the flags and the charts (data URIs)."""
    columns = list(comparison.rows[0])
    lines = [f"# Comparison of {len(comparison.rows)} run(s)", "",
             f"Baseline: `{comparison.baseline}` (speed-up = the baseline's wall time / the run's, for the same "
             f"work; efficiency = speed-up / worker ratio; the throughput ratio, img/s / the baseline's, is a "
             f"scaling diagnostic). Target val accuracy {comparison.target_accuracy:g} (without the 200 ms rule)."
             + (f" Costs in {comparison.currency}." if comparison.currency else ""), ""]
    lines += scaling_summary(comparison)
    lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row[column]) for column in columns) + " |" for row in comparison.rows]
    flagged = [row for row in comparison.rows if str(row["comparable"]).startswith("NO")]
    if flagged:
        lines += ["", "## Not like for like", ""]
        lines += [f"- `{row['run']}`: {row['comparable'].removeprefix('NO: ')}" for row in flagged]
    lines += scenario_table(comparison.figures)
    lines += decision_sections(comparison.figures)
    for title, uri in (charts or {}).items():
        lines += ["", f"## {title}", "", f"![{title}]({uri})"]
    return "\n".join(lines) + "\n"


def scenario_table(figures: list[RunFigures]) -> list[str]:
    """CULane runs' test F1 per scenario, a run a row, the scenarios in the order the evaluation gives them; the
    crossroads have no lanes, so no F1: their false positives, as the official table gives them. Nothing when no
    run has scenario figures."""
    culane = [row for row in figures if row.test_scenarios]
    if not culane:
        return []
    names = list(dict.fromkeys(name for row in culane for name in row.test_scenarios))
    lines = ["", "## Test per scenario", "",
             "CULane's F1 at IoU 0.5 (a CULane run's accuracy columns above are this F1 over all scenarios); "
             "the crossroads: false positives.", "",
             "| run | " + " | ".join(_cell(name) for name in names) + " |", "|---|" + "---|" * len(names)]
    for row in culane:
        cells = []
        for name in names:
            figures_of = row.test_scenarios.get(name)
            if figures_of is None:
                cells.append("")
            elif name == "cross":
                cells.append(f"FP {figures_of['fp']}" if figures_of.get("fp") is not None else "")
            else:
                cells.append(_cell(_percent(figures_of.get("f1"))))
        lines.append(f"| {_cell(row.name)} | " + " | ".join(cells) + " |")
    return lines


def decision_sections(figures: list[RunFigures]) -> list[str]:
    """What the nightly decided on each run that was its challenger: promoted or kept, against which champion,
    why, both val scores, and every release gate's figures (a CULane scenario's F1, the crossroads' false
    positives per frame, TuSimple's accuracy, FP and FN). Nothing when no run was a nightly's challenger."""
    judged = [row for row in figures if row.champion_decision is not None]
    if not judged:
        return []
    lines = ["", "## Nightly champion decisions", "",
             "Decided on val (both models scored on the challenger's val images); the release gates, scored on the "
             "split the challenger's run reported, can only refuse a challenger that won on val."]
    for row in judged:
        decision = row.champion_decision or {}
        against = decision.get("champion")
        if decision.get("stopped"):  # stopped before its end: nothing was judged
            heading = "not scored (stopped)" + (f", champion `{_cell(against)}` kept" if against else "")
        else:
            heading = ("promoted" if decision.get("promoted") else "kept") + (
                f" against champion `{_cell(against)}`" if against else " (no champion before)")
        lines += ["", f"### `{_cell(row.name)}`: {heading}", "", f"{_cell(decision.get('reason'))}", ""]
        score = decision.get("score") or "score"
        if decision.get("challenger_val") is not None:
            champion_val = decision.get("champion_val")
            lines.append(f"- val {score}: challenger {float(decision['challenger_val']):.4f}, champion "
                         + (f"{float(champion_val):.4f}" if champion_val is not None else "none"))
        lines.append(f"- release gates: {_cell(decision.get('gates_summary'))}")
        gates = decision.get("gates") or []
        if gates:
            columns = ("figure", "champion", "challenger", "worse by", "margin")
            lines += ["", "| " + " | ".join(columns) + " | passed |", "|---|" + "---|" * len(columns)]
            lines += ["| " + " | ".join(_cell(gate.get(column)) for column in columns)
                      + f" | {'yes' if gate.get('passed') else '**NO**'} |" for gate in gates]
    return lines


def _percent(value: float | None) -> str | None:
    return None if value is None else f"{value * 100:.2f}"


def scaling_summary(comparison: Comparison) -> list[str]:
    """The headline: each run's elapsed-time speed-up and efficiency against the baseline, in words."""
    if not comparison.scalings:
        return []
    base = next(row for row in comparison.figures if row.name == comparison.baseline)
    lines = ["## Scaling", ""]
    for row in comparison.figures:
        scaled = comparison.scalings.get(row.name)
        if scaled is None:
            continue
        workers = f"{row.workers} worker(s) against {base.workers}"
        if scaled.speed_up is None:
            lines.append(f"- `{row.name}` ({workers}): no speed-up: {scaled.why_not}")
            continue
        lines.append(f"- `{row.name}` ({workers}): the same work in {_duration(row.wall_s)} instead of "
                     f"{_duration(base.wall_s)}: **{scaled.speed_up:.2f}×** speed-up, "
                     f"**{scaled.efficiency * 100:.0f} %** efficiency")
    return [*lines, ""]


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    if seconds >= 3600:
        hours, rest = divmod(round(seconds), 3600)
        return f"{hours} h {rest // 60} min"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.1f} s"


def _cell(value: Any) -> str:
    return "" if value is None else str(value).replace("|", "\\|")


def throughput_chart_png(comparison: Comparison) -> bytes:
    """Throughput against workers, each run a point, with the ideal line through the baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = next(row for row in comparison.figures if row.name == comparison.baseline)
    figure, axes = plt.subplots(figsize=(6, 4), dpi=100)
    try:
        most = max(row.workers for row in comparison.figures)
        ideal = [base.img_per_s_per_worker * workers for workers in range(1, most + 1)]
        axes.plot(range(1, most + 1), ideal, linestyle="--", color="grey", label=f"ideal (from {base.name})")
        for row in comparison.figures:
            axes.scatter([row.workers], [row.img_per_s], label=row.name, zorder=3)
        axes.set_xlabel("workers")
        axes.set_ylabel("images / s")
        axes.set_title("Throughput vs workers")
        axes.set_xticks(range(1, most + 1))
        axes.legend(fontsize=7)
        return _png(figure)
    finally:
        plt.close(figure)


def accuracy_chart_png(comparison: Comparison) -> bytes:
    """Val accuracy (without the 200 ms rule) against wall time, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4), dpi=100)
    try:
        for row in comparison.figures:
            if row.val_curve:
                times, accuracies = zip(*row.val_curve, strict=True)
                axes.plot(times, accuracies, marker="o", label=row.name)
        axes.axhline(comparison.target_accuracy, linestyle=":", color="grey", label="target")
        axes.set_xlabel("wall time since the first start (s)")
        axes.set_ylabel("val accuracy (untimed)")
        axes.set_title("Val accuracy vs wall time")
        axes.legend(fontsize=7)
        return _png(figure)
    finally:
        plt.close(figure)


def _png(figure: Any) -> bytes:
    buffer = io.BytesIO()
    figure.tight_layout()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def figures_record(comparison: Comparison) -> list[dict[str, Any]]:
    """The raw figures, JSON-safe (``laneflow compare --json``)."""
    return [asdict(row) for row in comparison.figures]

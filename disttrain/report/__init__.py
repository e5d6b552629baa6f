"""What a run leaves in its output dir, and `make report` for any run (finished or in progress):

    run_files.py  the output dir, recipe.yaml (and what changed on resume), data_report.json, run.json
    card.py    final/README.md: a model card in the Hub's format (YAML header, recipe, data, hardware, results,
               how to load it)
    plots.py   plots/*.png: loss, learning rate, grad norm, tokens/s, MFU against step, resumes marked
    table.py   one summary row per run (to compare hyper-parameters, strategies, and `make eval`'s scores)
    eval_results.py  <run>/eval/results.json (`make eval`) read back: the card's Evaluation table and
               model-index, the report's score columns

Everything is read from the run's output dir (recipe.yaml, run.json, data_report.json, metrics.jsonl), so the
report of a run can be made again at any time.
"""

from __future__ import annotations

from pathlib import Path

from disttrain.report.card import write_model_card
from disttrain.report.plots import plot_run
from disttrain.report.table import summary_row, summary_table

__all__ = ["plot_run", "summary_row", "summary_table", "write_model_card", "write_report"]


def write_report(run_dir: str | Path) -> list[Path]:
    """Plots, and the model card when the run exported its model; returns the files written."""
    run = Path(run_dir)
    written = plot_run(run)
    if (run / "final").is_dir():
        written.append(write_model_card(run))
    return written

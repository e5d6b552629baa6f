"""`make report RUN=outputs/<run> [RUN=...]`: a summary table of one or several runs, and each run's plots
(and model card when it exported its model), finished or in progress.

    python -m disttrain.report outputs/tiny-sft/ddp-2 outputs/tiny-sft/fsdp-2
    python -m disttrain.report                     # every run under outputs/
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from disttrain.errors import DisttrainError, exit_on_user_error
from disttrain.report import summary_row, summary_table, write_report


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="*", help="output dirs of runs (each holds a metrics.jsonl); default: every "
                        "run under outputs/")
    args = parser.parse_args(argv)
    if not args.runs:
        args.runs = sorted(str(p.parent) for p in Path("outputs").rglob("metrics.jsonl"))
        if not args.runs:
            raise DisttrainError("no runs under outputs/ (no metrics.jsonl); give RUN=<a run's output.dir>")
    runs = [Path(run) for run in args.runs]
    missing = [run for run in runs if not (run / "metrics.jsonl").is_file()]
    if len(missing) == len(runs):
        raise DisttrainError(f"{missing[0]}: no metrics.jsonl here; give a run's output.dir (e.g. "
                             "outputs/tiny-sft/ddp-2)")
    for run in missing:  # a glob (RUN="outputs/tiny-sft/*") also matches dirs of runs that never logged a step
        print(f"skipped {run}: no metrics.jsonl (not a run's output.dir, or a run that never logged a step)")
    rows = []
    for run in runs:
        if run in missing:
            continue
        for path in write_report(run):
            print(f"wrote {path}")
        rows.append(summary_row(run))
    print(summary_table(rows))


if __name__ == "__main__":
    with exit_on_user_error():
        main(sys.argv[1:])

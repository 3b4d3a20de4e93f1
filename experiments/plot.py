"""Draw a gift.py run's metrics.jsonl: loss, learning rate, gradient norm, beta mean +- std and the masked fraction
against the optimizer step, into RUN_DIR/metrics.png.

    pip install matplotlib                     # figures only: gift.py, the other scripts and the tests never need it
    python experiments/plot.py runs/sudoku-tiny           # -> runs/sudoku-tiny/metrics.png
    python experiments/plot.py RUN_DIR --out fig.png      # anywhere else

RUN_DIR is any gift.py output folder (the main job's, a paper recipe's, a study run's under
runs/<task>-gift-vs-sft/runs/...). The PNG's caption names the folder, the commit the run was made with (from its
results.json or result.json, when it has one) and this command.

The file is two halves: reading the records into series (plain Python, tested by tests/test_plot.py without
matplotlib), then drawing them (matplotlib, imported only inside the drawing functions).
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
INSTALL_HINT = "pip install matplotlib (figures only; nothing else in this repository needs it)"

# the panels: (title, the metrics.jsonl keys drawn in it, log scale?)
PANELS = (("loss", ("loss",), True),
          ("learning rate", ("lr",), False),
          ("gradient norm (before clipping)", ("grad_norm",), False),
          ("beta: mean +- std over answer tokens", ("beta_mean", "beta_std"), False),
          ("masked fraction of answer tokens", ("masked_fraction",), False))


# ---------------------------------------------------------------------------------------------------------------------
# Data: no matplotlib


def read_metrics(path):
    """metrics.jsonl -> its records (dicts), one per logged step, in step order. Blank lines are skipped; a line that
    is not a JSON object with a "step" fails naming the file and line. A step logged twice keeps its last record
    (a resumed run truncates the file first, so this only guards against a file that was concatenated by hand)."""
    path = Path(path)
    by_step = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e.msg}); is this a gift.py metrics.jsonl?") from None
            if not isinstance(record, dict) or "step" not in record:
                raise ValueError(f"{path}:{n}: a record without a \"step\"; is this a gift.py metrics.jsonl?")
            by_step[record["step"]] = record
    if not by_step:
        raise ValueError(f"{path}: no records (a run logs every --log-every steps; has it reached the first?)")
    return [by_step[s] for s in sorted(by_step)]


def metric_series(records):
    """Records -> {key: (steps, values)} for every key a panel draws, skipping the steps a key is missing from (an
    SFT run logs no beta; a None or non-number value is skipped too)."""
    series = {}
    for _, keys, _ in PANELS:
        for key in keys:
            pts = [(r["step"], float(r[key])) for r in records if isinstance(r.get(key), (int, float))]
            if pts:
                series[key] = ([s for s, _ in pts], [v for _, v in pts])
    return series


def run_commit(run_dir):
    """The commit a run was made with: results.json (the main job) or result.json (a study run), else None."""
    for name in ("results.json", "result.json"):
        path = Path(run_dir) / name
        if path.is_file():
            try:
                commit = json.loads(path.read_text()).get("commit")
            except (json.JSONDecodeError, AttributeError):
                continue
            if commit:
                return str(commit)[:12]
    return None


def repo_commit(*paths):
    """The last commit (short) that changed `paths` (default: any file), with "+changes" when they differ from it in
    this checkout: a figure computed from them names the code that computed it, and redrawing it at a later commit
    that left them alone gives the same picture; "unknown" outside git."""
    try:
        last = subprocess.run(["git", "log", "-1", "--format=%h", "--", *paths], cwd=REPO, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", *paths], cwd=REPO,
                               capture_output=True).returncode
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return (last or "unknown") + ("+changes" if dirty else "")


# ---------------------------------------------------------------------------------------------------------------------
# Drawing: matplotlib, imported here only


def pyplot():
    """matplotlib.pyplot with a file-only backend, or a one-line error saying how to install it."""
    try:
        import matplotlib
    except ImportError:
        sys.exit(f"plot: matplotlib is not installed: {INSTALL_HINT}")
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt
    return plt


def caption(fig, text):
    """The small grey line at the figure's foot: the data's commit and the command that redraws it."""
    fig.text(0.01, 0.005, text, fontsize=7, color="0.35", ha="left", va="bottom")


def draw_metrics(series, out, title, note):
    plt = pyplot()
    panels = [p for p in PANELS if p[1][0] in series]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.0 * len(panels), 2.9), squeeze=False)
    for ax, (name, keys, log_y) in zip(axes[0], panels):
        steps, values = series[keys[0]]
        ax.plot(steps, values, marker="o", ms=2.5, lw=1.2, color="C0")
        if keys == ("beta_mean", "beta_std") and "beta_std" in series:
            _, std = series["beta_std"]
            ax.fill_between(steps, [m - s for m, s in zip(values, std)], [m + s for m, s in zip(values, std)],
                            color="C0", alpha=0.2, lw=0)
        if log_y and min(values) > 0:
            ax.set_yscale("log")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("optimizer step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    caption(fig, note)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="a gift.py output folder (holding metrics.jsonl)")
    parser.add_argument("--out", default="", help="the PNG to write; default RUN_DIR/metrics.png")
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        sys.exit(f"plot: {path} does not exist: give a gift.py output folder (its --out)")
    try:
        series = metric_series(read_metrics(path))
    except ValueError as e:
        sys.exit(f"plot: {e}")
    out = Path(args.out) if args.out else run_dir / "metrics.png"
    commit = run_commit(run_dir)
    note = (f"{run_dir}: run made at commit {commit or 'not recorded'}; "
            f"redraw: python experiments/plot.py {args.run_dir}" + (f" --out {args.out}" if args.out else ""))
    draw_metrics(series, out, f"{run_dir.name}: metrics.jsonl", note)
    print(f"plot: {out}")


if __name__ == "__main__":
    main()

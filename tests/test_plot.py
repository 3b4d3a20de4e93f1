"""experiments/plot.py and experiments/figures.py without matplotlib: the data each figure draws (a run's
metrics.jsonl read into series; Theorem 1's curves from gift.py against the closed form; the main job's copied run;
the toy study's pairs against its summary.csv), that importing either file never imports matplotlib, and that
drawing without it stops in one line saying how to install it."""

import csv
import importlib.util
import json
import math
import statistics
import subprocess
import sys

import pytest
from conftest import REPO

EXPERIMENTS = REPO / "experiments"


def load(name):
    spec = importlib.util.spec_from_file_location(name, EXPERIMENTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # importing draws nothing
    return module


figures = load("figures")  # puts experiments/ on sys.path, so `plot` is the one it imported
plot = sys.modules["plot"]


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_read_metrics_orders_steps_and_keeps_the_last_record(tmp_path):
    rec = lambda step, loss: json.dumps(dict(step=step, loss=loss, lr=1e-3, grad_norm=0.5, masked_fraction=0.4))
    path = write_lines(tmp_path / "metrics.jsonl", [rec(200, 2.0), "", rec(100, 3.0), rec(200, 1.5)])
    records = plot.read_metrics(path)
    assert [r["step"] for r in records] == [100, 200]
    assert [r["loss"] for r in records] == [3.0, 1.5]


@pytest.mark.parametrize("lines, message", [(['{"step": 1, "loss": 2.0}', "{not json"], "metrics.jsonl:2: not JSON"),
                                            (['{"loss": 2.0}'], "metrics.jsonl:1: a record without a \"step\""),
                                            (["[1, 2]"], "metrics.jsonl:1: a record without"),
                                            (["", "  "], "no records")])
def test_read_metrics_names_the_bad_line(tmp_path, lines, message):
    with pytest.raises(ValueError, match=message):
        plot.read_metrics(write_lines(tmp_path / "metrics.jsonl", lines))


def test_metric_series_skips_what_a_run_did_not_log():
    """An SFT run logs no beta; a missing or null value is skipped, not drawn as 0."""
    records = [dict(step=10, loss=2.0, lr=1e-3, grad_norm=1.0, masked_fraction=0.5),
               dict(step=20, loss=1.0, lr=5e-4, grad_norm=None, masked_fraction=0.5)]
    series = plot.metric_series(records)
    assert set(series) == {"loss", "lr", "grad_norm", "masked_fraction"}
    assert series["loss"] == ([10, 20], [2.0, 1.0])
    assert series["grad_norm"] == ([10], [1.0])


def test_the_main_jobs_copy_is_whole():
    """experiments/figures/data/sudoku-tiny: every metrics.jsonl record of the main job (1500 steps logged every 100,
    each panel's key present) and the results.json that names its commit and held-out accuracy."""
    (steps, loss), results = figures.main_job_data()
    assert steps == list(range(100, 1501, 100))
    assert all(math.isfinite(x) and x > 0 for x in loss) and loss[-1] < loss[0]
    series = plot.metric_series(plot.read_metrics(figures.MAIN_JOB / "metrics.jsonl"))
    assert set(series) == {key for _, keys, _ in plot.PANELS for key in keys}
    assert results["commit"] and results["options"]["loss"] == "gift"
    assert results["model"].endswith(f"step-{steps[-1]:07d}/model")  # the evaluated model is the last step's
    for when in ("untrained", "trained"):
        assert 0 <= results["heldout"][when]["cell_accuracy"] <= 100
    assert plot.run_commit(figures.MAIN_JOB) == results["commit"]


def test_a_figure_names_the_last_commit_that_changed_its_code():
    """theorem1.png's caption names the last commit that changed gift.py, not HEAD: redrawing at a later commit that
    left gift.py alone gives the same picture."""
    last = subprocess.run(["git", "log", "-1", "--format=%h", "--", "gift.py"], cwd=REPO, capture_output=True,
                          text=True)
    if last.returncode != 0 or not last.stdout.strip():
        assert plot.repo_commit("gift.py").startswith("unknown")  # not a git checkout
        return
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "gift.py"], cwd=REPO).returncode
    assert plot.repo_commit("gift.py") == last.stdout.strip() + ("+changes" if dirty else "")


def test_theorem1_curves_are_the_closed_form():
    """gift.py's t_i for the figure's answer equals 1 - (1 - p)^(beta_i / mean beta), p = (1 - eps) t + eps; r = 1
    is SFT's p; the figure's betas have mean 1, so each curve is labelled by its beta."""
    t, t_i, p, r = figures.theorem1_curves(n_t=41)
    betas = figures.BETAS
    mean = sum(betas) / len(betas)
    assert r == pytest.approx([b / mean for b in betas], abs=1e-12) and mean == pytest.approx(1)
    eps = 1e-3
    for k, tk in enumerate(t):
        pk = (1 - eps) * tk + eps
        assert p[k] == pytest.approx(pk, abs=1e-12)
        for i, ri in enumerate(r):
            assert t_i[i][k] == pytest.approx(min(1, max(eps, 1 - (1 - pk) ** ri)), abs=1e-12)
    assert t_i[betas.index(1.0)] == pytest.approx(p, abs=1e-12)


def test_expected_masked_tokens():
    """E[#masked] = sum_i t_i. With mean r = 1, (1 - p)^r is convex in r, so GIFT masks at most SFT's n p tokens
    in all (Jensen; away from the eps clamp at t ~ 0), while each token with r > 1 is masked more often than
    under SFT."""
    t, t_i, p, r = figures.theorem1_curves(n_t=41)
    n = len(r)
    gift_all, sft_all = figures.expected_masked(t_i, p, range(n))
    assert sft_all == pytest.approx([n * x for x in p])
    assert gift_all == pytest.approx([sum(row[k] for row in t_i) for k in range(len(t))])
    unclamped = [k for k in range(len(t)) if min(row[k] for row in t_i) > 1e-3]  # t_i >= eps is clamped near t = 0
    assert len(unclamped) >= len(t) - 2
    assert all(gift_all[k] <= sft_all[k] + 1e-12 for k in unclamped)
    uncertain = [i for i, ri in enumerate(r) if ri > 1]
    gift_u, sft_u = figures.expected_masked(t_i, p, uncertain)
    assert all(g >= s - 1e-12 for g, s in zip(gift_u, sft_u))
    assert gift_u[len(t) // 2] > sft_u[len(t) // 2] + 0.5  # at t = 1/2: 1.69 tokens of 2 against 1.0


@pytest.mark.parametrize("task, metric", [(task, metric) for task, metric, _ in figures.TASKS])
def test_study_pairs_match_the_studys_summary(task, metric):
    """The figure's 9 (base, seed) differences per comparison are the study's pairs: their mean is summary.csv's
    difference, and the interval drawn around it holds it."""
    data, commit = figures.study_data(task, metric)
    assert [d[0] for d in data] == [c[0] for c in figures.COMPARISONS] and commit
    for label, diffs, mean, lo, hi, p in data:
        assert len(diffs) == 9, label
        assert sum(diffs.values()) / len(diffs) == pytest.approx(mean, abs=1e-9), label
        assert lo < mean < hi and 0 <= p <= 1, label


def test_paired_differences_pair_by_base_and_seed():
    rows = [dict(objective="gift", budget="steps", base="0", seed="1", acc="60"),
            dict(objective="gift", budget="steps", base="0", seed="0", acc="50"),
            dict(objective="sft", budget="steps", base="0", seed="0", acc="45"),
            dict(objective="sft", budget="steps", base="0", seed="1", acc="62"),
            dict(objective="sft", budget="time", base="0", seed="0", acc="49")]
    assert figures.paired_differences(rows, "acc", "gift", "steps") == {("0", "0"): 5.0, ("0", "1"): -2.0}
    assert figures.paired_differences(rows, "acc", "gift", "time") == {("0", "0"): 1.0}  # GIFT's equal-step run


def run_without_matplotlib(code):
    """Run `code` in a fresh interpreter where `import matplotlib` fails, as in the project's own venv."""
    prelude = f"import sys; sys.modules['matplotlib'] = None; sys.path.insert(0, {str(EXPERIMENTS)!r}); "
    return subprocess.run([sys.executable, "-c", prelude + code], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


def test_importing_the_figure_scripts_imports_no_matplotlib():
    r = run_without_matplotlib("import figures, plot; figures.theorem1_curves(5); figures.study_data('sudoku', "
                               "'cell_acc'); assert not any(m.startswith('matplotlib') for m in sys.modules if "
                               "sys.modules[m] is not None)")
    assert r.returncode == 0, r.stderr


def test_plot_without_matplotlib_says_how_to_install_it(tmp_path):
    runpy = "import runpy; sys.argv = ['plot.py', *sys.argv[1:]]; runpy.run_path('experiments/plot.py', " \
            "run_name='__main__')"
    r = run_without_matplotlib(runpy.replace("*sys.argv[1:]", repr(str(figures.MAIN_JOB))))
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        "plot: matplotlib is not installed: pip install matplotlib (figures only; nothing else in this repository "
        "needs it)"]
    r = run_without_matplotlib(runpy.replace("*sys.argv[1:]", repr(str(tmp_path))))  # checked before drawing
    assert r.returncode == 1 and r.stderr.strip() == f"plot: {tmp_path}/metrics.jsonl does not exist: give a gift.py " \
                                                     "output folder (its --out)"


def write_csv_rows(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def test_curves_data_pairs_runs_by_base_and_seed(tmp_path, monkeypatch):
    """curves_data: per step, the mean over the runs with its 95% t interval (mean +- t_{0.975, n-1} sd / sqrt(n),
    t_{0.975, 2} = 4.302653), and GIFT - SFT paired by (base, seed), not by row order; a step that some run lacks is
    left out."""
    monkeypatch.setattr(figures, "RESULTS", tmp_path)
    acc = {("sft", "0", "0"): (10, 20), ("sft", "0", "1"): (10, 30), ("sft", "1", "0"): (40, 40),
           ("gift", "1", "0"): (40, 47), ("gift", "0", "1"): (10, 33), ("gift", "0", "0"): (10, 26)}
    rows = [dict(objective=o, base=b, seed=s, cost_vs_sft=1.0 if o == "sft" else 1.3, n_heldout=256, step=step,
                 acc=v, commit="abc1234def") for (o, b, s), values in acc.items() for step, v in zip((0, 8), values)]
    rows.append(dict(rows[-1], step=16))  # one run only: not a common step
    write_csv_rows(tmp_path / "countdown" / "curves.csv", rows)
    d, n_runs, n_heldout, commit = figures.curves_data("countdown", "acc")
    assert (n_runs, n_heldout, commit) == (3, 256, "abc1234")
    assert d["sft"]["steps"] == d["gift"]["steps"] == d["gift - sft"]["steps"] == [0, 8]
    assert (d["sft"]["cost"], d["gift"]["cost"]) == (1.0, 1.3)

    def half(values):
        return 4.302653 * statistics.stdev(values) / math.sqrt(3)
    mean, lo, hi = d["sft"]["stats"][1]
    assert mean == pytest.approx(30) and hi - mean == pytest.approx(half([20, 30, 40]), rel=1e-5)
    assert mean - lo == pytest.approx(hi - mean)
    assert d["gift - sft"]["stats"][0] == (0.0, 0.0, 0.0)  # step 0: both are the base
    mean, lo, hi = d["gift - sft"]["stats"][1]  # the pairs' differences are 6, 3, 7
    assert mean == pytest.approx(16 / 3) and hi - mean == pytest.approx(half([6, 3, 7]), rel=1e-5)


def test_masks_data_applies_theorem_one(tmp_path, monkeypatch):
    """masks_data: t_i = 1 - (1 - p)^(beta_i / mean beta) (p = (1 - eps) t + eps) for each model's answer, and the
    mean beta of each label over all examples."""
    monkeypatch.setattr(figures, "RESULTS", tmp_path)
    examples = [dict(item=["0100", "2134"], tokens=list("ab"), labels=["blank", "given"], beta_base=[1.0, 3.0],
                     beta_gift=[2.0, 0.5]),
                dict(item=["0000", "1234"], tokens=list("cd"), labels=["blank", "blank"], beta_base=[2.0, 2.0],
                     beta_gift=[1.5, 0.5])]
    (tmp_path / "sudoku").mkdir()
    (tmp_path / "sudoku" / "masks.json").write_text(json.dumps(dict(task="sudoku", base=0, seed=0, steps=640,
                                                                    commit="abc", examples=examples)))
    d = figures.masks_data("sudoku", t=0.5)
    p = (1 - 1e-3) * 0.5 + 1e-3
    for ex in d["examples"]:
        for model in ("base", "gift"):
            beta = ex[f"beta_{model}"]
            expected = [1 - (1 - p) ** (b / (sum(beta) / len(beta))) for b in beta]
            assert ex[f"t_{model}"] == pytest.approx(expected, abs=1e-12)
    assert d["mean"]["base"] == pytest.approx(dict(blank=5 / 3, given=3.0))
    assert d["mean"]["gift"] == pytest.approx(dict(blank=4 / 3, given=0.5))


@pytest.mark.parametrize("task, metric", [(task, metric) for task, metric, _ in figures.TASKS])
def test_the_committed_curves_and_masks_are_whole(task, metric):
    """experiments/results/<task>/curves.csv and masks.json, as the figures read them: 9 (base, seed) runs of sft and
    gift at 9 common steps (the base, then every 80 of 640), the last step's mean near the study's own full held-out
    accuracy, and 6 held-out answers whose labels match the task's layout."""
    d, n_runs, n_heldout, commit = figures.curves_data(task, metric)
    assert n_runs == 9 and d["sft"]["steps"] == list(range(0, 641, 80)) and commit
    assert d["sft"]["cost"] == 1.0 and d["gift"]["cost"] > 1.2
    for objective in ("sft", "gift"):
        mean, lo, hi = d[objective]["stats"][-1]
        assert lo <= mean <= hi and 0 < mean < 100
    record = figures.masks_data(task)
    assert len(record["examples"]) == 6
    for ex in record["examples"]:
        assert len(ex["tokens"]) == len(ex["labels"]) == len(ex["beta_base"]) == len(ex["beta_gift"])


def test_ema_is_the_recurrence():
    assert figures.ema([1.0, 0.0, 0.0], weight=0.5) == [1.0, 0.5, 0.25]
    assert figures.ema([]) == [] and figures.ema([3.0]) == [3.0]


def test_rl_rewards_and_columns_data(tmp_path):
    """rl_after_gift.png's data from the study's CSVs: each run's curve smoothed, then the mean and interval over the
    runs at each step; the five columns' means over their runs."""
    with open(tmp_path / "rewards.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["objective", "base", "seed", "step", "rollout", "reward_mean", "commit"])
        for objective, offset in (("sft", 0.0), ("gift", 0.1)):
            for seed, values in enumerate(([0.2, 0.4, 0.6], [0.4, 0.4, 0.8])):
                for k, v in enumerate(values):
                    w.writerow([objective, 0, seed, 1 + 8 * k, k, v + offset, "abc1234"])
    curves, commit = figures.rl_rewards_data(tmp_path, weight=0.5)
    assert commit == "abc1234" and curves["sft"]["steps"] == [1, 9, 17] and curves["sft"]["runs"] == 2
    smoothed = [figures.ema([0.2, 0.4, 0.6], 0.5), figures.ema([0.4, 0.4, 0.8], 0.5)]
    assert [m for m, _, _ in curves["sft"]["stats"]] == pytest.approx([statistics.mean(c) for c in zip(*smoothed)])
    assert [m for m, _, _ in curves["gift"]["stats"]] == pytest.approx([statistics.mean(c) + 0.1
                                                                        for c in zip(*smoothed)])
    with open(tmp_path / "results.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["column", "base", "seed", "cell_acc"])
        w.writerows([["base", 0, "", 50], ["base", 1, "", 60]] + [[c, b, 0, v + b] for c, v in (
            ("sft", 55), ("gift", 57), ("sft+rl", 58), ("gift+rl", 61)) for b in (0, 1)])
    assert [m for m, _, _ in figures.rl_columns_data(tmp_path)] == [55, 55.5, 57.5, 58.5, 61.5]


def test_rl_pairs_match_the_studys_results_md():
    """rl_after_gift.png's paired differences are results.md's (experiments/results/rl_after_gift/: the same pairs,
    the same test)."""
    text = (EXPERIMENTS / "results" / "rl_after_gift" / "results.md").read_text()
    for label, diffs, mean, lo, hi, p in figures.rl_pairs_data():
        a, b = (name.strip().lower() for name in label.split(" - "))
        assert len(diffs) == 9 and f"| {a} - {b} | {mean:.2f} [{lo:.2f}, {hi:.2f}] |" in text, label

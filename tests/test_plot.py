"""experiments/plot.py and experiments/figures.py without matplotlib: the data each figure draws (a run's
metrics.jsonl read into series; Theorem 1's curves from gift.py against the closed form; the main job's copied run;
the toy study's pairs against its summary.csv), that importing either file never imports matplotlib, and that
drawing without it stops in one line saying how to install it."""

import importlib.util
import json
import math
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


def test_masks_data_the_trained_model_puts_its_betas_on_the_blanks():
    """The committed main-job model (experiments/figures/data/sudoku-tiny/model/, ~0.7 MB, CPU): its first-pass
    betas on the blank cells of held-out puzzles are several times those on the givens, which it can copy from the
    prompt; the untrained model (the main job's seed-42 initialisation) is near-uniform everywhere (beta close to
    sqrt(log vocab)), so blanks and givens get the same beta and, at t = 0.5, the same t_i = 0.5."""
    d = figures.masks_data(n=8)
    assert len(d["puzzles"]) == 8 and all(len(row) == 16 for row in d["trained"]["betas"])
    assert sum(map(sum, d["blanks"])) == 8 * 8  # the held-out puzzles have 8 blanks each
    trained, untrained = d["trained"], d["untrained"]
    assert trained["mean_blank"] > 2 * trained["mean_given"]
    assert untrained["mean_blank"] == pytest.approx(untrained["mean_given"], rel=1e-3)
    assert untrained["mean_given"] == pytest.approx(math.sqrt(math.log(56)), rel=0.01)
    assert all(x == pytest.approx(0.5, abs=0.01) for row in untrained["t_i"] for x in row)
    blank_t = [x for row, b in zip(trained["t_i"], d["blanks"]) for x, blank in zip(row, b) if blank]
    given_t = [x for row, b in zip(trained["t_i"], d["blanks"]) for x, blank in zip(row, b) if not blank]
    assert sum(blank_t) / len(blank_t) > 0.5 > sum(given_t) / len(given_t)

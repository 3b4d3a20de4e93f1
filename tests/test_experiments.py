"""experiments/sudoku_gift_vs_sft.py: the smoke run end to end (a subprocess, as a user runs it), the grid split, the
reuse of finished work, and the statistics (Student t against closed forms and tables, the paired comparison)."""

import csv
import importlib.util
import json
import math
import shutil
import subprocess
import sys

import pytest
from conftest import REPO

SCRIPT = REPO / "experiments" / "sudoku_gift_vs_sft.py"


def load_script():
    spec = importlib.util.spec_from_file_location("sudoku_gift_vs_sft", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # importing starts no work
    return module


exp = load_script()


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One --smoke run (tiny model, two bases, one seed, sft, gift and gift-k4, both budgets) in a fresh folder."""
    out = tmp_path_factory.mktemp("smoke") / "run"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout


def test_smoke_run_writes_the_tables(smoke):
    out, stdout = smoke
    rows = read_csv(out / "results.csv")
    assert sorted((r["objective"], r["budget"], r["base"]) for r in rows) == sorted(
        (o, b, base) for o, b in (("sft", "steps"), ("gift", "steps"), ("gift-k4", "steps"), ("sft", "time"))
        for base in ("0", "1"))
    assert {r["beta_refresh_epochs"] for r in rows if r["objective"] == "gift-k4"} == {"4"}
    assert len({r["commit"] for r in rows}) == 1 and rows[0]["commit"] in (out / "results.md").read_text()
    for r in rows:
        assert 0 <= float(r["cell_acc"]) <= 100 and 0 <= float(r["puzzle_acc"]) <= 100
        assert float(r["step_time_s"]) > 0 and int(r["n_puzzles"]) == 16
    assert {r["norm"] for r in rows if r["objective"] == "gift"} == {"masked"}  # gift.DEFAULT_NORM
    steps = {(r["objective"], r["budget"]): int(r["steps"]) for r in rows}
    assert steps[("sft", "steps")] == steps[("gift", "steps")] == 6  # 3 epochs x 32 puzzles / batch 16
    assert steps[("sft", "time")] >= steps[("sft", "steps")]  # equal time: SFT gets at least as many steps
    summary = read_csv(out / "summary.csv")
    assert {(r["budget"], r["objective"]) for r in summary} == {
        (b, o) for b in ("steps", "time") for o in ("sft", "gift", "gift-k4")}
    assert {r["n_runs"] for r in summary} == {"2"}  # two bases x one seed
    md = (out / "results.md").read_text()
    for heading in ("## Equal optimizer steps", "## Equal wall time", "## GIFT's betas during training",
                    "## Which answer positions have high entropy", "## Base models",
                    "## GIFT with betas reused for K epochs"):
        assert heading in md
    assert "wrote" in stdout


def test_smoke_data_is_split_by_grid(smoke):
    out, _ = smoke
    data = json.loads((out / "data" / "data.json").read_text())
    held = {s for _, s in data["heldout"]}
    assert len(data["heldout"]) == 16 and len(held) <= 16
    assert not held & {s for _, s in data["base"] + data["finetune"]}  # no held-out solution grid in training
    assert not {p for p, _ in data["base"]} & {p for p, _ in data["finetune"]}
    assert all(9 <= p.count("0") <= 11 for p, _ in data["finetune"] + data["heldout"])
    assert all(2 <= p.count("0") <= 8 for p, _ in data["base"])


def test_smoke_entropy_analysis_covers_every_blank(smoke):
    out, _ = smoke
    data = json.loads((out / "data" / "data.json").read_text())
    base = json.loads((out / "base0" / "base.json").read_text())
    blanks = sum(p.count("0") for p, _ in data["finetune"][:16])  # --smoke analyses 16 puzzles
    assert sum(base["entropy"]["count_by_open"].values()) == blanks
    result = json.loads((out / "runs" / "base0" / "gift-steps-seed0" / "result.json").read_text())
    assert [step for step, _ in result["entropy"]] == [2, 4, 6]  # three kept models along 6 steps
    assert 0 <= result["entropy"][-1][1]["topk_blank_share"] <= 1
    assert result["betas"] and all(b[1] > 0 for b in result["betas"])  # (step, beta mean, beta std) logged


def test_rerun_reuses_the_base_and_the_finished_runs(smoke):
    out, _ = smoke
    before = {p: p.stat().st_mtime_ns for p in [*out.glob("base*/base.json"), *out.glob("runs/*/*/result.json")]}
    assert len(before) == 2 + 8
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {p: p.stat().st_mtime_ns for p in before} == before


def test_runs_made_by_another_commit_are_refused_unless_asked(smoke, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(smoke[0], out)
    result_path = out / "runs" / "base1" / "gift-k4-steps-seed0" / "result.json"
    result = json.loads(result_path.read_text())
    result_path.write_text(json.dumps(dict(result, commit="0123456789ab")))
    cmd = [sys.executable, str(SCRIPT), "--smoke", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "made by commit 0123456789ab" in proc.stderr and str(result_path) in proc.stderr
    proc = subprocess.run(cmd + ["--reuse-other-commit"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "runs reused from other commits: ['0123456789ab']" in (out / "results.md").read_text()


def test_bad_flags_are_refused():
    with pytest.raises(SystemExit):
        exp.parse_plan(["--objectives", "sft,nonsense"])
    with pytest.raises(SystemExit):
        exp.parse_plan(["--ft-blanks", "9"])
    with pytest.raises(SystemExit):
        exp.parse_plan(["--bases", "a,b"])
    plan = exp.parse_plan(["--smoke", "--seeds", "3,4"])
    assert exp.id_list(plan.seeds) == [3, 4] and plan.d_model == exp.SMOKE["d_model"]  # a given flag beats --smoke
    assert exp.parse_plan([]).n_heldout >= 1000  # the full run holds out at least 1000 puzzles


# -----------------------------------------------------------------------------
# Statistics


@pytest.mark.parametrize("t", [0.0, 0.3, 1.0, 2.5, 12.0])
def test_student_t_matches_closed_forms(t):
    assert exp.t_two_sided_p(t, 1) == pytest.approx(1 - 2 / math.pi * math.atan(t), abs=1e-12)  # Cauchy
    assert exp.t_two_sided_p(t, 2) == pytest.approx(1 - t / math.sqrt(2 + t * t), abs=1e-12)


def test_student_t_matches_tables():
    for df, q975 in ((1, 12.706205), (4, 2.776445), (9, 2.262157), (30, 2.042272), (10**6, 1.959966)):
        assert exp.t_quantile(0.975, df) == pytest.approx(q975, abs=1e-5)
        assert exp.t_two_sided_p(q975, df) == pytest.approx(0.05, abs=1e-6)


def test_betainc_closed_forms():
    for x in (0.01, 0.3, 0.5, 0.9):
        assert exp.betainc(1, 1, x) == pytest.approx(x, abs=1e-13)
        assert exp.betainc(2.5, 1, x) == pytest.approx(x ** 2.5, abs=1e-13)
        assert exp.betainc(1, 3.5, x) == pytest.approx(1 - (1 - x) ** 3.5, abs=1e-13)


def test_paired_test_by_hand():
    a, b = [71.0, 72.0, 73.0, 74.0, 75.0], [70.0, 71.0, 71.0, 73.0, 72.0]  # differences 1, 1, 2, 1, 3
    r = exp.paired_test(a, b)
    se = math.sqrt(0.8 / 5)  # sample variance of the differences is 0.8
    assert r["diff"] == pytest.approx(1.6) and r["wins"] == 5 and r["n"] == 5
    assert r["p"] == pytest.approx(exp.t_two_sided_p(1.6 / se, 4))
    assert 0.01 < r["p"] < 0.02  # t = 4.0 with 4 degrees of freedom
    assert r["lo"] == pytest.approx(1.6 - 2.776445 * se, abs=1e-5) and r["hi"] == pytest.approx(1.6 + 2.776445 * se,
                                                                                               abs=1e-5)
    assert math.isnan(exp.paired_test([1.0], [0.0])["p"])  # one seed: no test


def test_summarize_pairs_each_run_with_sft_of_the_same_seed():
    def run(name, budget, seed, cell, puzzle):
        return dict(spec=dict(name=name, budget=budget, seed=seed), steps=10, step_time_s=0.1, loop_s=1.0,
                    cell_acc=cell, puzzle_acc=puzzle, cell_se=1.0, puzzle_se=2.0)
    results = [run("gift", "steps", s, 60 + s + 2, 20 + s) for s in range(3)]
    results += [run("sft", "steps", s, 60 + s, 20 + s + 1) for s in range(3)]
    results += [run("sft", "time", s, 61 + s, 20 + s) for s in range(3)]
    rows = {(r["budget"], r["objective"]): r for r in exp.summarize(results)}
    assert rows[("steps", "gift")]["d_cell_acc"] == pytest.approx(2.0)  # seed-wise differences are exactly 2
    assert rows[("steps", "gift")]["d_cell_acc_p"] == 0.0 and rows[("steps", "gift")]["d_cell_acc_wins"] == "3/3"
    assert rows[("steps", "gift")]["d_puzzle_acc"] == pytest.approx(-1.0)
    assert rows[("time", "gift")]["d_cell_acc"] == pytest.approx(1.0)  # against the longer SFT run
    assert rows[("steps", "sft")]["cell_acc_mean"] == pytest.approx(61.0)
    assert rows[("steps", "sft")]["cell_acc_std"] == pytest.approx(1.0)
    assert "d_cell_acc" not in rows[("time", "sft")]


def test_paired_columns_separate_bases_from_seeds_by_hand():
    # base 0: differences 1, 2, 3 (mean 2, variance 1); base 1: 4, 4, 4 (mean 4, variance 0)
    diffs = {(0, 0): 1.0, (0, 1): 2.0, (0, 2): 3.0, (1, 0): 4.0, (1, 1): 4.0, (1, 2): 4.0}
    c = exp.paired_columns("cell_acc", diffs)
    assert c["d_cell_acc"] == pytest.approx(3.0) and c["d_cell_acc_wins"] == "6/6"
    assert c["d_cell_acc_sd_bases"] == pytest.approx(math.sqrt(2.0))  # sd of the base means 2 and 4
    assert c["d_cell_acc_sd_seeds"] == pytest.approx(math.sqrt(0.5))  # pooled: mean of the variances 1 and 0
    assert c["d_cell_acc_p"] == pytest.approx(exp.paired_test(list(diffs.values()), [0.0] * 6)["p"])
    assert c["d_cell_acc_p_bases"] == pytest.approx(exp.t_two_sided_p(3.0 / (math.sqrt(2.0) / math.sqrt(2)), 1))


def test_summarize_pairs_runs_by_base_and_seed():
    def run(name, base, seed, cell):
        return dict(spec=dict(name=name, budget="steps", base=base, seed=seed), steps=10, step_time_s=0.1 * (1 + (
            name == "gift")), loop_s=1.0, cell_acc=cell, puzzle_acc=cell, cell_se=1.0, puzzle_se=1.0)
    # the same seed number on two bases are different pairs: base 1's SFT is 10 points higher
    results = [run("sft", b, s, 60.0 + 10 * b + s) for b in (0, 1) for s in (0, 1)]
    results += [run("gift", b, s, 61.0 + 10 * b + s) for b in (0, 1) for s in (0, 1)]
    row = next(r for r in exp.summarize(results) if r["objective"] == "gift")
    assert row["d_cell_acc"] == pytest.approx(1.0) and row["d_cell_acc_sd_bases"] == pytest.approx(0.0)
    assert row["n_runs"] == 4 and row["n_bases"] == 2 and row["step_time_vs_sft"] == pytest.approx(2.0)

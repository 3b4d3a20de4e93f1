"""experiments/gift_vs_sft.py and its tasks (experiments/sudoku.py, experiments/countdown.py): the smoke runs of both
tasks end to end (subprocesses, as a user runs them), the Sudoku grid split, the Countdown generator (every canonical
answer passes d1's grader, the held-out problems are in no training set, the trained prompt is eval.py's), the step
costs and the equal-time budgets made from them, the reuse of finished work, and the statistics (Student t against
closed forms and tables, the paired comparison)."""

import csv
import importlib.util
import json
import math
import random
import shutil
import subprocess
import sys
import types

import pytest
from conftest import REPO

SCRIPT = REPO / "experiments" / "gift_vs_sft.py"


def load_script():
    spec = importlib.util.spec_from_file_location("gift_vs_sft", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # importing starts no work
    return module


exp = load_script()
countdown = exp.countdown  # the task modules, as the script imported them
import eval as E  # noqa: E402
from data import encode, load_dataset  # noqa: E402

# a smoke Countdown run is given its step costs: gift 1.5 x SFT, cached betas 1.0 x
GIVEN_COSTS = "gift=1.5,gift-elbo=1.2,gift-star=1.0,gift-reuse=1.0"


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def smoke_run(tmp_path_factory, *flags):
    out = tmp_path_factory.mktemp("smoke") / "run"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out), *flags], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One Sudoku --smoke run (tiny model, two bases, one seed, sft, gift and gift-k4, both budgets; the step costs
    measured) in a fresh folder."""
    return smoke_run(tmp_path_factory)


@pytest.fixture(scope="module")
def smoke_countdown(tmp_path_factory):
    """One Countdown --smoke run, its step costs given on the command line."""
    return smoke_run(tmp_path_factory, "--task", "countdown", "--step-costs", GIVEN_COSTS)


def check_tables(out, stdout, metrics, n_heldout):
    rows = read_csv(out / "results.csv")
    assert sorted((r["objective"], r["budget"], r["base"]) for r in rows) == sorted(
        (o, b, base) for o, b in (("sft", "steps"), ("gift", "steps"), ("gift-k4", "steps"), ("sft", "time"),
                                  ("sft", "time-k4")) for base in ("0", "1"))
    assert {r["beta_refresh_epochs"] for r in rows if r["objective"] == "gift-k4"} == {"4"}
    assert len({r["commit"] for r in rows}) == 1 and rows[0]["commit"] in (out / "results.md").read_text()
    for r in rows:
        assert all(0 <= float(r[m]) <= 100 for m in metrics)
        assert float(r["step_time_s"]) > 0 and float(r["cost_vs_sft"]) > 0
    assert {r["norm"] for r in rows if r["objective"] == "gift"} == {"masked"}  # gift.DEFAULT_NORM
    summary = read_csv(out / "summary.csv")
    assert {(r["budget"], r["objective"]) for r in summary} == {
        (b, o) for b in ("steps", "time") for o in ("sft", "gift", "gift-k4")} | {("time-k4", "sft"),
                                                                                  ("time-k4", "gift-k4")}
    assert {r["n_runs"] for r in summary} == {"2"}  # two bases x one seed
    md = (out / "results.md").read_text()
    for heading in ("## Equal optimizer steps", "## Equal wall time: SFT at gift's cost",
                    "## Equal wall time at K = 4: SFT at gift-k4's cost", "## GIFT's betas during training",
                    "## Which answer positions have high entropy", "## Base models",
                    "## GIFT with betas reused for K epochs", f"| {exp.COST_LABEL} |"):
        assert heading in md
    assert "wrote" in stdout
    return rows, md


def budget_steps(rows):
    return {(r["objective"], r["budget"]): int(r["steps"]) for r in rows}


# -----------------------------------------------------------------------------
# Sudoku


def test_smoke_run_writes_the_tables(smoke):
    out, stdout = smoke
    rows, md = check_tables(out, stdout, ("cell_acc", "puzzle_acc"), 16)
    assert {int(r["n_puzzles"]) for r in rows} == {16}
    costs = json.loads((out / "costs.json").read_text())
    assert costs["source"].startswith("measured") and sorted(costs["variants"]) == sorted(exp.COST_VARIANTS)
    assert "python bench/train_step.py" in (out / "costs.log").read_text()
    assert costs["shapes"]["seq"] == 108 and costs["shapes"]["prompt_len"] == 74  # Sudoku: 74 + 34 tokens
    steps = budget_steps(rows)
    assert steps[("sft", "steps")] == steps[("gift", "steps")] == 6  # 3 epochs x 32 puzzles / batch 16
    # equal wall time: the budgets come from the stored costs, and results.md gives the flag that reproduces them
    assert {b: steps[("sft", b)] for b in exp.EQUAL_TIME} == exp.equal_time_steps(
        6, costs["variants"], 3, ["sft", "gift", "gift-k4"])
    assert f"--step-costs {exp.format_costs(costs['variants'])}" in md


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


def check_curves(out, metric, n_curve):
    """curves.csv (--curve-points 3 in --smoke): for sft and gift, every (base, seed) at steps 0, 2, 4, 6, where step
    0 is the base's own grade on the first curve_heldout held-out examples, the same for both objectives; the cost
    column is the objective's cost x SFT."""
    rows = read_csv(out / "curves.csv")
    costs = json.loads((out / "costs.json").read_text())["variants"]
    runs = {}
    for r in rows:
        runs.setdefault((r["objective"], r["base"], r["seed"]), {})[int(r["step"])] = float(r[metric])
        assert float(r["cost_vs_sft"]) == pytest.approx(exp.objective_cost(r["objective"], costs, 3))
        assert int(r["n_heldout"]) == n_curve and 0 <= float(r[metric]) <= 100
    assert sorted(runs) == [(o, b, "0") for o in ("gift", "sft") for b in ("0", "1")]
    assert all(sorted(points) == [0, 2, 4, 6] for points in runs.values())
    for b in ("0", "1"):
        base = json.loads((out / f"base{b}" / "base.json").read_text())
        assert runs[("sft", b, "0")][0] == runs[("gift", b, "0")][0] == base["curve"][metric]


def check_masks(out, task, n_masks):
    """masks.json: the first n_masks held-out examples' answer betas under base 0 and its gift run's final model, one
    per answer token; the betas under the base are gift.first_pass_betas of that model on the example alone."""
    import torch
    import gift
    from data import load_tokenizer
    from model import LLaDA
    record = json.loads((out / "masks.json").read_text())
    data = json.loads((out / "data" / "data.json").read_text())
    assert (record["task"], record["base"], record["seed"], record["steps"]) == (task, 0, 0, 6)
    assert [ex["item"] for ex in record["examples"]] == data["heldout"][:n_masks]
    model, tokenizer = LLaDA.from_pretrained(out / "base0" / "model"), load_tokenizer(out / "base0" / "model")
    fields = types.SimpleNamespace(**exp.task_fields(exp.parse_plan(["--smoke", "--task", task])))
    for ex in record["examples"]:
        assert len(ex["tokens"]) == len(ex["labels"]) == len(ex["beta_base"]) == len(ex["beta_gift"])
        assert all(b > 0 and math.isfinite(b) for b in ex["beta_base"] + ex["beta_gift"])
        assert ex["beta_base"] != ex["beta_gift"]  # fine-tuning moved them
        (ids, p), = exp.TASKS[task].answer_rows(tokenizer, [ex["item"]], fields)[0]
        beta = gift.first_pass_betas(model, "entropy", torch.tensor([ids]), (torch.arange(len(ids)) >= p)[None],
                                     model.config.mask_token_id)[0, p:]
        assert torch.allclose(beta, torch.tensor(ex["beta_base"]), rtol=1e-4, atol=1e-6)
    return record


def test_smoke_curves_and_masks(smoke):
    out, _ = smoke
    check_curves(out, "cell_acc", 8)
    record = check_masks(out, "sudoku", 2)
    for ex in record["examples"]:
        puzzle, solution = ex["item"]
        digits = [tok for tok, lab in zip(ex["tokens"], ex["labels"]) if lab in ("blank", "given")]
        assert "".join(digits) == solution
        assert [lab == "blank" for lab in ex["labels"] if lab != "fixed"] == [ch == "0" for ch in puzzle]
        assert "".join(ex["tokens"]) == f"<answer>{solution}</answer>"  # <|eot_id|> decodes to ""


def test_rerun_reuses_the_base_the_costs_and_the_finished_runs(smoke):
    out, _ = smoke
    before = {p: p.stat().st_mtime_ns for p in [*out.glob("base*/base.json"), *out.glob("runs/*/*/result.json"),
                                                out / "costs.json"]}
    assert len(before) == 2 + 10 + 1
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


def compare_runs(*args):
    return subprocess.run([sys.executable, str(REPO / "experiments" / "compare_runs.py"), *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_one_row_rerun_elsewhere_is_identical_and_a_change_is_caught(smoke, tmp_path):
    """What experiments/README promises: one base and seed rerun into a new folder gives that row of the full run
    bit for bit (data, base weights and grades, each run's loss, betas, graded cells and weights), and
    experiments/compare_runs.py says so; a changed answer or weight in a copy is named."""
    out, _ = smoke
    one = tmp_path / "one"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--bases", "1", "--objectives", "sft,gift",
                           "--skip-equal-time", "--out", str(one)], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = compare_runs(out, one)
    assert proc.returncode == 0, proc.stdout
    lines = proc.stdout.splitlines()
    assert lines == ["data: identical", "base1: identical", "runs/base1/gift-steps-seed0: identical",
                     "runs/base1/sft-steps-seed0: identical", "4 of 4 identical"]
    # plant the differences the script is for: one held-out grade, then one weight of a kept model
    result_path = one / "runs" / "base1" / "gift-steps-seed0" / "result.json"
    result = json.loads(result_path.read_text())
    result["correct_cells"][3] += 1
    result_path.write_text(json.dumps(result))
    model = next((one / "runs" / "base1" / "sft-steps-seed0").rglob("model.safetensors"))
    model.write_bytes(model.read_bytes()[:-1] + bytes([model.read_bytes()[-1] ^ 1]))
    proc = compare_runs(out, one)
    assert proc.returncode == 1
    assert "runs/base1/gift-steps-seed0: DIFFERS in correct_cells" in proc.stdout
    assert "runs/base1/sft-steps-seed0: DIFFERS in model weights" in proc.stdout
    assert compare_runs(out, tmp_path / "nowhere").stderr.strip().endswith("no such folder")


@pytest.mark.parametrize("flags", [["--objectives", "sft,nonsense"], ["--ft-blanks", "9"], ["--bases", "a,b"],
                                   ["--task", "chess"], ["--step-costs", "gift=1.3"],
                                   ["--step-costs", "gift=1.3,gift-elbo=1.1,gift-star=1,gift-reuse=-1"],
                                   ["--task", "countdown", "--number-range", "9,1"],
                                   ["--task", "countdown", "--ft-numbers", "7"],
                                   ["--task", "countdown", "--max-target", "5"]])
def test_bad_flags_are_refused_in_one_line(flags, capsys):
    with pytest.raises(SystemExit):
        exp.parse_plan(flags)
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "error:" in last and flags[-2] in last  # the flag named in one line


def test_task_defaults_and_smoke_sizes():
    plan = exp.parse_plan(["--smoke", "--seeds", "3,4"])
    assert exp.id_list(plan.seeds) == [3, 4] and plan.d_model == exp.SMOKE["d_model"]  # a given flag beats --smoke
    assert plan.out == "runs/sudoku-gift-vs-sft-smoke"
    assert exp.parse_plan([]).n_heldout >= 1000  # the full run holds out at least 1000 examples
    assert exp.parse_plan([]).out == "runs/sudoku-gift-vs-sft"  # Sudoku's defaults are Plan's
    full = exp.parse_plan(["--task", "countdown"])
    assert full.n_heldout >= 1000 and full.out == "runs/countdown-gift-vs-sft"
    assert all(getattr(full, k) == v for k, v in countdown.DEFAULTS.items())
    assert exp.parse_plan(["--task", "countdown", "--out", "x"]).out == "x"


# -----------------------------------------------------------------------------
# The step costs and the equal-time budgets


def test_equal_time_budgets_from_given_costs_by_hand():
    costs = exp.parse_costs("gift=1.35,gift-elbo=1.2,gift-star=1.01,gift-reuse=0.95")
    names = list(exp.OBJECTIVES)
    # K = 4 over 20 epochs: passes in epochs 0, 4, 8, 12, 16: (1.35 + 3 x 0.95) / 4 = 1.05
    assert exp.objective_cost("gift-k4", costs, 20) == pytest.approx(1.05)
    assert exp.objective_cost("gift-kinf", costs, 20) == pytest.approx((1.35 + 19 * 0.95) / 20)  # the first epoch
    assert exp.objective_cost("gift-star", costs, 20) == pytest.approx(1.01 + 0.4 / 20)  # + one epoch of passes
    assert exp.objective_cost("gift-norm-answer", costs, 20) == exp.objective_cost("gift", costs, 20) == 1.35
    assert exp.objective_cost("sft", costs, 20) == 1.0 and exp.objective_cost("gift-elbo", costs, 20) == 1.2
    assert exp.equal_time_steps(640, costs, 20, names) == {"time": 864, "time-k4": 672}  # round(640 x cost)
    assert exp.equal_time_steps(640, costs, 20, ["sft", "gift-k4"]) == {"time-k4": 672}  # only what runs
    assert exp.parse_costs(exp.format_costs(costs)) == costs  # the printed flag gives the same numbers back


def test_bad_step_costs_say_what_is_wrong():
    for text, words in (("gift=1.3", "expected each of"),
                        ("gift=x,gift-elbo=1,gift-star=1,gift-reuse=1", "name=number"),
                        ("gift=0,gift-elbo=1,gift-star=1,gift-reuse=1", "positive")):
        with pytest.raises(ValueError, match=words):
            exp.parse_costs(text)


def test_given_costs_set_the_budgets_and_are_stored(smoke_countdown):
    out, _ = smoke_countdown
    costs = json.loads((out / "costs.json").read_text())
    assert costs["source"] == "given (--step-costs)" and costs["variants"] == exp.parse_costs(GIVEN_COSTS)
    steps = budget_steps(read_csv(out / "results.csv"))
    # 6 steps; gift: round(6 x 1.5) = 9; K = 4 over 3 epochs: one pass, (1.5 + 2 x 1.0) / 3 -> round(7.0) = 7
    assert steps[("sft", "steps")] == 6 and steps[("sft", "time")] == 9 and steps[("sft", "time-k4")] == 7
    assert not (out / "costs.log").exists()  # nothing measured


# -----------------------------------------------------------------------------
# Countdown


def plan_for(**kw):
    fields = dict(number_range="1,9", base_numbers="3", ft_numbers="4", max_target=100, n_heldout=300, n_ft=300,
                  n_base=2000, data_seed=0, n_entropy=16, number_order="drawn")
    return types.SimpleNamespace(**dict(fields, **kw))


@pytest.mark.parametrize("n_numbers,number_range,max_target", [(3, "1,9", 100), (4, "1,9", 100), (4, "1,25", 1000),
                                                                (2, "5,5", 30)])
def test_every_canonical_answer_passes_d1s_grader(n_numbers, number_range, max_target):
    rng = random.Random(n_numbers)
    low, high = countdown.int_pair(number_range)
    for _ in range(1000):
        p = countdown.draw_problem(rng, n_numbers, low, high, max_target)
        answer = countdown.PREFIX + p["expression"] + countdown.SUFFIX
        assert E.grade_countdown(answer + "<|eot_id|>" * 3, p["numbers"], p["target"]), p
        assert len(p["numbers"]) == n_numbers and all(low <= x <= high for x in p["numbers"])
        assert 1 <= p["target"] <= max_target and p["target"] == E.eval_arithmetic(p["expression"])
        assert len(p["expression"]) <= countdown.answer_tokens(plan_for(
            number_range=number_range, base_numbers=str(n_numbers), ft_numbers=str(n_numbers))) - 1 - len(
            countdown.PREFIX + countdown.SUFFIX)  # the fixed answer length holds the longest expression
    # a bare "<answer>EXPR</answer>" is not read by d1's grader: why the training answer is eval.py's boxed one
    assert not E.grade_countdown(f"<answer>{p['expression']}</answer>", p["numbers"], p["target"])
    assert E.shot_response("countdown", dict(numbers=[3, 5, 7], target=56), "plain") == (
        countdown.PREFIX + "7 * (3 + 5)" + countdown.SUFFIX)


def test_numbers_in_the_expressions_order():
    rng_drawn, rng_ordered = random.Random(7), random.Random(7)
    for _ in range(200):
        drawn = countdown.draw_problem(rng_drawn, 4, 1, 9, 100)
        ordered = countdown.draw_problem(rng_ordered, 4, 1, 9, 100, "expression")
        # the same draw; only the prompt's listing differs: the numbers as the expression uses them, left to right
        assert (ordered["target"], ordered["expression"]) == (drawn["target"], drawn["expression"])
        assert sorted(ordered["numbers"]) == sorted(drawn["numbers"])
        assert "".join(map(str, ordered["numbers"])) == "".join(c for c in ordered["expression"] if c.isdigit())


def test_the_canonical_expression_by_hand():
    def leaf(x):
        return (x, str(x), countdown.LEAF)
    minus = (2, "7-5", 1)
    assert countdown.wrap(minus, "*", False) == "(7-5)" and countdown.wrap(minus, "+", True) == "7-5"
    assert countdown.wrap(minus, "-", True) == "(7-5)" and countdown.wrap(minus, "-", False) == "7-5"
    assert countdown.wrap((6, "2*3", 2), "/", True) == "(2*3)" and countdown.wrap(leaf(4), "/", True) == "4"
    assert [countdown.apply(op, 7, 2) for op in "+-*/"] == [9, 5, 14, None]  # division only when exact
    assert countdown.apply("-", 2, 7) is None and countdown.apply("-", 3, 3) is None  # positive results only
    assert countdown.answer_tokens(plan_for()) == 15 + 11 + 10 + 1  # 4 one-digit numbers: at most "(1+2)*(3+4)"


def test_heldout_problems_are_in_no_training_set(tmp_path):
    plan = plan_for(base_numbers="3,4")  # 4-number pre-training problems could collide with held-out ones
    base, ft, heldout = countdown.build_data(plan, tmp_path)
    key = countdown.problem_key
    held = {key(p) for p in heldout}
    assert len(held) == 300 and len({key(p) for p in ft}) == 300  # distinct
    assert not held & {key(p) for p in base + ft} and not {key(p) for p in ft} & {key(p) for p in base}
    assert {len(p["numbers"]) for p in base} == {3, 4} and {len(p["numbers"]) for p in ft + heldout} == {4}
    # the same seed gives the same data, file for file
    again = tmp_path / "again"
    countdown.build_data(plan, again)
    for name in ("base.jsonl", "finetune.jsonl", "data.json"):
        assert (again / name).read_bytes() == (tmp_path / name).read_bytes()
    with pytest.raises(ValueError, match="could draw only"):
        countdown.build_data(plan_for(n_heldout=100, number_range="1,2", ft_numbers="2"), tmp_path / "small")


def test_countdown_trains_on_evals_plain_prompt_with_a_fixed_answer(smoke_countdown):
    """The rows gift.train reads (data.load_dataset on the JSONL): the prompt is eval.py's plain Countdown prompt,
    the answer the boxed expression padded with <|eot_id|> to the fixed length."""
    out, _ = smoke_countdown
    data = json.loads((out / "data" / "data.json").read_text())
    tokenizer = countdown.make_tokenizer()
    rows, _ = load_dataset(out / "data" / "finetune.jsonl", tokenizer)
    assert len(rows) == len(data["finetune"]) == 32
    eot = tokenizer.token_to_id("<|eot_id|>")
    for (ids, prompt_len), p in zip(rows, data["finetune"]):
        ids = ids.tolist()
        item = countdown.heldout_items([p])[0]
        assert item["question"] == E.COUNTDOWN_QUESTION.format(numbers=p["numbers"], target=p["target"])
        assert ids[:prompt_len] == encode(tokenizer, E.build_prompt("countdown", item, "plain"))
        answer = ids[prompt_len:]
        assert len(answer) == data["answer_tokens"] == 37 and answer[-1] == eot
        text = tokenizer.decode(answer, skip_special_tokens=True)
        assert text == countdown.PREFIX + p["expression"] + countdown.SUFFIX
        assert E.grade_countdown(tokenizer.decode(answer, skip_special_tokens=False), p["numbers"], p["target"])


def test_unencodable_characters_fail_in_one_line():
    problem = dict(numbers=[3, 4], target=12, expression="3×4")
    with pytest.raises(ValueError, match="cannot encode: '×'"):
        countdown.check_prompts(countdown.make_tokenizer(), [problem], plan_for())


def test_countdown_smoke_curves_and_masks(smoke_countdown):
    out, _ = smoke_countdown
    check_curves(out, "acc", 8)
    for ex in check_masks(out, "countdown", 2)["examples"]:
        text = "".join(tok for tok, lab in zip(ex["tokens"], ex["labels"]) if lab in ("digit", "operator",
                                                                                       "parenthesis"))
        assert text == ex["item"]["expression"]
        assert "".join(ex["tokens"]) == countdown.PREFIX + ex["item"]["expression"] + countdown.SUFFIX


def test_countdown_smoke_run_writes_the_tables(smoke_countdown):
    out, stdout = smoke_countdown
    rows, md = check_tables(out, stdout, ("acc", "numbers_ok"), 16)
    assert {int(r["n_problems"]) for r in rows} == {16}
    assert "| solved % |" in md and "| digit | operator | parenthesis |" in md
    data = json.loads((out / "data" / "data.json").read_text())
    key = countdown.problem_key
    assert not {key(p) for p in data["heldout"]} & {key(p) for p in data["base"] + data["finetune"]}
    result = json.loads((out / "runs" / "base0" / "gift-steps-seed0" / "result.json").read_text())
    assert len(result["correct"]) == len(result["answers"]) == 16
    entropy = result["entropy"][-1][1]
    expression_chars = sum(len(p["expression"]) for p in data["finetune"][:16])
    assert sum(entropy["count"][c] for c in ("digit", "operator", "parenthesis")) == expression_chars
    assert sum(entropy["count_by_index"].values()) == expression_chars
    assert entropy["count"]["prefix"] == 16 * len(countdown.PREFIX) and entropy["count"]["suffix"] == 16 * len(
        countdown.SUFFIX)
    assert 0 <= entropy["topk_expression_share"] <= 1


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
    rows = {(r["budget"], r["objective"]): r for r in exp.summarize(results)}  # Sudoku's metrics by default
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
    costs = exp.parse_costs("gift=1.35,gift-elbo=1.2,gift-star=1.01,gift-reuse=0.95")
    row = next(r for r in exp.summarize(results, costs=costs, epochs=20) if r["objective"] == "gift")
    assert row["d_cell_acc"] == pytest.approx(1.0) and row["d_cell_acc_sd_bases"] == pytest.approx(0.0)
    assert row["n_runs"] == 4 and row["n_bases"] == 2 and row["cost_vs_sft"] == 1.35  # the given cost, not the runs'
    assert row["step_time_s"] == pytest.approx(0.2)


def test_summarize_compares_gift_k4_with_sft_at_its_cost():
    def run(name, budget, seed, acc):
        return dict(spec=dict(name=name, budget=budget, seed=seed), steps=10, step_time_s=0.1, loop_s=1.0, acc=acc,
                    numbers_ok=acc, acc_se=1.0, numbers_ok_se=1.0)
    results = [run(n, "steps", s, 50.0 + 3 * (n != "sft") + s) for n in ("sft", "gift", "gift-k4") for s in range(3)]
    results += [run("sft", "time", s, 52.0 + s) for s in range(3)] + [run("sft", "time-k4", s, 51.0 + s)
                                                                        for s in range(3)]
    rows = {(r["budget"], r["objective"]): r for r in exp.summarize(results, countdown)}
    assert set(rows) == {(b, o) for b in ("steps", "time") for o in ("sft", "gift", "gift-k4")} | {
        ("time-k4", "sft"), ("time-k4", "gift-k4")}
    assert rows[("steps", "gift-k4")]["d_acc"] == pytest.approx(3.0)
    assert rows[("time", "gift-k4")]["d_acc"] == pytest.approx(1.0)  # against SFT at gift's cost
    assert rows[("time-k4", "gift-k4")]["d_acc"] == pytest.approx(2.0)  # against SFT at gift-k4's cost
    assert rows[("time-k4", "sft")]["acc_mean"] == pytest.approx(52.0)
    assert math.isnan(rows[("steps", "sft")]["cost_vs_sft"])  # no costs given


def test_rl_after_gift_smoke(tmp_path):
    """experiments/rl_after_gift.py --smoke: a base, its SFT and GIFT cold starts, wd1's RL from each, the five
    columns and the paired differences in results.md, the reward curves in rewards.csv."""
    out = tmp_path / "rl"
    proc = subprocess.run([sys.executable, str(REPO / "experiments" / "rl_after_gift.py"), "--smoke", "--out",
                           str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = read_csv(out / "results.csv")
    assert [r["column"] for r in rows] == ["base", "sft", "gift", "sft+rl", "gift+rl"]
    rewards = read_csv(out / "rewards.csv")
    assert {r["objective"] for r in rewards} == {"sft", "gift"} and len(rewards) == 2 * 2  # 2 rollouts each
    text = (out / "results.md").read_text()
    assert "| gift+rl - sft+rl |" in text and "the paper (8B) | 5.5 | 4.6 | 7.8 | 8.9 | 13.3 |" in text

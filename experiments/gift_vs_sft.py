"""GIFT vs SFT at toy scale: the paper's regime (GIFT, arXiv 2509.20863) -- full fine-tuning of a pretrained diffusion
LM on a small set of harder examples for many epochs -- on two tasks, 4x4 Sudoku and toy Countdown, on a 2-core CPU,
with several pre-trained bases, seeds and honest error bars.

    python experiments/gift_vs_sft.py                        # Sudoku, the full run (experiments/README.md)
    python experiments/gift_vs_sft.py --task countdown       # Countdown, the full run
    python experiments/gift_vs_sft.py --smoke                # tiny sizes, two bases, one seed: seconds (CI)

What it does, in order (every step is the repo's own code path; nothing is re-implemented). The task's own parts
(data, grading, which answer positions carry the entropy) are in experiments/sudoku.py and experiments/countdown.py.
  1. Data: pre-training examples (easier: Sudoku 2-8 blanks, Countdown 3 and 4 numbers), a small fine-tuning set
     of harder ones (Sudoku 9-11 blanks, Countdown 4 numbers) and >= 1000 held-out examples of the fine-tuning
     difficulty that no training set holds (Sudoku: split by solution grid; Countdown: by (numbers, target)).
  2. Base models ("pre-training"): tiny LLaDAs, randomly initialised (one seed each), trained with the SFT loss on
     the pre-training set by gift.train (the training loop of gift.py, fed a prompt/response JSONL). Each is saved
     once in <out>/base<b> and reused by every later invocation with the same settings.
  3. The cost of a step: each objective's optimizer step against SFT's, by bench/train_step.py's alternated timing
     at the study's shapes (measure_step_costs), kept in <out>/costs.json (or given by --step-costs), so that the
     equal-time budgets do not depend on the machine's load.
  4. Fine-tuning: for every base, objective and seed, gift.train from that base (full fine-tuning, same data, the
     same data order and per-example noise seeds for a given seed across objectives: data.epoch_order and
     data.example_generator depend only on --seed). Objectives: sft, gift, gift-elbo, gift-star, gift with
     --norm answer, gift with betas reused for 4 epochs or for ever.
     Budget 1, equal optimizer steps: every objective runs the same number of steps.
     Budget 2, equal wall time: SFT runs steps x cost(gift) / cost(sft) steps, and steps x cost(gift-k4) / cost(sft)
     (EQUAL_TIME); GIFT (resp. GIFT with K = 4) is compared with the SFT run that costs what it costs.
  5. Evaluation (eval.evaluate, prompt_style="plain", the whole fixed-length answer as one block, one token per
     step, as embedded.EMBEDDED_EVAL): d1's graders, each metric with its binomial standard error.
  6. Statistics over bases and seeds: mean and standard deviation, and the paired difference to SFT of the same
     base and seed (same data order and noise) with a paired t-test and its 95% interval (Student t written with
     math.lgamma; no scipy), the spread between bases apart from the spread between seeds.
  7. The mechanism (paper Figure 2): how GIFT's betas evolve (metrics.jsonl) and which answer positions carry high
     entropy, for the bases and along gift's training.

Outputs in --out: results.csv (one row per run), summary.csv (one row per objective and budget, with the paired
test), results.md (the tables), costs.json (the step costs), curves.csv (with --curve-points: held-out accuracy
along training), masks.json (the answer betas before and after fine-tuning), data/, base<b>/ (the pre-trained models),
runs/base<b>/<objective>-<budget>-seed<k>/ (metrics.jsonl, train.log, result.json, the final model and, for gift,
its intermediate models). An interrupted run continues: finished runs (result.json with the same settings), the
bases and the step costs are reused.
"""

import argparse
import concurrent.futures
import contextlib
import csv
import dataclasses
import json
import math
import multiprocessing
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import types
from dataclasses import dataclass, field
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the repo's top-level files are plain modules
sys.path.insert(0, str(Path(__file__).resolve().parent))  # and so are the tasks beside this file
import countdown  # noqa: E402
import gift  # noqa: E402
import longjob  # noqa: E402
import sudoku  # noqa: E402
from data import collate, load_tokenizer  # noqa: E402
from embedded import tiny_config_for  # noqa: E402
from model import LLaDA  # noqa: E402

# -----------------------------------------------------------------------------
# Constants and the plan

TASKS = {"sudoku": sudoku, "countdown": countdown}
# run name -> (gift.py --loss, --norm, --beta-refresh-epochs); norm "" = the objective's default normalisation
# (gift.DEFAULT_NORM); refresh 1 = the paper's entropy pass at every visit, 4 = betas reused for 4 epochs, 0 = never
# recomputed (each example's betas from its first visit)
OBJECTIVES = {
    "sft": ("sft", "", 1),
    "gift": ("gift", "", 1),
    "gift-elbo": ("gift-elbo", "", 1),
    "gift-star": ("gift-star", "", 1),
    "gift-norm-answer": ("gift", "answer", 1),
    "gift-k4": ("gift", "", 4),
    "gift-kinf": ("gift", "", 0),
}
# the steps bench/train_step.py times against SFT's (gift-reuse: a gift step whose betas come from the cache of
# --beta-refresh-epochs, no entropy pass); every objective's cost is made of them (objective_cost)
COST_VARIANTS = ("gift", "gift-elbo", "gift-star", "gift-reuse")
# equal wall time: budget -> the objective whose cost SFT is given; that objective is compared with that SFT run
EQUAL_TIME = {"time": "gift", "time-k4": "gift-k4"}
COST_LABEL = "cost x SFT, alternated timing (bench/train_step.py style) at the study's shapes"


@dataclass
class Plan:
    """The full run's sizes (the defaults: Sudoku's; countdown.DEFAULTS changes some for --task countdown) -- see
    experiments/README.md for the timing behind them."""
    task: str = field(default="sudoku", metadata={"help": "the task", "choices": tuple(TASKS)})
    out: str = field(default="runs/sudoku-gift-vs-sft", metadata={"help": "output folder (countdown: "
                                                                         "runs/countdown-gift-vs-sft)"})
    # model (tiny_config_for: char-level vocabulary with LLaDA's special tokens)
    d_model: int = field(default=64, metadata={"help": "model width"})
    n_layers: int = field(default=3, metadata={"help": "transformer blocks"})
    n_heads: int = field(default=4, metadata={"help": "attention heads"})
    mlp: int = field(default=192, metadata={"help": "MLP hidden size"})
    # data
    data_seed: int = field(default=0, metadata={"help": "seed of the split and of every example drawn"})
    n_heldout: int = field(default=1000, metadata={"help": "held-out examples (none in any training set)"})
    n_base: int = field(default=20000, metadata={"help": "pre-training examples"})
    n_ft: int = field(default=1000, metadata={"help": "fine-tuning examples"})
    # data: Sudoku (split by solution grid)
    heldout_grids: int = field(default=64, metadata={"help": "sudoku: solution grids (of 288) held out for evaluation"})
    base_blanks: str = field(default="2,8", metadata={"help": "sudoku: blanks per pre-training puzzle, low,high"})
    ft_blanks: str = field(default="9,11", metadata={"help": "sudoku: blanks per fine-tuning and held-out puzzle, "
                                                             "low,high"})
    # data: Countdown (a problem is its numbers and target)
    number_range: str = field(default="1,9", metadata={"help": "countdown: the numbers, low,high"})
    base_numbers: str = field(default="3,4", metadata={"help": "countdown: numbers per pre-training problem (a list: "
                                                             "drawn per problem, e.g. 3,3,4)"})
    ft_numbers: str = field(default="4", metadata={"help": "countdown: numbers per fine-tuning and held-out problem"})
    max_target: int = field(default=100, metadata={"help": "countdown: the largest target (and intermediate value)"})
    number_order: str = field(default="expression", metadata={"help": "countdown: the prompt lists the numbers in "
                                                                      "the order the training answer uses them, or "
                                                                      "as drawn", "choices": ("expression", "drawn")})
    # pre-training (SFT loss, gift.train)
    base_steps: int = field(default=3000, metadata={"help": "pre-training optimizer steps"})
    base_batch: int = field(default=32, metadata={"help": "pre-training batch size"})
    base_lr: float = field(default=2e-3, metadata={"help": "pre-training peak learning rate (cosine)"})
    base_warmup: int = field(default=100, metadata={"help": "pre-training warm-up steps"})
    base_seed: int = field(default=1234, metadata={"help": "base b's init, data order and noise seed is base_seed + b"})
    bases: str = field(default="0,1,2", metadata={"help": "independently pre-trained base models (comma-separated ids)"})
    # fine-tuning (gift.train, full fine-tuning)
    ft_epochs: int = field(default=20, metadata={"help": "fine-tuning epochs (equal-steps budget)"})
    ft_batch: int = field(default=32, metadata={"help": "fine-tuning batch size"})
    ft_lr: float = field(default=5e-4, metadata={"help": "fine-tuning peak learning rate (cosine)"})
    ft_warmup: int = field(default=20, metadata={"help": "fine-tuning warm-up steps"})
    ft_weight_decay: float = field(default=0.0, metadata={"help": "fine-tuning AdamW weight decay"})
    seeds: str = field(default="0,1,2", metadata={"help": "fine-tuning seeds per base and objective (comma-separated)"})
    base_only: bool = field(default=False, metadata={"help": "pre-train and evaluate the bases only (to size them)"})
    reuse_other_commit: bool = field(default=False, metadata={"help": "reuse finished runs made by another git "
                                                                      "commit (marked in results.md)"})
    objectives: str = field(default=",".join(OBJECTIVES), metadata={"help": "comma-separated, of " +
                                                                         "|".join(OBJECTIVES)})
    skip_equal_time: bool = field(default=False, metadata={"help": "skip the equal-wall-time SFT runs"})
    checkpoints: int = field(default=4, metadata={"help": "gift runs: models kept along training for the entropy "
                                                          "analysis (--curve-points replaces it when given)"})
    curve_points: int = field(default=0, metadata={"help": "sft and gift equal-step runs: also grade the held-out set "
                                                           "at this many evenly spaced steps (the learning curves of "
                                                           "curves.csv, experiments/figures.py); 0 = at the end only"})
    curve_heldout: int = field(default=256, metadata={"help": "held-out examples (the first ones) graded at each "
                                                              "curve point, the base's included"})
    n_masks: int = field(default=6, metadata={"help": "held-out examples whose answer betas masks.json keeps, from "
                                                      "the first base and its first gift run (experiments/figures.py)"})
    # the cost of a step (equal wall time)
    step_costs: str = field(default="", metadata={"help": "each step's cost x SFT's, e.g. gift=1.342,gift-elbo=1.151,"
                                                          "gift-star=1.003,gift-reuse=0.991 (results.md prints the "
                                                          "flag); default: <out>/costs.json, else measured"})
    cost_rounds: int = field(default=41, metadata={"help": "rounds of alternated timing when the costs are measured"})
    # evaluation and analysis
    eval_batch: int = field(default=64, metadata={"help": "held-out examples per generate() call"})
    n_entropy: int = field(default=256, metadata={"help": "fine-tuning examples used for the entropy analysis"})
    log_every: int = field(default=8, metadata={"help": "optimizer steps per metrics.jsonl line"})
    # machine
    workers: int = field(default=2, metadata={"help": "fine-tuning runs in parallel (processes)"})
    threads: int = field(default=1, metadata={"help": "torch threads per process, the base's included (more than one "
                                                      "thread per core collapses when the cores are shared)"})
    smoke: bool = field(default=False, metadata={"help": "tiny sizes, two bases, one seed, sft / gift / gift-k4: "
                                                         "seconds"})


# --smoke: every size tiny; flags given on the command line still win
SMOKE = dict(d_model=32, n_layers=1, n_heads=2, mlp=64, heldout_grids=16, n_heldout=16, n_base=64, n_ft=32,
             base_steps=4, base_batch=16, base_warmup=1, ft_epochs=3, ft_batch=16, ft_warmup=1, bases="0,1", seeds="0",
             objectives="sft,gift,gift-k4", checkpoints=3, curve_points=3, curve_heldout=8, n_masks=2, eval_batch=16,
             n_entropy=16, log_every=1, workers=1, cost_rounds=3)


def parse_plan(argv=None):
    """Flags generated from Plan (as gift.parse_options does for TrainOptions); the task's defaults, then --smoke's
    sizes, for the flags not given."""
    parser = argparse.ArgumentParser(description="GIFT vs SFT on 4x4 Sudoku or toy Countdown (experiments/README.md)")
    given = longjob.parse_dataclass_flags(parser, Plan, argv)
    plan = Plan(**given)
    task = TASKS[plan.task]
    defaults = dict(task.DEFAULTS, **(SMOKE if plan.smoke else {}))
    if plan.smoke:
        defaults["out"] = f"runs/{plan.task}-gift-vs-sft-smoke"
    for k, v in defaults.items():
        if k not in given:
            setattr(plan, k, v)
    unknown = [o for o in objective_names(plan) if o not in OBJECTIVES]
    if unknown:
        parser.error(f"--objectives: unknown {unknown}; choose from {', '.join(OBJECTIVES)}")
    for name in ("bases", "seeds"):
        try:
            assert id_list(getattr(plan, name))
        except (ValueError, AssertionError):
            parser.error(f"--{name} {getattr(plan, name)!r}: expected comma-separated integers, e.g. 0,1,2")
    task.check_plan(plan, parser.error)
    if plan.step_costs:
        try:
            parse_costs(plan.step_costs)
        except ValueError as e:
            parser.error(f"--step-costs {plan.step_costs!r}: {e}")
    for name in ("cost_rounds", "curve_heldout"):
        if getattr(plan, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(plan, name)}: must be at least 1")
    for name in ("curve_points", "n_masks"):
        if getattr(plan, name) < 0:
            parser.error(f"--{name.replace('_', '-')} {getattr(plan, name)}: must be 0 or more")
    return plan


def objective_names(plan):
    return [o.strip() for o in plan.objectives.split(",") if o.strip()]


def id_list(text):
    return sorted({int(x) for x in text.split(",") if x.strip()})


def task_fields(plan):
    """The Plan fields the task's functions read in a worker (its own and n_entropy)."""
    task = TASKS[plan.task]
    return {k: getattr(plan, k) for k in task.PLAN_FIELDS + ("n_entropy",)}


# -----------------------------------------------------------------------------
# The cost of a step: alternated timing (bench/train_step.py) at the study's shapes


def parse_costs(text):
    """--step-costs "gift=1.342,gift-elbo=1.151,gift-star=1.003,gift-reuse=0.991" -> {variant: cost x SFT}."""
    costs = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        try:
            costs[name.strip()] = float(value)
        except ValueError:
            raise ValueError(f"{part!r} is not name=number") from None
    if sorted(costs) != sorted(COST_VARIANTS):
        raise ValueError(f"expected each of {', '.join(COST_VARIANTS)} once, got {', '.join(costs)}")
    if not all(math.isfinite(v) and v > 0 for v in costs.values()):
        raise ValueError("costs must be positive numbers")
    return costs


def format_costs(costs):
    return ",".join(f"{k}={costs[k]:.3f}" for k in COST_VARIANTS)


def measure_step_costs(shapes, rounds, log_path):
    """Each variant's step time over SFT's, from bench/train_step.py itself: gift.train_step on one batch of the
    study's shapes (model sizes, vocabulary, batch, sequence and prompt length; full fine-tuning, float32, one
    thread, process CPU time), the variants alternated in rounds (ABCD, DCBA, ...) so that a shared machine's drift
    hits all alike, the median of the per-round ratios. Rounded to 3 decimals: the numbers stored and printed are the
    numbers used, so a rerun given them (--step-costs) computes the same budgets."""
    from bench import train_step as bench  # here: only a run that measures imports the benchmark
    argv = ["--d-model", str(shapes["d_model"]), "--n-heads", str(shapes["n_heads"]), "--n-layers",
            str(shapes["n_layers"]), "--mlp", str(shapes["mlp"]), "--vocab", str(shapes["vocab"]), "--seq",
            str(shapes["seq"]), "--batch", str(shapes["batch"]),
            "--prompt-frac", repr((shapes["prompt_len"] + 0.5) / shapes["seq"]),  # int(seq x frac) = prompt_len
            "--losses", ",".join(("sft",) + COST_VARIANTS), "--modes", "full", "--no-memory", "--repeats", str(rounds),
            "--warmup", "2", "--clock", "cpu", "--threads", "1"]
    threads = torch.get_num_threads()
    with open(log_path, "w") as log, contextlib.redirect_stdout(log):
        print("python bench/train_step.py " + " ".join(argv))
        rows = bench.run(bench.parse_args(argv))
    torch.set_num_threads(threads)
    return {r["loss"]: round(r["ratio"], 3) for r in rows if r["loss"] in COST_VARIANTS}


def objective_cost(name, costs, epochs):
    """An objective's average step cost x SFT's over a run of `epochs` epochs, from the variants' costs. gift with
    --beta-refresh-epochs K runs its entropy pass in 1 of every K epochs (K = 0: the first only) and reuses the
    betas otherwise: K = 4 over 20 epochs costs (gift + 3 gift-reuse) / 4. gift-star's one pass over the data with
    the frozen base (gift.initial_model_betas) costs one epoch of entropy passes, spread over the run."""
    loss, _, refresh = OBJECTIVES[name]
    if loss == "sft":
        return 1.0
    if loss == "gift-star":
        return costs["gift-star"] + (costs["gift"] - costs["gift-reuse"]) / epochs
    if loss == "gift-elbo":
        return costs["gift-elbo"]
    passes = epochs if refresh == 1 else 1 if refresh == 0 else math.ceil(epochs / refresh)
    return (passes * costs["gift"] + (epochs - passes) * costs["gift-reuse"]) / epochs


def equal_time_steps(steps, costs, epochs, names):
    """{budget: SFT's steps} for each equal-time budget whose objective runs: round(steps x its cost / SFT's)."""
    return {budget: round(steps * objective_cost(name, costs, epochs)) for budget, name in EQUAL_TIME.items()
            if name in names}


def step_costs(plan, out, shapes):
    """The variants' costs: --step-costs if given, else <out>/costs.json if it was measured at these shapes, else
    measured now (measure_step_costs). Written (back) to <out>/costs.json."""
    path = out / "costs.json"
    stored = json.loads(path.read_text()) if path.exists() else None
    if plan.step_costs:
        record = dict(variants=parse_costs(plan.step_costs), source="given (--step-costs)", shapes=shapes)
    elif stored and stored["shapes"] == shapes:
        return stored
    else:
        t0 = time.time()
        record = dict(variants=measure_step_costs(shapes, plan.cost_rounds, out / "costs.log"),
                      source=f"measured on {cpu_name()}, torch {torch.__version__}, {time.time() - t0:.0f} s",
                      shapes=shapes)
    path.write_text(json.dumps(record, indent=1))
    return record


# -----------------------------------------------------------------------------
# Statistics (Student t from the regularised incomplete beta function; math only)


def _betacf(a, b, x, iters=300, eps=1e-15):
    """Continued fraction of the incomplete beta function (modified Lentz, as in Numerical Recipes' betacf)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, iters + 1):
        for aa in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                   -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h


def betainc(a, b, x):
    """Regularised incomplete beta I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1) / (a + b + 2):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_two_sided_p(t, df):
    """P(|T| >= |t|) for Student's t with df degrees of freedom: I_{df / (df + t^2)}(df / 2, 1 / 2)."""
    return betainc(df / 2, 0.5, df / (df + t * t)) if math.isfinite(t) else 0.0


def t_quantile(q, df):
    """The q-quantile (q > 0.5) of Student's t, by bisection on the two-sided tail."""
    low, high = 0.0, 1e3
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if t_two_sided_p(mid, df) > 2 * (1 - q) else (low, mid)
    return (low + high) / 2


def paired_test(a, b):
    """Paired comparison of per-seed values a[s] - b[s]: mean difference, 95% t interval, two-sided paired t-test
    p-value and the number of seeds where a wins. NaN where fewer than 2 pairs."""
    d = [x - y for x, y in zip(a, b)]
    n = len(d)
    out = dict(n=n, diff=statistics.mean(d) if d else math.nan, lo=math.nan, hi=math.nan, p=math.nan,
               wins=sum(x > 0 for x in d))
    if n < 2:
        return out
    se = statistics.stdev(d) / math.sqrt(n)
    if se == 0:
        out.update(lo=out["diff"], hi=out["diff"], p=1.0 if out["diff"] == 0 else 0.0)
        return out
    half = t_quantile(0.975, n - 1) * se
    out.update(lo=out["diff"] - half, hi=out["diff"] + half, p=t_two_sided_p(out["diff"] / se, n - 1))
    return out


def mean_std(values):
    return (statistics.mean(values) if values else math.nan,
            statistics.stdev(values) if len(values) > 1 else math.nan)


def binomial_se(p, n):
    """Standard error of a proportion p (in [0, 1]) estimated from n trials, in percent points."""
    return 100.0 * math.sqrt(max(p * (1 - p), 0.0) / max(n, 1))


def grades(task, evaluation):
    """A task's held-out counts -> each metric in percent with its binomial SE (and the task's other fields)."""
    out = {k: v for k, v in evaluation.items() if k != "counts"}
    for key, se_key, _, _ in task.METRICS:
        hits, trials = evaluation["counts"][key]
        p = hits / trials
        out[key], out[se_key] = 100 * p, binomial_se(p, trials)
    return out


# -----------------------------------------------------------------------------
# Training through gift.train


def train_argv(model_dir, data_file, out, loss, norm, refresh, steps, batch, lr, warmup, weight_decay, seed,
               log_every, save_every, keep_last):
    """gift.py flags for one run (full fine-tuning, one process, float32 on the CPU, cosine schedule)."""
    argv = ["--model", str(model_dir), "--data", str(data_file), "--data-format", "prompt-response",
            "--out", str(out), "--loss", loss, "--epochs", "1000000", "--max-steps", str(steps),
            "--batch-size", str(batch), "--grad-accum", "1", "--lr", str(lr), "--schedule", "cosine",
            "--warmup-steps", str(warmup), "--weight-decay", str(weight_decay), "--grad-clip", "1.0",
            "--seed", str(seed), "--log-every", str(log_every), "--save-every", str(save_every),
            "--keep-last", str(keep_last), "--dtype", "float32"]
    return argv + (["--norm", norm] if norm else []) + (["--beta-refresh-epochs", str(refresh)] if refresh != 1 else [])


def step_time(metrics):
    """Median seconds per optimizer step over the log windows of metrics.jsonl (robust to a checkpoint save or a
    hiccup of a shared machine inside one window); the first window (warm-up) is dropped when there are others."""
    per_step = [(b["elapsed_s"] - a["elapsed_s"]) / (b["step"] - a["step"]) for a, b in zip(metrics, metrics[1:])]
    return statistics.median(per_step) if per_step else metrics[-1]["elapsed_s"] / metrics[-1]["step"]


def read_metrics(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def run_gift_train(argv, out):
    """gift.train in its claimed output folder (longjob.run_folder), with its log in <out>/train.log (workers run side
    by side). Returns (the trained model, its tokenizer, the last checkpoint's folder)."""
    opts = gift.parse_options(argv)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "train.log", "w") as log, contextlib.redirect_stdout(log):
        with longjob.run_folder(Path(opts.out), opts.resume, opts.overwrite) as preemption:
            model, inputs, final = gift.train(opts, preemption)
    return model, inputs.tokenizer, final


def git_commit():
    """The repo's commit, "+dirty" when tracked files differ from it; "unknown" outside a git checkout."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    try:
        return git("rev-parse", "--short=12", "HEAD") + ("+dirty" if git("status", "--porcelain", "-uno") else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def without_paths(spec):
    """A spec without its file locations: a moved or copied output folder is still reused."""
    return {k: v for k, v in spec.items() if k not in ("out", "base_dir", "data_jsonl", "data_json")}


def reusable(path, spec, commit, reuse_other_commit):
    """The finished result (or base.json) at `path` if it was made with `spec`, else None. One made with the same
    spec by another commit is refused (training numerics may have moved), unless reuse_other_commit."""
    if not path.exists():
        return None
    done = json.loads(path.read_text())
    if without_paths(done["spec"]) != without_paths(spec):
        return None
    if done.get("commit") != commit and not reuse_other_commit:
        raise SystemExit(f"{path} was made by commit {done.get('commit')}, this is {commit}: the numbers may differ. "
                         "Use a new --out to regenerate, or --reuse-other-commit to reuse it anyway")
    return done


def build_base(plan, b, folder, data_dir, commit):
    """Base b: a random tiny LLaDA (seed base_seed + b; saved as a Hugging Face folder with the task's char
    tokenizer), trained with the SFT loss on the pre-training set by gift.train. Reused when <folder>/base.json has
    the same settings."""
    task = TASKS[plan.task]
    spec = {k: getattr(plan, k) for k in ("task", "d_model", "n_layers", "n_heads", "mlp", "data_seed", "n_heldout",
                                          "n_base", "n_ft") + task.PLAN_FIELDS + ("base_steps", "base_batch",
                                                                                   "base_lr", "base_warmup")}
    spec["seed"] = plan.base_seed + b
    meta = reusable(folder / "base.json", spec, commit, plan.reuse_other_commit)
    if meta:
        return folder / "model", meta, True
    shutil.rmtree(folder, ignore_errors=True)
    tokenizer = task.make_tokenizer()
    config = tiny_config_for(tokenizer, d_model=plan.d_model, n_heads=plan.n_heads, n_kv_heads=plan.n_heads,
                             n_layers=plan.n_layers, mlp_hidden_size=plan.mlp, max_sequence_length=256)
    init = LLaDA(config).init_weights(torch.Generator().manual_seed(spec["seed"]))
    init.save_pretrained(folder / "init")
    tokenizer.save(str(folder / "init" / "tokenizer.json"))
    argv = train_argv(folder / "init", data_dir / "base.jsonl", folder / "train", "sft", "", 1, plan.base_steps,
                      plan.base_batch, plan.base_lr, plan.base_warmup, 0.0, spec["seed"], 50, plan.base_steps, 1)
    t0 = time.time()
    _, _, final = run_gift_train(argv, folder / "train")
    train_s = time.time() - t0
    shutil.copytree(final / "model", folder / "model")
    metrics = read_metrics(folder / "train")
    shutil.rmtree(folder / "train" / "checkpoints")  # the optimizer state is not needed again
    meta = dict(spec=spec, commit=commit, train_s=train_s, step_time_s=step_time(metrics),
                final_loss=metrics[-1]["loss"], n_params=sum(p.numel() for p in init.parameters()))
    (folder / "base.json").write_text(json.dumps(meta, indent=1))
    return folder / "model", meta, False


def prepare_base(plan_fields, b, commit):
    """Base b pre-trained (or reused), then evaluated on the held-out set and analysed (entropy by position).
    Returns (b, its model folder, its base.json)."""
    plan = Plan(**plan_fields)
    task = TASKS[plan.task]
    torch.set_num_threads(plan.threads)
    out = Path(plan.out)
    folder = out / f"base{b}"
    base_dir, meta, reused = build_base(plan, b, folder, out / "data", commit)
    data_key = {k: getattr(plan, k) for k in ("data_seed", "n_heldout", "n_ft", "eval_batch", "n_entropy")
                + task.PLAN_FIELDS}  # what the held-out evaluation and the analysis use
    if plan.curve_points:
        data_key["curve_heldout"] = plan.curve_heldout
    if meta.get("data_key") != data_key:
        data = json.loads((out / "data" / "data.json").read_text())
        model, tokenizer = LLaDA.from_pretrained(base_dir), load_tokenizer(base_dir)
        meta["eval"] = grades(task, task.evaluate_heldout(model, tokenizer, data["heldout"], plan.eval_batch, plan))
        meta["entropy"] = task.entropy_by_position(model, tokenizer, data["finetune"][:plan.n_entropy], plan)
        if plan.curve_points:  # the learning curves' step 0
            meta["curve"] = curve_point(task, model, tokenizer, data["heldout"][:plan.curve_heldout], plan.eval_batch,
                                        plan)
        meta["data_key"] = data_key
        (folder / "base.json").write_text(json.dumps(meta, indent=1))
    meta["reused"] = reused
    return b, str(base_dir), meta


def run_one(spec, commit, reuse_other_commit):
    """One fine-tuning run: gift.train from the base, then the held-out evaluation, the betas logged during
    training and, for gift, the entropy analysis at the kept checkpoints. Returns (and writes) result.json;
    a finished run with the same spec is read back instead."""
    torch.set_num_threads(spec["threads"])
    task, fields = TASKS[spec["task"]], types.SimpleNamespace(**spec["task_fields"])
    out = Path(spec["out"])
    result_path = out / "result.json"
    result = reusable(result_path, spec, commit, reuse_other_commit)
    if result:
        return result
    shutil.rmtree(out, ignore_errors=True)
    data = json.loads(Path(spec["data_json"]).read_text())
    steps = spec["steps"]
    entropy = spec["name"] == "gift" and spec["budget"] == "steps" and spec["checkpoints"] > 1
    curve = spec["curve_points"] if spec["name"] in ("sft", "gift") and spec["budget"] == "steps" else 0
    keep = curve or (spec["checkpoints"] if entropy else 1)  # models kept along training (sft and gift alike)
    save_every = max(1, steps // keep) if keep > 1 else steps
    argv = train_argv(spec["base_dir"], spec["data_jsonl"], out, *OBJECTIVES[spec["name"]], steps, spec["batch"],
                      spec["lr"], spec["warmup"], spec["weight_decay"], spec["seed"], spec["log_every"],
                      save_every, keep + 1)
    t0 = time.time()
    model, tokenizer, _ = run_gift_train(argv, out)
    train_s = time.time() - t0
    metrics = read_metrics(out)
    result = dict(spec=spec, commit=commit, steps=metrics[-1]["step"], step_time_s=step_time(metrics),
                  loop_s=metrics[-1]["elapsed_s"], train_s=train_s, final_loss=metrics[-1]["loss"],
                  betas=[(r["step"], r["beta_mean"], r["beta_std"]) for r in metrics if "beta_mean" in r])
    result.update(grades(task, task.evaluate_heldout(model, tokenizer, data["heldout"], spec["eval_batch"], fields)))
    for ckpt in sorted((out / "checkpoints").glob("step-*")) if entropy or curve else ():
        step, m = int(ckpt.name.split("-")[1]), LLaDA.from_pretrained(ckpt / "model")
        if entropy:  # the mechanism: entropies by position along training
            result.setdefault("entropy", []).append(
                (step, task.entropy_by_position(m, tokenizer, data["finetune"][:spec["n_entropy"]], fields)))
        if curve:  # the learning curve: held-out grades along training
            result.setdefault("curve", []).append(
                dict(step=step, **curve_point(task, m, tokenizer, data["heldout"][:spec["curve_heldout"]],
                                              spec["eval_batch"], fields)))
    for ckpt in (out / "checkpoints").glob("step-*"):  # keep the models, drop the optimizer states
        shutil.rmtree(ckpt / "train_state", ignore_errors=True)
    tmp = result_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, result_path)
    return result


def curve_point(task, model, tokenizer, heldout, batch_size, fields):
    """One point of a learning curve: the task's metrics (percent) on the first curve_heldout held-out examples."""
    e = grades(task, task.evaluate_heldout(model, tokenizer, heldout, batch_size, fields))
    return {key: e[key] for key, _, _, _ in task.METRICS}


def curve_rows(results, bases, costs, epochs, commit):
    """curves.csv: one row per learning-curve point of every sft and gift equal-step run (the base's grades at
    step 0), with the objective's cost x SFT so that a figure can put the curves on a cost axis."""
    rows = []
    for r in results:
        s = r["spec"]
        if "curve" not in r:
            continue
        cost = objective_cost(s["name"], costs, epochs)
        for point in [dict(step=0, **bases[s["base"]][1]["curve"])] + r["curve"]:
            rows.append(dict(objective=s["name"], base=s["base"], seed=s["seed"], cost_vs_sft=cost,
                             n_heldout=s["curve_heldout"], **point, commit=r.get("commit", commit)))
    rows.sort(key=lambda row: (row["objective"], row["base"], row["seed"], row["step"]))
    return rows


@torch.no_grad()
def answer_betas(task, model, tokenizer, items, fields):
    """gift.py's first-pass betas (Algorithm 1, entropy ** 0.5) over each example's answer: [{tokens, labels,
    beta}] (one entry per answer token; labels from the task's answer_rows)."""
    model.eval()
    rows, labels = task.answer_rows(tokenizer, items, fields)
    input_ids, answer_mask = collate(rows, model.config.pad_token_id)  # (B, L), (B, L)
    beta = gift.first_pass_betas(model, "entropy", input_ids, answer_mask, model.config.mask_token_id)  # (B, L)
    return [dict(tokens=[tokenizer.decode([i]) for i in ids[p:]], labels=lab, beta=beta[k, p:len(ids)].tolist())
            for k, ((ids, p), lab) in enumerate(zip(rows, labels))]


def masks_record(plan, results, bases, commit, command):
    """masks.json: what GIFT masks before and after fine-tuning -- the answer betas of the first n_masks held-out
    examples under the first base and under its first seed's gift run (equal steps, final model). None when that
    run is not in the plan."""
    b, s = min(bases), min(id_list(plan.seeds))
    run = next((r for r in results if (r["spec"]["name"], r["spec"]["budget"], r["spec"]["base"], r["spec"]["seed"])
                == ("gift", "steps", b, s)), None)
    if run is None or plan.n_masks == 0:
        return None
    task, fields = TASKS[plan.task], types.SimpleNamespace(**task_fields(plan))
    items = json.loads((Path(plan.out) / "data" / "data.json").read_text())["heldout"][:plan.n_masks]
    final = sorted((Path(run["spec"]["out"]) / "checkpoints").glob("step-*"))[-1] / "model"
    tokenizer = load_tokenizer(final)
    before, after = (answer_betas(task, LLaDA.from_pretrained(d), tokenizer, items, fields)
                     for d in (bases[b][0], final))
    examples = [dict(item=item, tokens=x["tokens"], labels=x["labels"], beta_base=x["beta"], beta_gift=y["beta"])
                for item, x, y in zip(items, before, after)]
    return dict(task=plan.task, base=b, seed=s, steps=run["steps"], commit=run.get("commit", commit),
                command=command, examples=examples)


def _init_worker(threads):
    torch.set_num_threads(threads)


def run_all(specs, workers, threads, on_done, commit, reuse_other_commit, run=None):
    """Every spec, in order, with `workers` processes side by side (1 = in this process); run(spec, commit,
    reuse_other_commit) does one (None: run_one, a fine-tuning run; experiments/rl_after_gift.py passes its RL run)."""
    run, results = run or run_one, []
    if workers <= 1:
        for s in specs:
            results.append(run(s, commit, reuse_other_commit))
            on_done(results[-1])
        return results
    ctx = multiprocessing.get_context("spawn")  # fresh interpreters: no forked torch thread pools
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                                                initargs=(threads,)) as pool:
        pending = {pool.submit(run, s, commit, reuse_other_commit): s for s in specs}
        while pending:
            done, _ = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
            for fut in done:
                pending.pop(fut)
                if fut.exception() is not None:  # fail fast: drop the queued runs instead of running them
                    pool.shutdown(wait=False, cancel_futures=True)
                    raise fut.exception()
                results.append(fut.result())
                on_done(results[-1])
    return results


def prepare_bases(plan, commit):
    """Every base of --bases, pre-trained side by side (`workers` processes). {b: (model folder, base.json)}."""
    fields, ids = dataclasses.asdict(plan), id_list(plan.bases)
    if plan.workers <= 1:
        done = [prepare_base(fields, b, commit) for b in ids]
    else:
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(plan.workers, mp_context=ctx) as pool:
            done = list(pool.map(prepare_base, [fields] * len(ids), ids, [commit] * len(ids)))
    return {b: (folder, meta) for b, folder, meta in done}


# -----------------------------------------------------------------------------
# Tables


def fmt(x, digits=1):
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def fmt_p(p):
    return "n/a" if math.isnan(p) else (f"{p:.3f}" if p >= 0.001 else f"{p:.1e}")


def pair_key(spec):
    """Runs are paired by (base, seed): same base model, same data order and noise."""
    return spec.get("base", 0), spec["seed"]


def paired_columns(metric, diffs):
    """diffs: {(base, seed): a run's metric minus its reference's}. The paired t-test over all pairs, the spread of
    the differences between bases (sd of the per-base means) and between seeds of one base (pooled within-base sd),
    and the t-test over the per-base means (the conservative one: one value per independently trained base)."""
    keys = sorted(diffs)
    every = paired_test([diffs[k] for k in keys], [0.0] * len(keys))
    per_base = [[diffs[k] for k in keys if k[0] == b] for b in sorted({b for b, _ in keys})]
    base_means = [statistics.mean(v) for v in per_base]
    within = [statistics.variance(v) for v in per_base if len(v) > 1]
    return {f"d_{metric}": every["diff"], f"d_{metric}_lo": every["lo"], f"d_{metric}_hi": every["hi"],
            f"d_{metric}_p": every["p"], f"d_{metric}_wins": f"{every['wins']}/{every['n']}",
            f"d_{metric}_sd_bases": statistics.stdev(base_means) if len(base_means) > 1 else math.nan,
            f"d_{metric}_sd_seeds": math.sqrt(statistics.mean(within)) if within else math.nan,
            f"d_{metric}_p_bases": paired_test(base_means, [0.0] * len(base_means))["p"]}


def summarize(results, task=sudoku, costs=None, epochs=1):
    """Per (budget, objective): mean / std over every (base, seed) run, the median step time, the objective's cost
    x SFT (objective_cost of the variants' costs; NaN without them), and paired_columns of the difference to the
    SFT run of the same base, seed and budget (equal steps: sft; equal wall time: the SFT run at the cost of the
    budget's objective, which is compared with it -- every objective for "time", gift-k4 alone for "time-k4").
    A list of summary rows."""
    by = {}
    for r in results:
        s = r["spec"]
        by.setdefault((s["budget"], s["name"]), {})[pair_key(s)] = r
    names = [n for n in OBJECTIVES if ("steps", n) in by]
    rows = []
    for budget in ("steps",) + tuple(EQUAL_TIME):
        ref = by.get((budget, "sft"))
        if ref is None:
            continue
        compared = ["sft", "gift-k4"] if budget == "time-k4" else names
        for name in [n for n in names if n in compared]:
            runs = ref if name == "sft" else by[("steps", name)]
            keys = sorted(runs)
            row = dict(budget=budget, objective=name, n_bases=len({b for b, _ in keys}), n_runs=len(keys),
                       steps=statistics.median(runs[k]["steps"] for k in keys),
                       step_time_s=statistics.median(runs[k]["step_time_s"] for k in keys),
                       cost_vs_sft=objective_cost(name, costs, epochs) if costs else math.nan,
                       loop_s=statistics.median(runs[k]["loop_s"] for k in keys))
            for metric, se, _, _ in task.METRICS:
                row[metric + "_mean"], row[metric + "_std"] = mean_std([runs[k][metric] for k in keys])
            for metric, se, _, _ in task.METRICS:
                row[se + "_binomial"] = statistics.mean(runs[k][se] for k in keys)
            if name != "sft":
                for metric, _, _, _ in task.METRICS:
                    row.update(paired_columns(metric, {k: runs[k][metric] - ref[k][metric] for k in keys if k in ref}))
            rows.append(row)
    return rows


def markdown(plan, command, commit, summary, results, bases, wall_s, costs, budgets, steps):
    """results.md: provenance, the step costs, the bases, the budgets' tables, the K trade-off, the betas' evolution
    and the entropy by position."""
    task = TASKS[plan.task]
    (m1, se1, label1, short1), (m2, se2, label2, short2) = task.METRICS
    lines = [f"# GIFT vs SFT on {task.TITLE}: results", ""]
    lines.append(f"Command: `{command}`  ")
    others = sorted(({r.get("commit") for r in results} | {m.get("commit") for _, m in bases.values()}) - {commit})
    lines.append(f"Commit: `{commit}`" + (f" (**runs reused from other commits: {others}**)" if others else "") + "  ")
    other_tasks = {k for t in TASKS.values() if t is not task for k in t.PLAN_FIELDS}
    lines.append("Settings: " + ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(plan).items()
                                          if k not in other_tasks) + "  ")
    lines.append(f"Machine: {cpu_name()}, {os.cpu_count()} logical CPUs, torch {torch.__version__}, "
                 f"{plan.workers} worker process(es) x {plan.threads} thread(s). Total wall time {wall_s / 60:.1f} min.")
    any_eval = next(iter(bases.values()))[1]["eval"]
    lines += ["", f"Held-out: {task.describe_heldout(plan, any_eval)}; mean +- sd over every (base, seed) run. delta = "
              "paired difference to SFT of the same base, seed and budget: mean over all pairs, 95% t interval and "
              "paired t-test p over all pairs; sd bases = spread of the per-base mean differences (base-to-base), "
              "sd seeds = pooled spread between seeds of one base; p bases = t-test over the per-base means (one "
              "value per independently pre-trained base: the conservative test).", ""]
    if costs:
        v, shape = costs["variants"], costs["shapes"]
        lines += [f"Step costs ({COST_LABEL}; {costs['source']}): one optimizer step of gift.train_step on a batch of "
                  f"{shape['batch']} rows of {shape['seq']} tokens ({shape['prompt_len']} prompt), full fine-tuning, "
                  "float32, one thread, the variants alternated in rounds, the median of the per-round ratios to SFT: "
                  f"gift {v['gift']:.3f}, gift-elbo {v['gift-elbo']:.3f}, gift-star {v['gift-star']:.3f}, gift with "
                  f"cached betas (gift-reuse) {v['gift-reuse']:.3f}. An objective's cost is their average over its "
                  f"{plan.ft_epochs} epochs (K = 4: (gift + 3 x gift-reuse) / 4; gift-star: plus its one pass over the "
                  f"data). A rerun reproduces these budgets with `--step-costs {format_costs(v)}`. s/step = the run's "
                  "own median step time, runs side by side on a shared machine (it measures the machine, not the "
                  "objective).", ""]
    lines += ["## Base models", "", f"| base | init seed | pre-training s | {label1} | SE | {label2} |",
              "|---|---|---|---|---|---|"]
    for b, (_, meta) in sorted(bases.items()):
        e = meta["eval"]
        lines.append(f"| {b} | {meta['spec']['seed']} | {meta['train_s']:.0f} | {fmt(e[m1])} | {fmt(e[se1])} | "
                     f"{fmt(e[m2])} |")
    titles = {"steps": "Equal optimizer steps", "time": "Equal wall time: SFT at gift's cost",
              "time-k4": "Equal wall time at K = 4: SFT at gift-k4's cost"}
    for budget, title in titles.items():
        rows = [r for r in summary if r["budget"] == budget]
        if not rows:
            continue
        lines += ["", f"## {title}", ""]
        if budget in EQUAL_TIME:
            name = EQUAL_TIME[budget]
            cost = objective_cost(name, costs["variants"], plan.ft_epochs)
            lines += [f"SFT runs {budgets[budget]} steps = round({steps} x {cost:.4f}), the cost of "
                      f"{name}'s {steps} steps. " + ("The other objectives are their equal-step runs." if budget ==
                                                     "time" else "gift-k4 is its equal-step run."), ""]
        lines.append(f"| objective | runs | steps | {COST_LABEL} | s/step in the run | {label1} | {label2} | delta "
                     f"{short1} vs SFT [95% CI] | p | wins | sd bases | sd seeds | p bases | delta {short2} [95% CI] | "
                     "p | reading |")
        lines.append("|---|" + "---|" * 15)
        for r in rows:
            dc = f"{r[f'd_{m1}']:+.1f} [{fmt(r[f'd_{m1}_lo'])}, {fmt(r[f'd_{m1}_hi'])}]" if f"d_{m1}" in r else "-"
            dp = f"{r[f'd_{m2}']:+.1f} [{fmt(r[f'd_{m2}_lo'])}, {fmt(r[f'd_{m2}_hi'])}]" if f"d_{m2}" in r else "-"
            name = r["objective"] + (f" (at {EQUAL_TIME[budget]}'s cost)" if budget != "steps" and
                                     r["objective"] == "sft" else "")
            lines.append(f"| {name} | {r['n_runs']} | {r['steps']:.0f} | {fmt(r['cost_vs_sft'], 3)} | "
                         f"{r['step_time_s']:.3f} | {fmt(r[m1 + '_mean'])} +- {fmt(r[m1 + '_std'])} | "
                         f"{fmt(r[m2 + '_mean'])} +- {fmt(r[m2 + '_std'])} | {dc} | "
                         f"{fmt_p(r.get(f'd_{m1}_p', math.nan))} | {r.get(f'd_{m1}_wins', '-')} | "
                         f"{fmt(r.get(f'd_{m1}_sd_bases'))} | {fmt(r.get(f'd_{m1}_sd_seeds'))} | "
                         f"{fmt_p(r.get(f'd_{m1}_p_bases', math.nan))} | {dp} | "
                         f"{fmt_p(r.get(f'd_{m2}_p', math.nan))} | "
                         f"{reading(r[f'd_{m1}_p'], r[f'd_{m1}']) if f'd_{m1}' in r else 'reference'} |")
        if budget == "steps":
            lines += ["", "s/step in the run = measured in the runs themselves, side by side on a shared machine "
                      "(indicative only; the step costs above set the budgets)."]

    # the K trade-off: betas reused for K epochs, against K = 1 (gift) of the same base and seed
    by = {(r["spec"]["name"], pair_key(r["spec"])): r for r in results if r["spec"]["budget"] == "steps"}
    k_names = [n for n in ("gift", "gift-k4", "gift-kinf") if any(name == n for name, _ in by)]
    if len(k_names) > 1:
        lines += ["", "## GIFT with betas reused for K epochs (--beta-refresh-epochs)", "",
                  "Equal optimizer steps. delta vs K = 1: paired difference to `gift` of the same base and seed.", "",
                  f"| objective | K | {COST_LABEL} | {label1} | delta {short1} vs K = 1 [95% CI] | p | sd bases | "
                  f"sd seeds | delta {short2} vs K = 1 | p |", "|---|---|---|---|---|---|---|---|---|---|"]
        for n in k_names:
            row = next(r for r in summary if r["budget"] == "steps" and r["objective"] == n)
            k = {1: "1", 0: "infinity"}.get(OBJECTIVES[n][2], str(OBJECTIVES[n][2]))
            if n == "gift":
                lines.append(f"| gift | 1 | {fmt(row['cost_vs_sft'], 3)} | {fmt(row[m1 + '_mean'])} +- "
                             f"{fmt(row[m1 + '_std'])} | - | | | | - | |")
                continue
            cols = {}
            for metric in (m1, m2):
                cols.update(paired_columns(metric, {key: by[(n, key)][metric] - by[("gift", key)][metric]
                                                    for name, key in by if name == n and ("gift", key) in by}))
            lines.append(f"| {n} | {k} | {fmt(row['cost_vs_sft'], 3)} | {fmt(row[m1 + '_mean'])} +- "
                         f"{fmt(row[m1 + '_std'])} | {cols[f'd_{m1}']:+.1f} [{fmt(cols[f'd_{m1}_lo'])}, "
                         f"{fmt(cols[f'd_{m1}_hi'])}] | {fmt_p(cols[f'd_{m1}_p'])} | "
                         f"{fmt(cols[f'd_{m1}_sd_bases'])} | {fmt(cols[f'd_{m1}_sd_seeds'])} | "
                         f"{cols[f'd_{m2}']:+.1f} | {fmt_p(cols[f'd_{m2}_p'])} |")

    # the betas during training (metrics.jsonl: mean / std of beta over the batch's answer tokens)
    traces = {}
    for r in results:
        if r["spec"]["budget"] == "steps" and r["betas"]:
            traces.setdefault(r["spec"]["name"], []).append(r["betas"])
    if traces:
        lines += ["", "## GIFT's betas during training", "",
                  "beta_i = sqrt(H_i) over all answer tokens of the batch (gift.py's metrics.jsonl), mean / spread, "
                  "averaged over seeds, at fractions of training:", "",
                  "| objective | " + " | ".join(f"{q:.0%}" for q in (0, .25, .5, .75, 1)) + " |",
                  "|---|" + "---|" * 5]
        for name, runs in traces.items():
            cells = []  # each run logs the same steps
            for q in (0, .25, .5, .75, 1):
                picks = [t[min(len(t) - 1, round(q * (len(t) - 1)))] for t in runs]
                cells.append(f"{statistics.mean(p[1] for p in picks):.3f} / {statistics.mean(p[2] for p in picks):.3f}")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")

    # which positions carry the entropy: the bases (step 0), then gift's kept models along training
    entropy = [r["entropy"] for r in results if r.get("entropy")]
    rows = [(0, [meta["entropy"] for _, meta in bases.values()])]
    if entropy:
        n_ckpt = min(len(e) for e in entropy)
        rows += [(entropy[0][i][0], [e[i][1] for e in entropy]) for i in range(n_ckpt)]
    lines += task.entropy_markdown(plan, rows)
    return "\n".join(lines) + "\n"


def cpu_name():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def reading(p, diff):
    """A plain label for a paired difference: significant at the 5% level (two-sided) or within noise."""
    if math.isnan(p):
        return "n/a (one seed)"
    if p >= 0.05:
        return "within noise"
    return "better than SFT" if diff > 0 else "worse than SFT"


def write_csv(path, rows):
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


# -----------------------------------------------------------------------------


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    plan = parse_plan(argv)
    task = TASKS[plan.task]
    command = " ".join(["python experiments/gift_vs_sft.py"] + argv)
    commit = git_commit()
    t_start = time.time()
    out = Path(plan.out)
    torch.set_num_threads(plan.threads)
    print(f"plan: {json.dumps(dataclasses.asdict(plan))}\ncommit: {commit}", flush=True)
    if commit.endswith("+dirty") or commit == "unknown":
        print(f"WARNING: commit {commit}: the results cannot be tied to a commit", flush=True)

    # 1. data: pre-training, fine-tuning, held-out (none of it in any training set)
    base_data, ft_data, heldout = task.build_data(plan, out / "data")
    tokenizer = task.make_tokenizer()
    task.check_prompts(tokenizer, base_data + ft_data + heldout, plan)
    print(f"data: {task.describe_data(plan, base_data, ft_data, heldout)}", flush=True)

    # 2. the base models, each pre-trained once from its own seed
    bases = prepare_bases(plan, commit)
    (m1, se1, _, short1), (m2, se2, _, short2) = task.METRICS
    for b, (_, meta) in sorted(bases.items()):
        e = meta["eval"]
        print(f"base {b}: {meta['n_params']} parameters, {meta['train_s']:.0f} s pre-training "
              f"({meta['step_time_s']:.3f} s/step{', reused' if meta['reused'] else ''}); held-out {short1} "
              f"{e[m1]:.1f} +- {e[se1]:.1f} %, {short2} {e[m2]:.1f} %", flush=True)
    if plan.base_only:  # pre-train (or reuse) and evaluate the bases only, e.g. to size them
        return

    # 3. the cost of a step of each objective, at the study's shapes (given, stored, or measured now)
    seq, prompt_len = task.shapes(tokenizer, ft_data, plan)
    shapes = dict(d_model=plan.d_model, n_layers=plan.n_layers, n_heads=plan.n_heads, mlp=plan.mlp,
                  vocab=tiny_config_for(tokenizer).vocab_size, seq=seq, prompt_len=prompt_len, batch=plan.ft_batch,
                  rounds=plan.cost_rounds)
    costs = step_costs(plan, out, shapes)
    steps = plan.ft_epochs * math.ceil(len(ft_data) / plan.ft_batch)
    names, seeds = objective_names(plan), id_list(plan.seeds)
    budgets = {} if plan.skip_equal_time else equal_time_steps(steps, costs["variants"], plan.ft_epochs, names)
    print(f"step costs x SFT ({costs['source']}): --step-costs {format_costs(costs['variants'])}; equal wall time: "
          + (", ".join(f"sft {n} steps at {EQUAL_TIME[b]}'s cost" for b, n in budgets.items()) or "none"), flush=True)

    # 4. fine-tuning runs: equal steps (sft and gift of each base and seed first), then equal wall time
    common = dict(task=plan.task, task_fields=task_fields(plan), data_jsonl=str(out / "data" / "finetune.jsonl"),
                  data_json=str(out / "data" / "data.json"), batch=plan.ft_batch, lr=plan.ft_lr,
                  warmup=plan.ft_warmup, weight_decay=plan.ft_weight_decay, log_every=plan.log_every,
                  eval_batch=plan.eval_batch, n_entropy=plan.n_entropy, checkpoints=plan.checkpoints,
                  curve_points=plan.curve_points, curve_heldout=plan.curve_heldout, threads=plan.threads)

    def spec(name, budget, b, s, n_steps):
        return dict(common, name=name, budget=budget, base=b, base_dir=bases[b][0], base_spec=bases[b][1]["spec"],
                    data_key=bases[b][1]["data_key"], seed=s, steps=n_steps,
                    out=str(out / "runs" / f"base{b}" / f"{name}-{budget}-seed{s}"))
    pairs = [(b, s) for b in sorted(bases) for s in seeds]
    specs = [spec(n, "steps", b, s, steps) for b, s in pairs for n in names if n in ("sft", "gift")]
    specs += [spec(n, "steps", b, s, steps) for n in names if n not in ("sft", "gift") for b, s in pairs]
    specs += [spec("sft", budget, b, s, n_steps) for budget, n_steps in budgets.items() for b, s in pairs]
    done = []

    def on_done(r):
        done.append(r)
        s = r["spec"]
        elapsed = time.time() - t_start
        print(f"[{elapsed / 60:5.1f} min] {len(done)}/{len(specs)} base {s['base']} {s['name']} ({s['budget']}) seed "
              f"{s['seed']}: {r['steps']} steps x {r['step_time_s']:.3f} s, {short1} {r[m1]:.1f} +- {r[se1]:.1f} %, "
              f"{short2} {r[m2]:.1f} % (eval {r['eval_s']:.0f} s)", flush=True)

    results = run_all(specs, plan.workers, plan.threads, on_done, commit, plan.reuse_other_commit)

    # 5. tables
    summary = summarize(results, task, costs["variants"], plan.ft_epochs)
    run_rows = []
    for r in results:
        loss, norm, refresh = OBJECTIVES[r["spec"]["name"]]
        row = dict(objective=r["spec"]["name"], loss=loss, norm=norm or gift.DEFAULT_NORM[loss],
                   beta_refresh_epochs=refresh, budget=r["spec"]["budget"], base=r["spec"]["base"],
                   seed=r["spec"]["seed"], steps=r["steps"],
                   cost_vs_sft=objective_cost(r["spec"]["name"], costs["variants"], plan.ft_epochs),
                   step_time_s=r["step_time_s"], loop_s=r["loop_s"], train_s=r["train_s"], eval_s=r["eval_s"])
        for metric, se, _, _ in task.METRICS:
            row.update({metric: r[metric], se: r[se]})
        row.update({k: r[k] for k in task.COUNTS})
        run_rows.append(dict(row, final_loss=r["final_loss"], commit=r.get("commit")))
    run_rows.sort(key=lambda r: (r["budget"], r["objective"], r["base"], r["seed"]))
    write_csv(out / "results.csv", run_rows)
    write_csv(out / "summary.csv", [dict(row, commit=commit) for row in summary])
    curves = curve_rows(results, bases, costs["variants"], plan.ft_epochs, commit)
    if curves:
        write_csv(out / "curves.csv", curves)
    masks = masks_record(plan, results, bases, commit, command)
    if masks:
        (out / "masks.json").write_text(json.dumps(masks))
    wall_s = time.time() - t_start
    text = markdown(plan, command, commit, summary, results, bases, wall_s, costs, budgets, steps)
    (out / "results.md").write_text(text)
    print(text)
    written = ["results.csv", "summary.csv", "results.md"] + ["curves.csv"] * bool(curves) + ["masks.json"] * bool(
        masks)
    print(f"wrote {', '.join(str(out / name) for name in written)} ({wall_s / 60:.1f} min)")


if __name__ == "__main__":
    main()

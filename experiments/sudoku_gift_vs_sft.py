"""GIFT vs SFT at toy scale: the paper's regime -- full fine-tuning of a pretrained diffusion LM on a small
set of harder examples for many epochs -- on 4x4 Sudoku, on a 2-core CPU, with seeds and honest error bars.

    python experiments/sudoku_gift_vs_sft.py            # the full run (plan and timing: experiments/README.md)
    python experiments/sudoku_gift_vs_sft.py --smoke    # tiny sizes, one seed, two objectives, seconds (CI)

What it does, in order (every step is the repo's own code path; nothing is re-implemented):
  1. Data (data.py): the 288 solution grids are split, by grid, into training grids and held-out grids
     (data.sudoku_split with test_grids=), so no held-out solution is ever seen in training. From the training grids:
     a broad pre-training set (many puzzles, few to medium blanks) and a small fine-tuning set of harder puzzles
     (more blanks); from the held-out grids: >= 1000 evaluation puzzles with the fine-tuning set's difficulty.
  2. Base model ("pre-training"): a tiny LLaDA, randomly initialised, trained with the SFT loss on the broad set by
     gift.train (the training loop of gift.py, fed a prompt/response JSONL). Saved once in <out>/base and reused by
     every later invocation with the same settings.
  3. Fine-tuning: for every objective and seed, gift.train from the SAME base (full fine-tuning, same data, the
     same data order and per-example noise seeds for a given seed across objectives: gift.epoch_order and
     gift.example_generator depend only on --seed). Objectives: sft, gift, gift-elbo, gift-star, and gift with
     --norm answer (GIFT's masking with SFT's normalisation, to separate the two changes).
     Budget 1, equal optimizer steps: every objective runs the same number of steps.
     Budget 2, equal wall time: SFT gets the seconds GIFT took: steps = GIFT's steps x (GIFT's median measured
     step time / SFT's), measured in this run (gift.train's metrics.jsonl; GIFT's no-grad entropy pass makes its
     step slower). Every GIFT variant's equal-step run is compared with this longer SFT run.
  4. Evaluation (eval.evaluate, prompt_style="plain", the 34-token answer generated exactly as gift.EMBEDDED_EVAL):
     cell accuracy over the blank cells (d1's Sudoku metric, eval.grade_sudoku) with its binomial standard error,
     and whole-puzzle accuracy.
  5. Statistics over seeds: mean and standard deviation, and the paired per-seed difference to SFT (same seed =
     same data order and noise) with a paired t-test and its 95% interval (Student t written with math.lgamma;
     no scipy).
  6. The mechanism (paper Figure 2 for Sudoku): how GIFT's betas evolve (metrics.jsonl: mean / spread over the
     answer during training) and which answer positions carry high entropy: blank cells vs given cells vs the
     fixed "<answer>...</answer><|eot_id|>" tokens, the share of each row's top-k entropies (k = its number of
     blanks) that are blank cells, and a blank cell's beta by the number of digits its given peers leave open.

Outputs in --out: results.csv (one row per run), summary.csv (one row per objective and budget, with the paired
test), results.md (the tables), base/ (the pre-trained model), runs/<objective>-<budget>-seed<k>/ (metrics.jsonl,
train.log, result.json, the final model and, for gift, its intermediate models). An interrupted run continues:
finished runs (result.json with the same settings) and the base are reused.
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
from dataclasses import dataclass, field
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the repo's top-level files are plain modules
import gift  # noqa: E402
from data import (SUDOKU_ANSWER, SUDOKU_TASK_PROMPT, SUDOKU_UNITS, collate, encode, load_tokenizer,  # noqa: E402
                  make_char_tokenizer, sudoku_examples, sudoku_split, tiny_config_for)
from eval import SUDOKU_QUESTION, build_prompt, evaluate  # noqa: E402
from model import LLaDA  # noqa: E402

# -----------------------------------------------------------------------------
# Constants and the plan

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
ANSWER_PREFIX = "<answer>"  # the answer is SUDOKU_ANSWER = "<answer>{16 digits}</answer>", then <|eot_id|>
PEERS = [sorted({j for unit in SUDOKU_UNITS if c in unit for j in unit} - {c}) for c in range(16)]  # 7 per cell


@dataclass
class Plan:
    """The full run's sizes (the defaults) -- see experiments/README.md for the timing estimate behind them."""
    out: str = field(default="runs/sudoku-gift-vs-sft", metadata={"help": "output folder"})
    # model (tiny_config_for: char-level vocabulary with LLaDA's special tokens)
    d_model: int = field(default=64, metadata={"help": "model width"})
    n_layers: int = field(default=3, metadata={"help": "transformer blocks"})
    n_heads: int = field(default=4, metadata={"help": "attention heads"})
    mlp: int = field(default=192, metadata={"help": "MLP hidden size"})
    # data: split by solution grid
    data_seed: int = field(default=0, metadata={"help": "seed of the grid split and of every puzzle draw"})
    heldout_grids: int = field(default=64, metadata={"help": "solution grids (of 288) held out for evaluation"})
    n_heldout: int = field(default=1000, metadata={"help": "held-out puzzles (from the held-out grids only)"})
    n_base: int = field(default=20000, metadata={"help": "pre-training puzzles (training grids)"})
    base_blanks: str = field(default="2,8", metadata={"help": "blanks per pre-training puzzle, low,high"})
    n_ft: int = field(default=1000, metadata={"help": "fine-tuning puzzles (training grids)"})
    ft_blanks: str = field(default="9,11", metadata={"help": "blanks per fine-tuning and held-out puzzle, low,high"})
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
                                                          "analysis"})
    # evaluation and analysis
    eval_batch: int = field(default=64, metadata={"help": "held-out puzzles per generate() call"})
    n_entropy: int = field(default=256, metadata={"help": "fine-tuning puzzles used for the entropy analysis"})
    log_every: int = field(default=8, metadata={"help": "optimizer steps per metrics.jsonl line"})
    # machine
    workers: int = field(default=2, metadata={"help": "fine-tuning runs in parallel (processes)"})
    threads: int = field(default=1, metadata={"help": "torch threads per process, the base's included (more than one "
                                                      "thread per core collapses when the cores are shared)"})
    smoke: bool = field(default=False, metadata={"help": "tiny sizes, one seed, sft and gift: seconds"})


# --smoke: every size tiny; flags given on the command line still win
SMOKE = dict(out="runs/sudoku-gift-vs-sft-smoke", d_model=32, n_layers=1, n_heads=2, mlp=64, heldout_grids=16,
             n_heldout=16, n_base=64, n_ft=32, base_steps=4, base_batch=16, base_warmup=1, ft_epochs=3, ft_batch=16,
             ft_warmup=1, bases="0,1", seeds="0", objectives="sft,gift,gift-k4", checkpoints=3, eval_batch=16,
             n_entropy=16, log_every=1, workers=1)


def parse_plan(argv=None):
    """Flags generated from Plan (as gift.parse_options does for TrainOptions); --smoke swaps in SMOKE's sizes
    for the flags not given."""
    parser = argparse.ArgumentParser(description="GIFT vs SFT on 4x4 Sudoku (experiments/README.md)")
    given = gift.parse_dataclass_flags(parser, Plan, argv)
    plan = Plan(**given)
    if plan.smoke:
        for k, v in SMOKE.items():
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
    for name in ("base_blanks", "ft_blanks"):
        try:
            low, high = blanks(getattr(plan, name))
            assert 1 <= low <= high <= 12
        except (ValueError, AssertionError):
            parser.error(f"--{name.replace('_', '-')} {getattr(plan, name)!r}: expected low,high with "
                         "1 <= low <= high <= 12, e.g. 9,11")
    return plan


def objective_names(plan):
    return [o.strip() for o in plan.objectives.split(",") if o.strip()]


def id_list(text):
    return sorted({int(x) for x in text.split(",") if x.strip()})


def blanks(text):
    low, high = (int(x) for x in text.split(","))
    return low, high


# -----------------------------------------------------------------------------
# Data: split by solution grid, written as the files gift.train and the workers read


def build_data(plan, folder):
    """Pre-training, fine-tuning and held-out puzzles; the first two as prompt/response JSONL (data.py's Sudoku
    prompt and answer, so gift.train tokenizes them exactly as data.sudoku_examples does) and everything as
    (puzzle, solution) pairs in data.json. Held-out puzzles come only from held-out grids."""
    folder.mkdir(parents=True, exist_ok=True)
    ft, heldout = sudoku_split(plan.n_ft, plan.n_heldout, blanks(plan.ft_blanks), seed=plan.data_seed,
                               test_grids=plan.heldout_grids)
    # the same seed permutes the grids the same way, so the same grids are held out; n_ft extra puzzles are drawn
    # so that the fine-tuning puzzles can be removed (fine-tuning data = puzzles the base has not seen)
    base, _ = sudoku_split(plan.n_base + plan.n_ft, 0, blanks(plan.base_blanks), seed=plan.data_seed,
                           test_grids=plan.heldout_grids)
    ft_puzzles = {p for p, _ in ft}
    base = [pair for pair in base if pair[0] not in ft_puzzles][:plan.n_base]
    leaked = {s for _, s in heldout} & {s for _, s in base + ft}
    if leaked:
        raise RuntimeError(f"experiments: {len(leaked)} held-out solution grids appear in the training data")
    for name, pairs in (("base", base), ("finetune", ft)):
        with open(folder / f"{name}.jsonl", "w") as f:
            for p, s in pairs:
                f.write(json.dumps({"prompt": SUDOKU_TASK_PROMPT.format(puzzle=p),
                                    "response": SUDOKU_ANSWER.format(solution=s)}) + "\n")
    (folder / "data.json").write_text(json.dumps({"base": base, "finetune": ft, "heldout": heldout}))
    return base, ft, heldout


def heldout_items(heldout):
    """eval.evaluate items: the embedded task's question (gift.evaluate_embedded uses the same)."""
    return [dict(question=SUDOKU_QUESTION.format(puzzle=p), puzzle=p, solution=s) for p, s in heldout]


def check_prompts(tokenizer, pairs):
    """The prompt the model is trained on (data.py's SUDOKU_TASK_PROMPT through the chat format) must be the prompt
    eval.py builds for prompt_style="plain" (SUDOKU_QUESTION, whose trailing newline the chat format strips)."""
    (ids, prompt_len), = sudoku_examples(tokenizer, pairs[:1])
    item = heldout_items(pairs[:1])[0]
    if encode(tokenizer, build_prompt("sudoku", item, "plain")) != list(ids[:prompt_len]):
        raise RuntimeError("experiments: the training prompt differs from eval.py's plain prompt")


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


# -----------------------------------------------------------------------------
# Evaluation and the entropy analysis


def evaluate_heldout(model, tokenizer, heldout, batch_size):
    """Held-out accuracy with eval.evaluate (greedy, the 34-token answer in 34 steps as gift.EMBEDDED_EVAL):
    cell accuracy over blanks (d1's metric) with its binomial SE, and whole-puzzle accuracy."""
    settings = {k: gift.EMBEDDED_EVAL[k] for k in ("prompt_style", "gen_length", "block_length", "steps")}
    t0 = time.time()
    _, records = evaluate(model, tokenizer, heldout_items(heldout), "sudoku", batch_size=batch_size, **settings)
    correct = [r["correct_cells"] for r in records]
    empty = [r["empty_cells"] for r in records]
    cell = sum(correct) / sum(empty)
    solved = sum(c == e for c, e in zip(correct, empty)) / len(records)
    return dict(cell_acc=100 * cell, cell_se=binomial_se(cell, sum(empty)), puzzle_acc=100 * solved,
                puzzle_se=binomial_se(solved, len(records)), n_cells=sum(empty), n_puzzles=len(records),
                correct_cells=correct, eval_s=time.time() - t0)


@torch.no_grad()
def entropy_by_position(model, tokenizer, pairs, batch_size=64):
    """Which answer positions get high entropy (paper Figure 2, for Sudoku). gift.entropy_betas (Algorithm 1: the
    whole answer masked, beta_i = H_i^0.5) on fine-tuning puzzles, grouped by what the position holds: a blank
    cell, a given cell (copied from the prompt), or the fixed tokens ("<answer>", "</answer>", <|eot_id|>).
    Also: the share of each row's k highest betas (k = its blanks) that are blank cells, the blank cells' mean
    r_i = beta_i / beta_ref (GIFT's masking-rate multiplier, Theorem 1), and a blank cell's beta by the number
    of digits its given peers leave open (1 = forced by its row / column / box)."""
    model.eval()
    pad = model.config.pad_token_id
    offset = len(encode(tokenizer, ANSWER_PREFIX))
    sums = dict(blank=[0.0, 0], given=[0.0, 0], fixed=[0.0, 0], ratio_blank=[0.0, 0], topk_blank=[0.0, 0])
    by_open = {str(k): [0.0, 0] for k in range(1, 5)}  # str keys: the result goes through JSON
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start:start + batch_size]
        input_ids, answer_mask = collate(sudoku_examples(tokenizer, chunk), pad)  # (B, L), (B, L)
        beta = gift.first_pass_betas(model, "entropy", input_ids, answer_mask, model.config.mask_token_id)  # (B, L)
        for row, (puzzle, solution) in enumerate(chunk):
            start_cells = int((~answer_mask[row]).sum()) + offset
            cells = torch.arange(start_cells, start_cells + 16)
            assert tokenizer.decode(input_ids[row, cells].tolist()) == solution  # the layout assumption
            b_row = beta[row]
            b_answer = b_row[answer_mask[row]]
            beta_ref = float(b_answer.mean())
            is_blank = torch.tensor([ch == "0" for ch in puzzle])
            fixed = answer_mask[row].clone()
            fixed[cells] = False
            for name, values in (("blank", b_row[cells][is_blank]), ("given", b_row[cells][~is_blank]),
                                 ("fixed", b_row[fixed])):
                sums[name][0] += float(values.sum())
                sums[name][1] += len(values)
            if beta_ref > 0:
                sums["ratio_blank"][0] += float(b_row[cells][is_blank].sum()) / beta_ref
                sums["ratio_blank"][1] += int(is_blank.sum())
            k = int(is_blank.sum())
            top = torch.topk(b_row.masked_fill(~answer_mask[row], -1.0), k).indices
            blank_positions = set(cells[is_blank].tolist())
            sums["topk_blank"][0] += sum(int(i) in blank_positions for i in top) / max(k, 1)
            sums["topk_blank"][1] += 1
            for c in range(16):
                if puzzle[c] == "0":
                    n_open = 4 - len({puzzle[j] for j in PEERS[c]} - {"0"})
                    by_open[str(n_open)][0] += float(b_row[cells[c]])
                    by_open[str(n_open)][1] += 1
    mean = {k: (s / n if n else math.nan) for k, (s, n) in sums.items()}
    return dict(beta_blank=mean["blank"], beta_given=mean["given"], beta_fixed=mean["fixed"],
                ratio_blank=mean["ratio_blank"], topk_blank_share=mean["topk_blank"],
                beta_blank_by_open={k: (s / n if n else math.nan) for k, (s, n) in by_open.items()},
                count_by_open={k: n for k, (_, n) in by_open.items()})


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
    """gift.train with its log in <out>/train.log (workers run side by side)."""
    opts = gift.parse_options(argv)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "train.log", "w") as log, contextlib.redirect_stdout(log):
        return gift.train(opts)


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
    """Base b: a random tiny LLaDA (seed base_seed + b; saved as a Hugging Face folder with the char tokenizer),
    trained with the SFT loss on the broad set by gift.train. Reused when <folder>/base.json has the same
    settings."""
    spec = {k: getattr(plan, k) for k in ("d_model", "n_layers", "n_heads", "mlp", "data_seed", "heldout_grids",
                                          "n_base", "base_blanks", "n_ft", "ft_blanks", "base_steps", "base_batch",
                                          "base_lr", "base_warmup")}
    spec["seed"] = plan.base_seed + b
    meta = reusable(folder / "base.json", spec, commit, plan.reuse_other_commit)
    if meta:
        return folder / "model", meta, True
    shutil.rmtree(folder, ignore_errors=True)
    tokenizer = make_char_tokenizer()
    config = tiny_config_for(tokenizer, d_model=plan.d_model, n_heads=plan.n_heads, n_kv_heads=plan.n_heads,
                             n_layers=plan.n_layers, mlp_hidden_size=plan.mlp, max_sequence_length=256)
    init = LLaDA(config).init_weights(torch.Generator().manual_seed(spec["seed"]))
    init.save_pretrained(folder / "init")
    tokenizer.save(str(folder / "init" / "tokenizer.json"))
    argv = train_argv(folder / "init", data_dir / "base.jsonl", folder / "train", "sft", "", 1, plan.base_steps,
                      plan.base_batch, plan.base_lr, plan.base_warmup, 0.0, spec["seed"], 50, plan.base_steps, 1)
    t0 = time.time()
    _, _, _, final = run_gift_train(argv, folder / "train")
    train_s = time.time() - t0
    shutil.copytree(final / "model", folder / "model")
    metrics = read_metrics(folder / "train")
    shutil.rmtree(folder / "train" / "checkpoints")  # the optimizer state is not needed again
    meta = dict(spec=spec, commit=commit, train_s=train_s, step_time_s=step_time(metrics),
                final_loss=metrics[-1]["loss"], n_params=sum(p.numel() for p in init.parameters()))
    (folder / "base.json").write_text(json.dumps(meta, indent=1))
    return folder / "model", meta, False


def prepare_base(plan_fields, b, commit):
    """Base b pre-trained (or reused), then evaluated on the held-out puzzles and analysed (entropy by position).
    Returns (b, its model folder, its base.json)."""
    plan = Plan(**plan_fields)
    torch.set_num_threads(plan.threads)
    out = Path(plan.out)
    folder = out / f"base{b}"
    base_dir, meta, reused = build_base(plan, b, folder, out / "data", commit)
    data_key = {k: getattr(plan, k) for k in ("data_seed", "heldout_grids", "n_heldout", "n_ft", "ft_blanks",
                                              "eval_batch", "n_entropy")}  # what the held-out and analysis use
    if meta.get("data_key") != data_key:
        data = json.loads((out / "data" / "data.json").read_text())
        model, tokenizer = LLaDA.from_pretrained(base_dir), load_tokenizer(base_dir)
        meta["eval"] = evaluate_heldout(model, tokenizer, data["heldout"], plan.eval_batch)
        meta["entropy"] = entropy_by_position(model, tokenizer, data["finetune"][:plan.n_entropy])
        meta["data_key"] = data_key
        (folder / "base.json").write_text(json.dumps(meta, indent=1))
    meta["reused"] = reused
    return b, str(base_dir), meta


def run_one(spec, commit, reuse_other_commit):
    """One fine-tuning run: gift.train from the base, then the held-out evaluation, the betas logged during
    training and, for gift, the entropy analysis at the kept checkpoints. Returns (and writes) result.json;
    a finished run with the same spec is read back instead."""
    torch.set_num_threads(spec["threads"])
    out = Path(spec["out"])
    result_path = out / "result.json"
    result = reusable(result_path, spec, commit, reuse_other_commit)
    if result:
        return result
    shutil.rmtree(out, ignore_errors=True)
    data = json.loads(Path(spec["data_json"]).read_text())
    steps = spec["steps"]
    keep = spec["checkpoints"] if spec["name"] == "gift" and spec["budget"] == "steps" else 1
    save_every = max(1, steps // keep) if keep > 1 else steps
    argv = train_argv(spec["base_dir"], spec["data_jsonl"], out, *OBJECTIVES[spec["name"]], steps, spec["batch"],
                      spec["lr"], spec["warmup"], spec["weight_decay"], spec["seed"], spec["log_every"],
                      save_every, keep + 1)
    t0 = time.time()
    model, tokenizer, _, _ = run_gift_train(argv, out)
    train_s = time.time() - t0
    metrics = read_metrics(out)
    result = dict(spec=spec, commit=commit, steps=metrics[-1]["step"], step_time_s=step_time(metrics),
                  loop_s=metrics[-1]["elapsed_s"], train_s=train_s, final_loss=metrics[-1]["loss"],
                  betas=[(r["step"], r["beta_mean"], r["beta_std"]) for r in metrics if "beta_mean" in r])
    result.update(evaluate_heldout(model, tokenizer, data["heldout"], spec["eval_batch"]))
    if keep > 1:  # the mechanism: entropies by position along training
        pairs = data["finetune"][:spec["n_entropy"]]
        result["entropy"] = []
        for ckpt in sorted((out / "checkpoints").glob("step-*")):
            m = LLaDA.from_pretrained(ckpt / "model")
            result["entropy"].append((int(ckpt.name.split("-")[1]), entropy_by_position(m, tokenizer, pairs)))
    for ckpt in (out / "checkpoints").glob("step-*"):  # keep the models, drop the optimizer states
        shutil.rmtree(ckpt / "train_state", ignore_errors=True)
    tmp = result_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, result_path)
    return result


def _init_worker(threads):
    torch.set_num_threads(threads)


def run_all(first, second, workers, threads, on_done, commit, reuse_other_commit):
    """Run the `first` specs, then second(results) once every sft and gift run of `first` is done (the equal-time
    budget needs their measured step times), with `workers` processes side by side (1 = in this process)."""
    results = []
    key = ("name", "base", "seed")
    gate = [tuple(s[k] for k in key) for s in first if s["name"] in ("sft", "gift")]
    if workers <= 1:
        for s in first:
            results.append(run_one(s, commit, reuse_other_commit))
            on_done(results[-1])
        for s in second(results):
            results.append(run_one(s, commit, reuse_other_commit))
            on_done(results[-1])
        return results
    ctx = multiprocessing.get_context("spawn")  # fresh interpreters: no forked torch thread pools
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                                                initargs=(threads,)) as pool:
        pending = {pool.submit(run_one, s, commit, reuse_other_commit): s for s in first}
        released = False
        while pending:
            done, _ = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
            for fut in done:
                pending.pop(fut)
                if fut.exception() is not None:  # fail fast: drop the queued runs instead of running them
                    pool.shutdown(wait=False, cancel_futures=True)
                    raise fut.exception()
                results.append(fut.result())
                on_done(results[-1])
            finished = {tuple(r["spec"][k] for k in key) for r in results}
            if not released and all(g in finished for g in gate):
                released = True
                pending.update({pool.submit(run_one, s, commit, reuse_other_commit): s for s in second(results)})
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


def summarize(results):
    """Per (budget, objective): mean / std over every (base, seed) run, the median step time and its ratio to SFT
    of the same base and seed, and paired_columns of the difference to the SFT run of the same base, seed and budget
    (equal steps: sft; equal wall time: the longer sft-time run). A list of summary rows."""
    by = {}
    for r in results:
        s = r["spec"]
        by.setdefault((s["budget"], s["name"]), {})[pair_key(s)] = r
    names = [n for n in OBJECTIVES if ("steps", n) in by]
    sft_steps = by.get(("steps", "sft"), {})
    rows = []
    for budget in ("steps", "time"):
        ref = by.get((budget, "sft"))
        if ref is None:
            continue
        for name in names:
            runs = ref if name == "sft" else by[("steps", name)]
            keys = sorted(runs)
            ratios = [runs[k]["step_time_s"] / sft_steps[k]["step_time_s"] for k in keys if k in sft_steps]
            row = dict(budget=budget, objective=name, n_bases=len({b for b, _ in keys}), n_runs=len(keys),
                       steps=statistics.median(runs[k]["steps"] for k in keys),
                       step_time_s=statistics.median(runs[k]["step_time_s"] for k in keys),
                       step_time_vs_sft=statistics.median(ratios) if ratios else math.nan,
                       loop_s=statistics.median(runs[k]["loop_s"] for k in keys))
            for metric in ("cell_acc", "puzzle_acc"):
                row[metric + "_mean"], row[metric + "_std"] = mean_std([runs[k][metric] for k in keys])
            row["cell_se_binomial"] = statistics.mean(runs[k]["cell_se"] for k in keys)
            row["puzzle_se_binomial"] = statistics.mean(runs[k]["puzzle_se"] for k in keys)
            if name != "sft":
                for metric in ("cell_acc", "puzzle_acc"):
                    row.update(paired_columns(metric, {k: runs[k][metric] - ref[k][metric] for k in keys if k in ref}))
            rows.append(row)
    return rows


def markdown(plan, command, commit, summary, results, bases, wall_s, equal_time):
    """results.md: provenance, the bases, the two budgets' tables, the K trade-off, the betas' evolution and the
    entropy by position."""
    lines = ["# GIFT vs SFT on 4x4 Sudoku: results", ""]
    lines.append(f"Command: `{command}`  ")
    others = sorted(({r.get("commit") for r in results} | {m.get("commit") for _, m in bases.values()}) - {commit})
    lines.append(f"Commit: `{commit}`" + (f" (**runs reused from other commits: {others}**)" if others else "") + "  ")
    lines.append("Settings: " + ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(plan).items()) + "  ")
    lines.append(f"Machine: {cpu_name()}, {os.cpu_count()} logical CPUs, torch {torch.__version__}, "
                 f"{plan.workers} worker process(es) x {plan.threads} thread(s). Total wall time {wall_s / 60:.1f} min.")
    any_eval = next(iter(bases.values()))[1]["eval"]
    lines += ["", f"Held-out: {any_eval['n_puzzles']} puzzles ({any_eval['n_cells']} blank cells) from "
              f"{plan.heldout_grids} solution grids never seen in training. Cell accuracy = correct blanks / blanks "
              "(d1's metric); SE = binomial standard error of one run's accuracy on this held-out set (cells of one "
              "puzzle are not independent, so it is a lower bound); mean +- sd over every (base, seed) run. delta = "
              "paired difference to SFT of the same base, seed and budget: mean over all pairs, 95% t interval and "
              "paired t-test p over all pairs; sd bases = spread of the per-base mean differences (base-to-base), "
              "sd seeds = pooled spread between seeds of one base; p bases = t-test over the per-base means (one "
              "value per independently pre-trained base: the conservative test). x SFT = median ratio of the step "
              "time to SFT's of the same base and seed (runs side by side on a shared machine: indicative; "
              "bench/train_step.py measures it properly).", ""]
    lines += ["## Base models", "", "| base | init seed | pre-training s | cell acc % | SE | whole puzzles % |",
              "|---|---|---|---|---|---|"]
    for b, (_, meta) in sorted(bases.items()):
        e = meta["eval"]
        lines.append(f"| {b} | {meta['spec']['seed']} | {meta['train_s']:.0f} | {fmt(e['cell_acc'])} | "
                     f"{fmt(e['cell_se'])} | {fmt(e['puzzle_acc'])} |")
    for budget, title in (("steps", "Equal optimizer steps"), ("time", "Equal wall time")):
        rows = [r for r in summary if r["budget"] == budget]
        if not rows:
            continue
        lines += ["", f"## {title}", ""]
        if budget == "time":
            lines.append(f"SFT runs {equal_time['steps']} steps: the seconds of GIFT's equal-step run, from the median "
                         f"measured step times of the equal-step runs (gift {equal_time['gift']:.3f} s, sft "
                         f"{equal_time['sft']:.3f} s, ratio {equal_time['gift'] / equal_time['sft']:.2f}). The other "
                         "objectives are their equal-step runs.")
            lines.append("")
        lines.append("| objective | runs | steps | s/step | x SFT | cell acc % | whole puzzles % | delta cell vs SFT "
                     "[95% CI] | p | wins | sd bases | sd seeds | p bases | delta puzzles [95% CI] | p | reading |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            dc = (f"{r['d_cell_acc']:+.1f} [{fmt(r['d_cell_acc_lo'])}, {fmt(r['d_cell_acc_hi'])}]"
                  if "d_cell_acc" in r else "-")
            dp = (f"{r['d_puzzle_acc']:+.1f} [{fmt(r['d_puzzle_acc_lo'])}, {fmt(r['d_puzzle_acc_hi'])}]"
                  if "d_puzzle_acc" in r else "-")
            lines.append(f"| {r['objective']}{' (longer)' if budget == 'time' and r['objective'] == 'sft' else ''} "
                         f"| {r['n_runs']} | {r['steps']:.0f} | {r['step_time_s']:.3f} | "
                         f"{fmt(r['step_time_vs_sft'], 2)} | {fmt(r['cell_acc_mean'])} +- {fmt(r['cell_acc_std'])} | "
                         f"{fmt(r['puzzle_acc_mean'])} +- {fmt(r['puzzle_acc_std'])} | {dc} | "
                         f"{fmt_p(r.get('d_cell_acc_p', math.nan))} | {r.get('d_cell_acc_wins', '-')} | "
                         f"{fmt(r.get('d_cell_acc_sd_bases'))} | {fmt(r.get('d_cell_acc_sd_seeds'))} | "
                         f"{fmt_p(r.get('d_cell_acc_p_bases', math.nan))} | {dp} | "
                         f"{fmt_p(r.get('d_puzzle_acc_p', math.nan))} | "
                         f"{reading(r['d_cell_acc_p'], r['d_cell_acc']) if 'd_cell_acc' in r else 'reference'} |")

    # the K trade-off: betas reused for K epochs, against K = 1 (gift) of the same base and seed
    by = {(r["spec"]["name"], pair_key(r["spec"])): r for r in results if r["spec"]["budget"] == "steps"}
    k_names = [n for n in ("gift", "gift-k4", "gift-kinf") if any(name == n for name, _ in by)]
    if len(k_names) > 1:
        lines += ["", "## GIFT with betas reused for K epochs (--beta-refresh-epochs)", "",
                  "Equal optimizer steps. delta vs K = 1: paired difference to `gift` of the same base and seed.", "",
                  "| objective | K | x SFT per step | cell acc % | delta cell vs K = 1 [95% CI] | p | sd bases | "
                  "sd seeds | delta puzzles vs K = 1 | p |", "|---|---|---|---|---|---|---|---|---|---|"]
        for n in k_names:
            row = next(r for r in summary if r["budget"] == "steps" and r["objective"] == n)
            k = {1: "1", 0: "infinity"}.get(OBJECTIVES[n][2], str(OBJECTIVES[n][2]))
            if n == "gift":
                lines.append(f"| gift | 1 | {fmt(row['step_time_vs_sft'], 2)} | {fmt(row['cell_acc_mean'])} +- "
                             f"{fmt(row['cell_acc_std'])} | - | | | | - | |")
                continue
            cols = {}
            for metric in ("cell_acc", "puzzle_acc"):
                cols.update(paired_columns(metric, {key: by[(n, key)][metric] - by[("gift", key)][metric]
                                                    for name, key in by if name == n and ("gift", key) in by}))
            lines.append(f"| {n} | {k} | {fmt(row['step_time_vs_sft'], 2)} | {fmt(row['cell_acc_mean'])} +- "
                         f"{fmt(row['cell_acc_std'])} | {cols['d_cell_acc']:+.1f} [{fmt(cols['d_cell_acc_lo'])}, "
                         f"{fmt(cols['d_cell_acc_hi'])}] | {fmt_p(cols['d_cell_acc_p'])} | "
                         f"{fmt(cols['d_cell_acc_sd_bases'])} | {fmt(cols['d_cell_acc_sd_seeds'])} | "
                         f"{cols['d_puzzle_acc']:+.1f} | {fmt_p(cols['d_puzzle_acc_p'])} |")

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

    # which positions carry the entropy
    entropy = [r["entropy"] for r in results if r.get("entropy")]
    lines += ["", "## Which answer positions have high entropy", "",
              f"gift.entropy_betas on {plan.n_entropy} fine-tuning puzzles (the whole answer masked, Algorithm 1). "
              "Step 0 is the base models (= GIFT*'s fixed betas); later rows are gift's models along training, "
              "averaged over bases and seeds. top-k share = fraction of each answer's k highest betas (k = its number of "
              "blanks) that are blank cells; r blank = mean beta_i / beta_ref on blank cells (how much more often "
              "GIFT masks them than SFT's uniform rate would suggest).", "",
              "| step | beta blank | beta given | beta fixed tokens | top-k share | r blank |",
              "|---|---|---|---|---|---|"]
    rows = [(0, [meta["entropy"] for _, meta in bases.values()])]
    if entropy:
        n_ckpt = min(len(e) for e in entropy)
        rows += [(entropy[0][i][0], [e[i][1] for e in entropy]) for i in range(n_ckpt)]
    for step, stats in rows:
        avg = {k: statistics.mean(s[k] for s in stats) for k in ("beta_blank", "beta_given", "beta_fixed",
                                                                  "topk_blank_share", "ratio_blank")}
        lines.append(f"| {step} | {avg['beta_blank']:.3f} | {avg['beta_given']:.3f} | {avg['beta_fixed']:.3f} | "
                     f"{avg['topk_blank_share']:.2f} | {avg['ratio_blank']:.2f} |")
    lines += ["", "Blank cells by how many digits their given peers (row, column, box) leave open "
              "(1 = forced), mean beta (count):", "",
              "| step | " + " | ".join(f"{k} open" for k in range(1, 5)) + " |", "|---|" + "---|" * 4]
    for step, stats in rows:
        cells = []
        for k in range(1, 5):
            vals = [s["beta_blank_by_open"][str(k)] for s in stats if not math.isnan(s["beta_blank_by_open"][str(k)])]
            cells.append(f"{statistics.mean(vals):.3f} ({stats[0]['count_by_open'][str(k)]})" if vals else "-")
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
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
    command = " ".join(["python experiments/sudoku_gift_vs_sft.py"] + argv)
    commit = git_commit()
    t_start = time.time()
    out = Path(plan.out)
    torch.set_num_threads(plan.threads)
    print(f"plan: {json.dumps(dataclasses.asdict(plan))}\ncommit: {commit}", flush=True)
    if commit.endswith("+dirty") or commit == "unknown":
        print(f"WARNING: commit {commit}: the results cannot be tied to a commit", flush=True)

    # 1. data, split by solution grid
    base_pairs, ft_pairs, heldout = build_data(plan, out / "data")
    check_prompts(make_char_tokenizer(), ft_pairs)
    print(f"data: {len(base_pairs)} pre-training, {len(ft_pairs)} fine-tuning, {len(heldout)} held-out puzzles "
          f"({plan.heldout_grids} held-out grids)", flush=True)

    # 2. the base models, each pre-trained once from its own seed
    bases = prepare_bases(plan, commit)
    for b, (_, meta) in sorted(bases.items()):
        e = meta["eval"]
        print(f"base {b}: {meta['n_params']} parameters, {meta['train_s']:.0f} s pre-training "
              f"({meta['step_time_s']:.3f} s/step{', reused' if meta['reused'] else ''}); held-out cell accuracy "
              f"{e['cell_acc']:.1f} +- {e['cell_se']:.1f} %, whole puzzles {e['puzzle_acc']:.1f} %", flush=True)
    if plan.base_only:  # pre-train (or reuse) and evaluate the bases only, e.g. to size them
        return

    # 3. fine-tuning runs: equal steps first; sft and gift of each base and seed first and side by side (their step
    # times are measured under the same load, and the equal-time budget waits for them), then the other objectives
    steps = plan.ft_epochs * math.ceil(len(ft_pairs) / plan.ft_batch)
    names, seeds = objective_names(plan), id_list(plan.seeds)
    common = dict(data_jsonl=str(out / "data" / "finetune.jsonl"), data_json=str(out / "data" / "data.json"),
                  batch=plan.ft_batch, lr=plan.ft_lr, warmup=plan.ft_warmup, weight_decay=plan.ft_weight_decay,
                  log_every=plan.log_every, eval_batch=plan.eval_batch, n_entropy=plan.n_entropy,
                  checkpoints=plan.checkpoints, threads=plan.threads)

    def spec(name, budget, b, s, n_steps):
        return dict(common, name=name, budget=budget, base=b, base_dir=bases[b][0], base_spec=bases[b][1]["spec"],
                    data_key=bases[b][1]["data_key"], seed=s, steps=n_steps,
                    out=str(out / "runs" / f"base{b}" / f"{name}-{budget}-seed{s}"))
    pairs = [(b, s) for b in sorted(bases) for s in seeds]
    first = [spec(n, "steps", b, s, steps) for b, s in pairs for n in names if n in ("sft", "gift")]
    first += [spec(n, "steps", b, s, steps) for n in names if n not in ("sft", "gift") for b, s in pairs]
    equal_time = {}

    def second(results):  # equal wall time: SFT gets GIFT's seconds, from the measured median step times
        if plan.skip_equal_time or not {"sft", "gift"} <= set(names):
            return []
        t = {n: statistics.median(r["step_time_s"] for r in results if r["spec"]["name"] == n
                                  and r["spec"]["budget"] == "steps") for n in ("sft", "gift")}
        equal_time.update(t, steps=max(steps, round(steps * t["gift"] / t["sft"])))
        print(f"equal wall time: gift {t['gift']:.3f} s/step, sft {t['sft']:.3f} s/step -> sft runs "
              f"{equal_time['steps']} steps", flush=True)
        return [spec("sft", "time", b, s, equal_time["steps"]) for b, s in pairs]

    n_total = len(first) + (0 if plan.skip_equal_time or not {"sft", "gift"} <= set(names) else len(pairs))
    done = []

    def on_done(r):
        done.append(r)
        s = r["spec"]
        elapsed = time.time() - t_start
        print(f"[{elapsed / 60:5.1f} min] {len(done)}/{n_total} base {s['base']} {s['name']} ({s['budget']}) seed "
              f"{s['seed']}: {r['steps']} steps x {r['step_time_s']:.3f} s, cell {r['cell_acc']:.1f} +- "
              f"{r['cell_se']:.1f} %, puzzles {r['puzzle_acc']:.1f} % (eval {r['eval_s']:.0f} s)", flush=True)

    results = run_all(first, second, plan.workers, plan.threads, on_done, commit, plan.reuse_other_commit)

    # 4. tables
    summary = summarize(results)
    run_rows = []
    for r in results:
        loss, norm, refresh = OBJECTIVES[r["spec"]["name"]]
        run_rows.append(dict(objective=r["spec"]["name"], loss=loss, norm=norm or gift.DEFAULT_NORM[loss],
                             beta_refresh_epochs=refresh, budget=r["spec"]["budget"], base=r["spec"]["base"],
                             seed=r["spec"]["seed"], steps=r["steps"], step_time_s=r["step_time_s"],
                             loop_s=r["loop_s"], train_s=r["train_s"], eval_s=r["eval_s"], cell_acc=r["cell_acc"],
                             cell_se=r["cell_se"], puzzle_acc=r["puzzle_acc"], puzzle_se=r["puzzle_se"],
                             n_cells=r["n_cells"], n_puzzles=r["n_puzzles"], final_loss=r["final_loss"],
                             commit=r.get("commit")))
    run_rows.sort(key=lambda r: (r["budget"], r["objective"], r["base"], r["seed"]))
    write_csv(out / "results.csv", run_rows)
    write_csv(out / "summary.csv", [dict(row, commit=commit) for row in summary])
    wall_s = time.time() - t_start
    text = markdown(plan, command, commit, summary, results, bases, wall_s, equal_time)
    (out / "results.md").write_text(text)
    print(text)
    print(f"wrote {out / 'results.csv'}, {out / 'summary.csv'}, {out / 'results.md'} ({wall_s / 60:.1f} min)")


if __name__ == "__main__":
    main()

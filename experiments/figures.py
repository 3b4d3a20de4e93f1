"""The README's figures, redrawn from files in this repository (no training, a few seconds on a CPU):

    pip install matplotlib                  # figures only: gift.py, the other scripts and the tests never need it
    python experiments/figures.py           # -> experiments/figures/*.png

  theorem1.png      Theorem 1 seen: t_i = 1 - (1 - t)^(beta_i / beta_ref) against t for one answer's betas, beside
                    SFT's diagonal, and the expected number of masked tokens; computed by gift.py's own
                    `gift_mask_probs` and `sft_mask_probs`.
  main_job.png      The main job (`torchrun --nproc_per_node 2 gift.py`): its loss against the step and its held-out
                    Sudoku accuracy untrained and trained, from the copy in experiments/figures/data/sudoku-tiny/
                    (the run's metrics.jsonl and results.json, which name its commit).
  gift_vs_sft.png   The toy study (experiments/README.md): held-out accuracy of GIFT and its variants minus SFT's,
                    for each of the 9 (base, seed) pairs, with the mean and the 95% interval, from
                    experiments/results/{sudoku,countdown}/results.csv and summary.csv.
  curves.png        The toy study's learning curves: held-out accuracy of SFT and GIFT against the optimizer step and
                    against cost (GIFT's step costs 1.3 SFT steps), mean and 95% interval over the 9 (base, seed) runs,
                    and GIFT minus SFT paired by base and seed, both tasks, from experiments/results/*/curves.csv
                    (gift_vs_sft.py --curve-points 8: the command is in experiments/README.md).
  masks.png         What GIFT masks: gift.py's first-pass betas (Algorithm 1, entropy ** 0.5) over held-out answers
                    under the toy study's first base and under its GIFT fine-tuned model: Sudoku's 16 answer digits as
                    a grid (blanks against givens), Countdown's answer character by character, from
                    experiments/results/*/masks.json (written by the same study runs).

  rl_after_gift.png The appendix's RL at toy scale (experiments/rl_after_gift.py): wd1's mean reward per rollout from
                    the SFT and the GIFT cold starts (EMA-smoothed, as the paper's figure; mean and 95% interval over
                    the (base, seed) runs), and the five columns Base, SFT, GIFT, SFT+RL, GIFT+RL on held-out puzzles
                    beside the paper's, from experiments/results/rl_after_gift/{rewards,results}.csv.

Each PNG's caption names the commit of the data it draws and this command. The data functions (plain Python and
gift.py's Part I) are tested by tests/test_plot.py without matplotlib; the drawing functions import it.
"""

import csv
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # gift.py at the repository root; plot.py beside this file
from gift_vs_sft import paired_test  # noqa: E402
from plot import caption, metric_series, pyplot, read_metrics, repo_commit  # noqa: E402

FIGURES = HERE / "figures"
MAIN_JOB = FIGURES / "data" / "sudoku-tiny"  # copies of runs/sudoku-tiny/{metrics.jsonl,results.json}
RESULTS = HERE / "results"
COMMAND = "python experiments/figures.py"

# One answer of 9 tokens: six nearly certain, three uncertain. The mean beta (beta_ref) is 1, so r_i = beta_i.
BETAS = (0.25, 0.25, 0.25, 0.25, 0.5, 0.5, 1.0, 2.0, 4.0)

# The toy study's comparisons, as experiments/README.md's table: (label, objective, SFT's budget)
COMPARISONS = (("GIFT\nequal steps", "gift", "steps"),
               ("GIFT*\nequal steps", "gift-star", "steps"),
               ("GIFT K=4\nequal steps", "gift-k4", "steps"),
               ("GIFT\nequal cost", "gift", "time"),
               ("GIFT K=4\nequal cost", "gift-k4", "time-k4"))
TASKS = (("sudoku", "cell_acc", "4x4 Sudoku: held-out cells correct"),
         ("countdown", "acc", "toy Countdown: held-out problems solved"))


# ---------------------------------------------------------------------------------------------------------------------
# Data: no matplotlib


def theorem1_curves(n_t=201, betas=BETAS):
    """t, and for the row of `betas`: GIFT's t_i (len(betas), n_t) from gift_mask_probs (Theorem 1, beta_ref the
    row's mean beta, eps as in training), SFT's p (n_t,) from sft_mask_probs, and the ratios r_i = beta_i / beta_ref.
    Everything is computed by gift.py's Part I, not re-derived here."""
    import torch
    import gift
    t = torch.linspace(0, 1, n_t, dtype=torch.float64)  # one row per t
    beta = torch.tensor(betas, dtype=torch.float64).expand(n_t, -1)  # (T, n)
    answer = torch.ones_like(beta, dtype=torch.bool)
    t_i = gift.gift_mask_probs(t, beta, answer)  # (T, n)
    p = gift.sft_mask_probs(t, answer)[:, 0]  # (T,), the same for every token
    r = gift.beta_ratios(beta[:1], answer[:1])[0]  # (n,)
    return t.tolist(), t_i.T.tolist(), p.tolist(), r.tolist()


def expected_masked(t_i, p, keep):
    """E[#masked] over the tokens `keep` (indices): sum_i t_i for GIFT, len(keep) * p for SFT. Lists over t."""
    gift_sum = [sum(t_i[i][k] for i in keep) for k in range(len(p))]
    return gift_sum, [len(keep) * x for x in p]


def main_job_data(folder=MAIN_JOB):
    """The main job's loss series and its results.json (held-out accuracy untrained / trained, commit, steps)."""
    loss = metric_series(read_metrics(folder / "metrics.jsonl"))["loss"]
    results = json.loads((folder / "results.json").read_text())
    return loss, results


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def paired_differences(rows, metric, objective, budget):
    """{(base, seed): objective's metric - SFT's at `budget`}, the study's pairs (the objective's run is its equal-step
    run; at an equal-cost budget SFT is given more steps)."""
    def runs(obj, bud):
        return {(r["base"], r["seed"]): float(r[metric]) for r in rows if r["objective"] == obj and r["budget"] == bud}
    ours, sft = runs(objective, "steps"), runs("sft", budget)
    return {k: ours[k] - sft[k] for k in sorted(ours) if k in sft}


def study_data(task, metric):
    """For each comparison: (label, the 9 pairs' differences, summary.csv's mean, lo, hi, p); and the commit."""
    rows, summary = read_csv(RESULTS / task / "results.csv"), read_csv(RESULTS / task / "summary.csv")
    out = []
    for label, objective, budget in COMPARISONS:
        diffs = paired_differences(rows, metric, objective, budget)
        s = next(s for s in summary if s["objective"] == objective and s["budget"] == budget)
        out.append((label, diffs, *(float(s[f"d_{metric}{x}"]) for x in ("", "_lo", "_hi", "_p"))))
    commits = sorted({r["commit"][:7] for r in rows})
    return out, ", ".join(commits)


def mean_interval(values):
    """(mean, lo, hi): the mean of `values` and its 95% Student t interval (the study's paired_test against 0)."""
    test = paired_test(values, [0.0] * len(values))
    return test["diff"], test["lo"], test["hi"]


def curves_data(task, metric):
    """The toy study's learning curves (experiments/results/<task>/curves.csv, gift_vs_sft.py --curve-points): for
    "sft" and "gift", the steps and at each the mean and 95% interval of `metric` over the (base, seed) runs, and the
    objective's cost x SFT; for "gift - sft", the paired difference (same base and seed) at each step. Also the
    number of runs, the held-out examples graded per point, and the commit."""
    rows = read_csv(RESULTS / task / "curves.csv")
    runs = {}  # objective -> {(base, seed): {step: value}}
    for r in rows:
        runs.setdefault(r["objective"], {}).setdefault((r["base"], r["seed"]), {})[int(r["step"])] = float(r[metric])
    pairs = sorted(set(runs["sft"]) & set(runs["gift"]))
    steps = sorted(set.intersection(*(set(runs[o][k]) for o in ("sft", "gift") for k in pairs)))
    out = {}
    for objective in ("sft", "gift"):
        cost = float(next(r["cost_vs_sft"] for r in rows if r["objective"] == objective))
        stats = [mean_interval([runs[objective][k][s] for k in pairs]) for s in steps]
        out[objective] = dict(steps=steps, cost=cost, stats=stats)
    out["gift - sft"] = dict(steps=steps, stats=[mean_interval([runs["gift"][k][s] - runs["sft"][k][s]
                                                                for k in pairs]) for s in steps])
    return out, len(pairs), int(rows[0]["n_heldout"]), ", ".join(sorted({r["commit"][:7] for r in rows}))


def masks_data(task, t=0.5):
    """What GIFT masks before and after fine-tuning (experiments/results/<task>/masks.json, written by
    gift_vs_sft.py): each example's answer tokens, their labels and, for "base" and "gift" (its gift run's final
    model), the betas and Theorem 1's masking probability t_i at `t` (gift.py's gift_mask_probs, beta_ref the mean over
    the whole answer). Also the mean beta per label over the examples, for the title."""
    import torch
    import gift
    record = json.loads((RESULTS / task / "masks.json").read_text())
    for ex in record["examples"]:
        for model in ("base", "gift"):
            beta = torch.tensor([ex[f"beta_{model}"]], dtype=torch.float64)  # (1, answer)
            ex[f"t_{model}"] = gift.gift_mask_probs(torch.tensor([t], dtype=torch.float64), beta,
                                                    torch.ones_like(beta, dtype=torch.bool))[0].tolist()
    labels = sorted({lab for ex in record["examples"] for lab in ex["labels"]})
    record["mean"] = {model: {lab: statistics.mean(b for ex in record["examples"]
                                                   for b, l in zip(ex[f"beta_{model}"], ex["labels"]) if l == lab)
                              for lab in labels} for model in ("base", "gift")}
    record["t"] = t
    return record


# ---------------------------------------------------------------------------------------------------------------------
# Drawing: matplotlib


RL_COLUMNS = ("base", "sft", "gift", "sft+rl", "gift+rl")


def ema(values, weight=0.6):
    """Exponential moving average: s_0 = x_0, s_t = weight * s_{t-1} + (1 - weight) * x_t."""
    out = []
    for x in values:
        out.append(x if not out else weight * out[-1] + (1 - weight) * x)
    return out


def rl_rewards_data(folder=RESULTS / "rl_after_gift", weight=0.6):
    """experiments/rl_after_gift.py's reward curves: for "sft" and "gift", the RL steps of the rollouts and at each
    the mean and 95% interval over the (base, seed) runs of each run's EMA-smoothed mean reward; and the commit."""
    rows = read_csv(folder / "rewards.csv")
    runs = {}  # objective -> {(base, seed): [(step, reward)]}
    for r in rows:
        runs.setdefault(r["objective"], {}).setdefault((r["base"], r["seed"]), []).append(
            (int(r["step"]), float(r["reward_mean"])))
    out = {}
    for objective, by_run in runs.items():
        curves = {k: sorted(v) for k, v in by_run.items()}
        steps = [s for s, _ in next(iter(curves.values()))]
        smoothed = [ema([r for _, r in c], weight) for c in curves.values()]
        out[objective] = dict(steps=steps, stats=[mean_interval([c[i] for c in smoothed]) for i in range(len(steps))],
                              runs=len(curves))
    return out, ", ".join(sorted({r["commit"][:7] for r in rows}))


RL_PAIRS = (("GIFT - SFT", "gift", "sft"), ("GIFT+RL - SFT+RL", "gift+rl", "sft+rl"), ("SFT+RL - SFT", "sft+rl", "sft"),
            ("GIFT+RL - GIFT", "gift+rl", "gift"))


def rl_columns_data(folder=RESULTS / "rl_after_gift", metric="cell_acc"):
    """The five columns' mean and 95% interval over their runs (the bases' over the bases), from results.csv."""
    rows = read_csv(folder / "results.csv")
    return [mean_interval([float(r[metric]) for r in rows if r["column"] == c]) for c in RL_COLUMNS]


def rl_pairs_data(folder=RESULTS / "rl_after_gift", metric="cell_acc"):
    """RL_PAIRS' paired differences over the (base, seed) pairs, from results.csv: (label, {pair: difference}, mean,
    95% interval, paired t-test p), as the study's results.md computes them."""
    value = {(r["column"], r["base"], r["seed"]): float(r[metric]) for r in read_csv(folder / "results.csv")}
    out = []
    for label, a, b in RL_PAIRS:
        pairs = sorted(k[1:] for k in value if k[0] == a)
        test = paired_test([value[(a, *k)] for k in pairs], [value[(b, *k)] for k in pairs])
        out.append((label, {k: value[(a, *k)] - value[(b, *k)] for k in pairs}, test["diff"], test["lo"], test["hi"],
                    test["p"]))
    return out


def save(fig, out, dpi=100):
    """Lay the figure out above its caption, write it (each PNG stays under ~150 KB), and free it."""
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(out, dpi=dpi)
    pyplot().close(fig)


def draw_theorem1(out):
    plt = pyplot()
    t, t_i, p, r = theorem1_curves()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.6))
    cmap = plt.get_cmap("viridis")
    shown = sorted(set(r))
    for j, ratio in enumerate(shown):
        i = r.index(ratio)
        ax1.plot(t, t_i[i], color=cmap(j / (len(shown) - 1)), lw=1.6, label=f"r = {ratio:g}")
    ax1.plot(t, p, "k--", lw=1, label="SFT: p = t")
    ax1.set(xlabel="t ~ U(0, 1), the row's time", ylabel="P(token i masked)",
            title="Theorem 1: t_i = 1 - (1 - t)^r_i, r_i = beta_i / beta_ref")
    ax1.legend(fontsize=7, loc="lower right")
    n = len(r)
    uncertain = [i for i, ratio in enumerate(r) if ratio > 1]
    groups = ((range(n), f"all {n} tokens", "C0"), (uncertain, f"the {len(uncertain)} with r > 1", "C3"))
    for keep, name, color in groups:
        g, s = expected_masked(t_i, p, keep)
        ax2.plot(t, g, color=color, lw=1.6, label=f"GIFT, {name}")
        ax2.plot(t, s, color=color, lw=1, ls="--", label=f"SFT, {name}")
    ax2.set(xlabel="t", ylabel="E[# masked tokens]", title=f"one answer, betas {', '.join(f'{b:g}' for b in BETAS)}")
    ax2.legend(fontsize=7, loc="upper left")
    for ax in (ax1, ax2):
        ax.title.set_fontsize(9)
        ax.grid(alpha=0.3)
    caption(fig, f"computed by gift.py's gift_mask_probs / sft_mask_probs (eps = 1e-3), gift.py at commit "
                 f"{repo_commit('gift.py')}; "
                 f"redraw: {COMMAND}")
    save(fig, out)


def draw_main_job(out):
    plt = pyplot()
    (steps, loss), res = main_job_data()
    held = res["heldout"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.4), gridspec_kw={"width_ratios": [1.6, 1]})
    ax1.plot(steps, loss, marker="o", ms=3, lw=1.3)
    ax1.set(yscale="log", xlabel="optimizer step", ylabel="training loss (GIFT, Algorithm 2)",
            title=f"main job: a tiny LLaDA learns 4x4 Sudoku ({res['processes']} processes)")
    x, width = [0, 1], 0.38
    for k, (key, name) in enumerate((("cell_accuracy", "cells correct"), ("puzzles_solved", "puzzles solved"))):
        vals = [held["untrained"][key], held["trained"][key]]
        bars = ax2.bar([v + (k - 0.5) * width for v in x], vals, width, label=name, color=f"C{k}")
        ax2.bar_label(bars, fmt="%.1f", fontsize=7)
    ax2.set(xticks=x, xticklabels=["untrained", f"trained ({steps[-1]} steps)"], ylim=(0, 110), ylabel="%",
            title=f"held-out Sudoku ({held['trained']['puzzles']} puzzles, unseen grids)")
    ax2.legend(fontsize=7, loc="upper left")
    for ax in (ax1, ax2):
        ax.title.set_fontsize(9)
        ax.grid(alpha=0.3, axis="y")
    caption(fig, f"run made at commit {res['commit']} (experiments/figures/data/sudoku-tiny/, from "
                 f"torchrun --nproc_per_node 2 gift.py); redraw: {COMMAND}")
    save(fig, out)


def draw_gift_vs_sft(out):
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    commits = set()
    for ax, (task, metric, title) in zip(axes, TASKS):
        data, commit = study_data(task, metric)
        commits.add(commit)
        for x, (label, diffs, mean, lo, hi, p) in enumerate(data):
            vals = list(diffs.values())
            jitter = [(k - (len(vals) - 1) / 2) * 0.03 for k in range(len(vals))]
            ax.scatter([x + j for j in jitter], vals, s=9, color="0.55", zorder=2)
            ax.errorbar([x + 0.25], [mean], yerr=[[mean - lo], [hi - mean]], fmt="o", color="C3", ms=5, capsize=3,
                        zorder=3)
        ax.axhline(0, color="k", lw=0.8)
        ax.set_xticks(range(len(data)), [f"{d[0]}\np = {d[5]:.2g}" for d in data], fontsize=7)
        ax.set_ylabel("minus SFT (same base and seed), points", fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    caption(fig, f"grey: the 9 (base, seed) pairs; red: mean, 95% interval, paired t-test (summary.csv); runs made at "
                 f"commit {', '.join(sorted(commits))} (experiments/results/); redraw: {COMMAND}")
    save(fig, out)


def draw_curves(out):
    plt = pyplot()
    fig, axes = plt.subplots(2, 3, figsize=(12, 6.2))
    commits, notes = set(), []
    for row, (task, metric, title) in zip(axes, TASKS):
        d, n_runs, n_heldout, commit = curves_data(task, metric)
        commits.add(commit)
        notes.append(f"{task}: {n_runs} runs each, {n_heldout} held-out examples per point")
        for objective, color in (("sft", "C0"), ("gift", "C3")):
            c = d[objective]
            mean, lo, hi = zip(*c["stats"])
            for ax, scale in ((row[0], 1.0), (row[1], c["cost"])):
                x = [s * scale for s in c["steps"]]
                ax.plot(x, mean, color=color, marker="o", ms=3, lw=1.5,
                        label=objective.upper() + (f" (a step costs {c['cost']:g} SFT steps)"
                                                   if ax is row[1] and objective != "sft" else ""))
                ax.fill_between(x, lo, hi, color=color, alpha=0.15, lw=0)
        c = d["gift - sft"]
        mean, lo, hi = zip(*c["stats"])
        row[2].plot(c["steps"], mean, color="C3", marker="o", ms=3, lw=1.5)
        row[2].fill_between(c["steps"], lo, hi, color="C3", alpha=0.18, lw=0)
        row[2].axhline(0, color="k", lw=0.8)
        row[0].set(xlabel="optimizer step", ylabel=f"{title.split(': ')[1]}, %")
        row[1].set(xlabel="cost, in SFT optimizer steps (alternated timing)")
        row[2].set(xlabel="optimizer step", ylabel="GIFT minus SFT, points")
        row[0].set_title(f"{title}: mean and 95% interval", fontsize=9)
        row[1].set_title("the same against cost", fontsize=9)
        row[2].set_title("paired difference (same base and seed)", fontsize=9)
        for ax in row:
            ax.grid(alpha=0.3)
        for ax in row[:2]:
            ax.legend(fontsize=7, loc="lower right")
    caption(fig, f"toy study (experiments/README.md), step 0 = the base; {'; '.join(notes)};\nruns made at commit "
                 f"{', '.join(sorted(commits))} (experiments/results/*/curves.csv); redraw: {COMMAND}")
    save(fig, out, dpi=90)


def draw_sudoku_masks(fig, d, n):
    """The Sudoku half of masks.png: a 4x4 grid of the 16 answer digits' betas per puzzle, base and fine-tuned."""
    from matplotlib.patches import Rectangle
    axes = fig.subplots(2, n, squeeze=False)
    vmax = max(max(ex[f"beta_{m}"]) for ex in d["examples"][:n] for m in ("base", "gift"))
    for row, model in enumerate(("base", "gift")):
        for k, ex in enumerate(d["examples"][:n]):
            ax = axes[row][k]
            cells = [i for i, lab in enumerate(ex["labels"]) if lab in ("blank", "given")]  # the 16 digits
            values = [ex[f"beta_{model}"][i] for i in cells]
            im = ax.imshow([values[4 * i:4 * i + 4] for i in range(4)], vmin=0, vmax=vmax, cmap="viridis")
            for c, i in enumerate(cells):
                y, x = divmod(c, 4)
                if ex["labels"][i] == "blank":
                    ax.add_patch(Rectangle((x - 0.45, y - 0.45), 0.9, 0.9, fill=False, ec="red", lw=1.6))
                ax.text(x, y, f"{values[c]:.2f}", ha="center", va="center", fontsize=6,
                        color="white" if values[c] < 0.6 * vmax else "black")
            ax.set_xticks([])
            ax.set_yticks([])
            if row == 0:
                ax.set_title(f"puzzle {ex['item'][0]}", fontsize=7)
            if k == 0:
                ax.set_ylabel("the base" if model == "base" else "after GIFT", fontsize=8)
    fig.colorbar(im, ax=axes, fraction=0.02, pad=0.01).ax.tick_params(labelsize=7)
    m = d["mean"]
    fig.suptitle("What GIFT masks: first-pass betas (entropy ** 0.5, Algorithm 1) of held-out answers under the toy "
                 "study's first base, before and after fine-tuning with GIFT\n"
                 f"4x4 Sudoku (red: a blank cell). Mean beta, blanks / givens: base {m['base']['blank']:.2f} / "
                 f"{m['base']['given']:.2f}, after GIFT ({d['steps']} steps) {m['gift']['blank']:.2f} / "
                 f"{m['gift']['given']:.2f} (means over masks.json's {len(d['examples'])} puzzles)", fontsize=8)


def draw_countdown_masks(fig, d, n):
    """The Countdown half of masks.png: each answer character coloured by its beta, base and fine-tuned, up to the
    first <|eot_id|> (the rest is padding)."""
    examples = d["examples"][:n]
    axes = fig.subplots(2 * n, 1, squeeze=False, gridspec_kw=dict(hspace=0.6, left=0.08, right=0.9, bottom=0.1))[:, 0]
    vmax = max(max(ex[f"beta_{m}"]) for ex in examples for m in ("base", "gift"))
    for k, ex in enumerate(examples):
        end = ex["labels"].index("eot") + 1 if "eot" in ex["labels"] else len(ex["labels"])
        for j, model in enumerate(("base", "gift")):
            ax = axes[2 * k + j]
            values = ex[f"beta_{model}"][:end]
            im = ax.imshow([values], vmin=0, vmax=vmax, cmap="viridis", aspect="auto")
            for x, (token, value) in enumerate(zip(ex["tokens"][:end], values)):
                ax.text(x, 0, token or "eot", ha="center", va="center", fontsize=6 if token else 4,
                        color="white" if value < 0.6 * vmax else "black")
            ax.set_xticks([])
            ax.set_yticks([])
            item = ex["item"]
            ax.set_ylabel("base" if model == "base" else "GIFT", fontsize=7, rotation=0, ha="right", va="center")
            if j == 0:
                ax.set_title(f"numbers {item['numbers']}, target {item['target']}", fontsize=7, loc="left", pad=2)
    fig.colorbar(im, ax=list(axes), fraction=0.02, pad=0.01).ax.tick_params(labelsize=7)
    m = d["mean"]

    def mean(model):  # over every character of the expressions
        return statistics.mean(b for ex in d["examples"] for b, lab in zip(ex[f"beta_{model}"], ex["labels"])
                               if lab in ("digit", "operator", "parenthesis"))
    fig.suptitle("toy Countdown, one token per character.\nMean beta, the expression's characters / the fixed "
                 f"<answer>\\boxed{{: base {mean('base'):.2f} / {m['base']['prefix']:.2f}, after GIFT ({d['steps']} "
                 f"steps) {mean('gift'):.2f} / {m['gift']['prefix']:.2f} (means over masks.json's {len(d['examples'])} "
                 "problems)",
                 fontsize=8)


def draw_masks(out, n=4):
    plt = pyplot()
    sudoku_d, countdown_d = masks_data("sudoku"), masks_data("countdown")
    fig = plt.figure(figsize=(10, 8.4))
    top, bottom = fig.subfigures(2, 1, height_ratios=(1.1, 1))
    draw_sudoku_masks(top, sudoku_d, n)
    draw_countdown_masks(bottom, countdown_d, n)
    commits = sorted({sudoku_d["commit"][:7], countdown_d["commit"][:7]})
    caption(fig, f"experiments/results/{{sudoku,countdown}}/masks.json (base {sudoku_d['base']}, its gift run seed "
                 f"{sudoku_d['seed']}), made at commit {', '.join(commits)};\nTheorem 1 masks token i at rate "
                 f"1 - (1 - t)^(beta_i / mean beta); redraw: {COMMAND}")
    fig.savefig(out, dpi=100)
    plt.close(fig)


def draw_rl_after_gift(out):
    plt = pyplot()
    curves, commit = rl_rewards_data()
    columns = rl_columns_data()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6), gridspec_kw={"width_ratios": [1.4, 1]})
    for objective, color in (("sft", "C0"), ("gift", "C3")):
        c = curves[objective]
        mean, lo, hi = zip(*c["stats"])
        ax1.plot(c["steps"], mean, color=color, lw=1.5, label=f"{objective.upper()} + RL ({c['runs']} runs)")
        ax1.fill_between(c["steps"], lo, hi, color=color, alpha=0.15, lw=0)
    ax1.set(xlabel="RL optimizer step", ylabel="mean reward of the rollout (EMA 0.6)",
            title="wd1 on 4x4 Sudoku from the two cold starts")
    ax1.legend(fontsize=7)
    pairs = rl_pairs_data()
    for x, (label, diffs, mean, lo, hi, p) in enumerate(pairs):
        vals = list(diffs.values())
        ax2.scatter([x + (k - (len(vals) - 1) / 2) * 0.03 for k in range(len(vals))], vals, s=9, color="0.55")
        ax2.errorbar([x + 0.25], [mean], yerr=[[mean - lo], [hi - mean]], fmt="o", color="C3", ms=5, capsize=3)
    ax2.axhline(0, color="k", lw=0.8)
    ax2.set_xticks(range(len(pairs)), [f"{d[0]}\np = {d[5]:.2g}" for d in pairs], fontsize=7)
    ax2.set(ylabel="held-out cells, points")
    means = ", ".join(f"{name} {m:.1f}" for name, (m, _, _) in zip(("Base", "SFT", "GIFT", "SFT+RL", "GIFT+RL"),
                                                                    columns))
    ax2.set_title("held-out cells, paired by base and seed (grey);\nmean, 95% interval, paired t-test (red)",
                  fontsize=8)
    ax1.title.set_fontsize(9)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3, axis="y")
    caption(fig, f"held-out cells %, here: {means}; the paper (LLaDA-8B): Base 5.5, SFT 4.6, GIFT 7.8, SFT+RL 8.9, "
                 f"GIFT+RL 13.3\nexperiments/rl_after_gift.py, runs made at commit {commit} (experiments/results/rl_after_gift/); "
                 f"redraw: {COMMAND}")
    save(fig, out)


def main():
    FIGURES.mkdir(exist_ok=True)
    for name, draw in (("theorem1.png", draw_theorem1), ("main_job.png", draw_main_job),
                       ("gift_vs_sft.png", draw_gift_vs_sft), ("curves.png", draw_curves), ("masks.png", draw_masks),
                       ("rl_after_gift.png", draw_rl_after_gift)):
        draw(FIGURES / name)
        print(f"figures: {FIGURES / name} ({(FIGURES / name).stat().st_size // 1024} KB)")


if __name__ == "__main__":
    main()

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
  masks.png         What GIFT masks: gift.py's first-pass betas (Algorithm 1, entropy ** 0.5) of the 16 answer digits
                    of held-out Sudoku puzzles, for the main job's architecture untrained (its seed-42 initialisation)
                    and trained (the copy of its final model in experiments/figures/data/sudoku-tiny/model/), blanks
                    against givens, and each digit's masking probability at t = 0.5 (Theorem 1).

Each PNG's caption names the commit of the data it draws and this command. The data functions (plain Python and
gift.py's Part I) are tested by tests/test_plot.py without matplotlib; the drawing functions import it.
"""

import csv
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # gift.py at the repository root; plot.py beside this file
from plot import caption, metric_series, pyplot, read_metrics, repo_commit  # noqa: E402

FIGURES = HERE / "figures"
MAIN_JOB = FIGURES / "data" / "sudoku-tiny"  # copies of runs/sudoku-tiny/{metrics.jsonl,results.json}
# a main job's final model (config.json, model.safetensors, tokenizer.json, sudoku_heldout.csv) and its results.json
MAIN_MODEL = MAIN_JOB / "model"
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


def heldout_puzzles(folder=MAIN_MODEL, n=None):
    """[(puzzle, solution)] of the model folder's sudoku_heldout.csv, in file order (the first n)."""
    rows = [(r["Puzzle"], r["Solution"]) for r in read_csv(folder / "sudoku_heldout.csv")]
    return rows[:n]


def masks_data(folder=MAIN_MODEL, n=5, t=0.5, init_seed=42):
    """What GIFT masks, for the first n held-out puzzles: gift.py's first_pass_betas ("entropy") of each answer
    position, from the folder's model (float32) and from the same architecture untrained
    (LLaDA(config).init_weights(seed 42), the main job's initialisation). The answer is
    "<answer>{16 digits}</answer><|eot_id|>": its 16 digit positions are kept. Returns dict(puzzles, blanks (n, 16)
    bools, and for "untrained" / "trained": betas (n, 16), t_i (n, 16) at `t` (gift_mask_probs, beta_ref the row's
    mean over the whole answer), mean_blank, mean_given (the mean beta over all blank / given cells)), as lists."""
    import torch
    import data
    import gift
    from model import LLaDA
    tokenizer = data.load_tokenizer(folder)
    pairs = heldout_puzzles(folder, n)
    examples = data.sudoku_examples(tokenizer, pairs)
    trained = LLaDA.from_pretrained(folder, dtype=torch.float32)
    untrained = LLaDA(trained.config).init_weights(torch.Generator().manual_seed(init_seed)).float()
    pad_id = data.special_ids(tokenizer, trained.config).pad
    input_ids, answer_mask = gift.collate(examples, pad_id)
    mask_id = trained.config.mask_token_id
    prefix = len(tokenizer.encode("<answer>", add_special_tokens=False).ids)
    digits = [range(prompt_len + prefix, prompt_len + prefix + 16) for _, prompt_len in examples]
    for (ids, prompt_len), (_, solution), cols in zip(examples, pairs, digits):  # the 16 positions are the digits
        assert tokenizer.decode([ids[c] for c in cols]) == solution
    blanks = [[ch == "0" for ch in puzzle] for puzzle, _ in pairs]
    out = dict(puzzles=[p for p, _ in pairs], blanks=blanks, t=t)
    for name, model in (("untrained", untrained), ("trained", trained)):
        beta = gift.first_pass_betas(model, "entropy", input_ids, answer_mask, mask_id)  # (n, L)
        t_i = gift.gift_mask_probs(torch.full((len(pairs),), t), beta, answer_mask)  # (n, L)
        rows = [beta[k, cols].tolist() for k, cols in enumerate(digits)]
        probs = [t_i[k, cols].tolist() for k, cols in enumerate(digits)]
        cells = [(b, blank) for row, brow in zip(rows, blanks) for b, blank in zip(row, brow)]
        mean = lambda xs: sum(xs) / len(xs)
        out[name] = dict(betas=rows, t_i=probs, mean_blank=mean([b for b, blank in cells if blank]),
                         mean_given=mean([b for b, blank in cells if not blank]))
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Drawing: matplotlib


def save(fig, out):
    """Lay the figure out above its caption, write it at 100 dpi, and free it."""
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(out, dpi=100)
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


def draw_masks(out, n=5):
    plt = pyplot()
    from matplotlib.patches import Rectangle
    d = masks_data(n=n)
    res = json.loads((MAIN_MODEL / "results.json").read_text())
    rows = (("untrained", "betas", "beta, untrained"), ("trained", "betas", "beta, trained"),
            ("untrained", "t_i", f"t_i at t = {d['t']:g}, untrained"), ("trained", "t_i", f"t_i at t = {d['t']:g}, trained"))
    fig, axes = plt.subplots(len(rows), n, figsize=(1.55 * n + 1.6, 1.55 * len(rows) + 1.2), squeeze=False)
    fig.subplots_adjust(left=0.06, right=0.88, top=0.88, bottom=0.07, wspace=0.08, hspace=0.12)
    vmax_beta = max(max(max(r) for r in d[m]["betas"]) for m in ("untrained", "trained"))
    for row, (model, key, label) in enumerate(rows):
        vmax = vmax_beta if key == "betas" else 1.0
        cmap = "viridis" if key == "betas" else "magma"
        for k in range(n):
            ax = axes[row][k]
            grid = [d[model][key][k][4 * i:4 * i + 4] for i in range(4)]
            im = ax.imshow(grid, vmin=0, vmax=vmax, cmap=cmap)
            for c, (blank, digit) in enumerate(zip(d["blanks"][k], d["puzzles"][k])):
                i, j = divmod(c, 4)
                if blank:
                    ax.add_patch(Rectangle((j - 0.45, i - 0.45), 0.9, 0.9, fill=False, ec="red", lw=1.6))
                value = d[model][key][k][c]
                ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=6,
                        color="white" if value < 0.6 * vmax else "black")
            ax.set_xticks([])
            ax.set_yticks([])
            if row == 0:
                ax.set_title(f"puzzle {d['puzzles'][k]}", fontsize=7)
            if k == 0:
                ax.set_ylabel(label, fontsize=8)
        if row in (1, 3):  # one colour bar per shared scale, beside its two rows
            top, bottom = axes[row - 1][-1].get_position(), axes[row][-1].get_position()
            bar = fig.add_axes((bottom.x1 + 0.015, bottom.y0, 0.012, top.y1 - bottom.y0))
            fig.colorbar(im, cax=bar).ax.tick_params(labelsize=7)
    u, tr = d["untrained"], d["trained"]
    fig.suptitle(f"What GIFT masks: first-pass betas (entropy ** 0.5) of the 16 answer digits, red = blank cell\n"
                 f"mean beta, blanks / givens: untrained {u['mean_blank']:.3f} / {u['mean_given']:.3f}, "
                 f"trained {tr['mean_blank']:.3f} / {tr['mean_given']:.3f} (these {n} puzzles)", fontsize=8)
    caption(fig, f"main job (torchrun --nproc_per_node 2 gift.py) at commit {res['commit']}, final model copied to "
                 f"experiments/figures/data/sudoku-tiny/model/;\nuntrained = its seed-42 init; gift.py at "
                 f"{repo_commit('gift.py')}; redraw: {COMMAND}")
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main():
    FIGURES.mkdir(exist_ok=True)
    for name, draw in (("theorem1.png", draw_theorem1), ("main_job.png", draw_main_job),
                       ("gift_vs_sft.png", draw_gift_vs_sft), ("masks.png", draw_masks)):
        draw(FIGURES / name)
        print(f"figures: {FIGURES / name} ({(FIGURES / name).stat().st_size // 1024} KB)")


if __name__ == "__main__":
    main()

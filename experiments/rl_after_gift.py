"""GIFT as a cold start for RL at toy scale: the paper's appendix "SFT Role in Subsequent RL" (GIFT, arXiv
2509.20863: LLaDA-8B-Instruct fine-tuned by SFT or GIFT, then wd1's RL on Sudoku; Base 5.5, SFT 4.6, GIFT 7.8,
SFT+RL 8.9, GIFT+RL 13.3 % cells) as a miniature on a 2-core CPU, with several bases, seeds and paired statistics.

    python experiments/rl_after_gift.py             # the full run (experiments/README.md)
    python experiments/rl_after_gift.py --smoke     # tiny sizes, one base, one seed: seconds (tests/test_experiments.py)

What it does, in order (the repo's own code paths: experiments/gift_vs_sft.py's bases and fine-tuning, rl.py's wd1):
  1. Data and bases: the toy study's (gift_vs_sft.py, experiments/sudoku.py): tiny LLaDAs pre-trained with SFT on
     easy puzzles (2-8 blanks), a fine-tuning set of 1000 harder ones (9-11 blanks), held-out puzzles of that
     difficulty from solution grids no training set holds. The bases are pre-trained for fewer steps than the toy
     study's (--base-steps), so that neither fine-tuning nor RL starts at the ceiling.
  2. The cold starts: for every base and seed, gift.train with SFT and with GIFT from that base (the same data order
     and noise for a seed), stopped early (--ft-epochs).
  3. RL: for every cold start, rl.py's wd1 (its trainer wll_d1_neg: groups of --group-size completions at temperature
     0.9, A = r - the group's mean, w+- = softmax(+-A), the one-step likelihood with 15% of the prompt masked, 8
     optimizer steps per rollout) on the fine-tuning set's puzzles, d1's Sudoku reward; the same RL steps and rollouts
     for both, the same seed for the same pair.
  4. Evaluation: the five columns (Base, SFT, GIFT, SFT+RL, GIFT+RL) on the held-out puzzles (eval.evaluate, greedy,
     the toy study's protocol), and the paired differences over the (base, seed) pairs with 95% intervals.
  5. The reward curves: every RL run's mean reward per rollout (metrics.jsonl), in rewards.csv, which
     experiments/figures.py draws (EMA-smoothed, as the paper's figure) into experiments/figures/rl_after_gift.png.

Outputs in --out: results.md, results.csv (one row per model), rewards.csv, and the study's folders (data/, base<b>/,
runs/base<b>/{sft,gift}-steps-seed<k>/ the cold starts, rl/base<b>/{sft,gift}-seed<k>/ the RL runs with their
metrics.jsonl and result.json). An interrupted run continues: finished runs with the same settings are reused.
"""

import argparse
import contextlib
import csv
import dataclasses
import json
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # the repository's files, and the toy study's beside this one
import gift_vs_sft as study  # noqa: E402
import longjob  # noqa: E402
import rl  # noqa: E402
import sudoku  # noqa: E402
from data import load_tokenizer  # noqa: E402
from model import LLaDA  # noqa: E402

COLUMNS = ("base", "sft", "gift", "sft+rl", "gift+rl")  # the paper's five columns
PAPER = {"base": 5.5, "sft": 4.6, "gift": 7.8, "sft+rl": 8.9, "gift+rl": 13.3}  # LLaDA-8B-Instruct, cells %, gen 512


@dataclass
class RLPlan:
    out: str = field(default="runs/rl-after-gift", metadata={"help": "output folder"})
    bases: str = field(default="0,1,2", metadata={"help": "independently pre-trained bases (comma-separated ids)"})
    seeds: str = field(default="0,1,2", metadata={"help": "fine-tuning and RL seeds per base (comma-separated)"})
    base_steps: int = field(default=600, metadata={"help": "pre-training steps (the toy study: 3000)"})
    ft_epochs: int = field(default=2, metadata={"help": "fine-tuning epochs of the cold starts (the toy study: 20)"})
    n_heldout: int = field(default=1000, metadata={"help": "held-out puzzles"})
    rl_steps: int = field(default=320, metadata={"help": "RL optimizer steps (40 rollouts of --iterations 8)"})
    group_size: int = field(default=6, metadata={"help": "rl.py --group-size (wd1: 6)"})
    prompts_per_step: int = field(default=8, metadata={"help": "rl.py --prompts-per-step (wd1: 8)"})
    iterations: int = field(default=8, metadata={"help": "rl.py --iterations (wd1: 8)"})
    rl_lr: float = field(default=3e-5, metadata={"help": "rl.py --lr, full fine-tuning (wd1's 3e-6: LoRA on 8B)"})
    temperature: float = field(default=0.9, metadata={"help": "rl.py --temperature (wd1: 0.9)"})
    workers: int = field(default=2, metadata={"help": "runs side by side (processes)"})
    threads: int = field(default=1, metadata={"help": "torch threads per process"})
    reuse_other_commit: bool = field(default=False, metadata={"help": "reuse runs made by another git commit"})
    smoke: bool = field(default=False, metadata={"help": "tiny sizes, one base, one seed: seconds"})


SMOKE = dict(bases="0", seeds="0", base_steps=4, ft_epochs=1, n_heldout=16, rl_steps=4, group_size=2,
             prompts_per_step=2, iterations=2, workers=1)
SMOKE_STUDY = dict(d_model=32, n_layers=1, n_heads=2, mlp=64, heldout_grids=16, n_base=64, n_ft=32, base_batch=16,
                   base_warmup=1, ft_batch=16, ft_warmup=1, eval_batch=16, n_entropy=16, log_every=1, cost_rounds=3)


def parse_plan(argv=None):
    parser = argparse.ArgumentParser(description="GIFT as a cold start for wd1's RL, at toy scale")
    given = longjob.parse_dataclass_flags(parser, RLPlan, argv)
    plan = RLPlan(**given)
    for k, v in (SMOKE if plan.smoke else {}).items():
        if k not in given:
            setattr(plan, k, v)
    if plan.smoke and "out" not in given:
        plan.out = "runs/rl-after-gift-smoke"
    return plan


def study_plan(plan):
    """The toy study's plan (gift_vs_sft.Plan) for the bases and the cold starts."""
    return study.Plan(task="sudoku", out=plan.out, bases=plan.bases, seeds=plan.seeds, base_steps=plan.base_steps,
                      ft_epochs=plan.ft_epochs, n_heldout=plan.n_heldout, objectives="sft,gift", workers=plan.workers,
                      threads=plan.threads, reuse_other_commit=plan.reuse_other_commit, checkpoints=1,
                      **(SMOKE_STUDY if plan.smoke else {}))


def rl_argv(plan, start, prompts_csv, out, seed):
    """rl.py's flags for one RL run: the cold start, the fine-tuning puzzles, the toy's answer in one block."""
    return ["--model", str(start), "--task", "sudoku", "--data", str(prompts_csv), "--prompt-style", "plain",
            "--out", str(out), "--group-size", str(plan.group_size), "--prompts-per-step", str(plan.prompts_per_step),
            "--iterations", str(plan.iterations), "--max-steps", str(plan.rl_steps), "--lr", str(plan.rl_lr),
            "--temperature", str(plan.temperature), "--gen-length", "34", "--block-length", "34", "--steps", "34",
            "--seed", str(seed), "--save-every", str(plan.rl_steps), "--keep-last", "1", "--log-every", "1",
            "--dtype", "float32"]


def run_rl(spec, commit, reuse_other_commit):
    """One RL run from a cold start, then its held-out grades; result.json (reused when the spec is the same)."""
    torch.set_num_threads(spec["threads"])
    out = Path(spec["out"])
    result_path = out / "result.json"
    if result := study.reusable(result_path, spec, commit, reuse_other_commit):
        return result
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    opts = rl.parse_options(spec["argv"])
    t0 = time.time()
    with open(out / "rl.log", "w") as log, contextlib.redirect_stdout(log):
        with longjob.run_folder(Path(opts.out), opts.resume, opts.overwrite) as preemption:
            final = rl.train(opts, preemption)
    rl_s = time.time() - t0
    model = LLaDA.from_pretrained(final / "model")
    heldout = json.loads(Path(spec["data_json"]).read_text())["heldout"]
    evaluation = sudoku.evaluate_heldout(model, load_tokenizer(final / "model"), heldout, spec["eval_batch"])
    metrics = study.read_metrics(out)
    result = dict(spec=spec, commit=commit, rl_s=rl_s,
                  rewards=[(m["step"], m["rollout"], m["reward_mean"]) for m in metrics if
                           m["step"] % spec["iterations"] == 1 or spec["iterations"] == 1],
                  zero_advantage=[m["zero_advantage"] for m in metrics],
                  **study.grades(sudoku, evaluation))
    shutil.rmtree(out / "checkpoints" / final.name / "train_state", ignore_errors=True)
    result_path.write_text(json.dumps(result))
    return result


def table_rows(bases, starts, rls):
    """One row per model: column, base, seed, cell accuracy and its SE, whole puzzles solved."""
    rows = [dict(column="base", base=b, seed="", cell_acc=m["eval"]["cell_acc"], cell_se=m["eval"]["cell_se"],
                 puzzle_acc=m["eval"]["puzzle_acc"]) for b, (_, m) in sorted(bases.items())]
    for column, results in (("", starts), ("+rl", rls)):
        for r in results:
            s = r["spec"]
            rows.append(dict(column=s["name"] + column, base=s["base"], seed=s["seed"], cell_acc=r["cell_acc"],
                             cell_se=r["cell_se"], puzzle_acc=r["puzzle_acc"]))
    return sorted(rows, key=lambda r: (COLUMNS.index(r["column"]), r["base"], str(r["seed"])))


def paired(rows, a, b, metric="cell_acc"):
    """paired_test of column a minus column b over the (base, seed) pairs both have ("base": the base's value)."""
    value = {(r["column"], r["base"], r["seed"]): r[metric] for r in rows}
    pairs = sorted({(r["base"], r["seed"]) for r in rows if r["column"] == a})

    def get(column, b_, s):
        return value[("base", b_, "")] if column == "base" else value[(column, b_, s)]
    return study.paired_test([get(a, b_, s) for b_, s in pairs], [get(b, b_, s) for b_, s in pairs])


COMPARISONS = (("gift", "sft"), ("gift+rl", "sft+rl"), ("sft+rl", "sft"), ("gift+rl", "gift"), ("sft", "base"),
               ("gift", "base"))


def markdown(plan, command, commit, rows, wall_s, n_heldout):
    """results.md: the five columns (mean +- sd over the runs) beside the paper's, then the paired differences."""
    lines = ["# GIFT as a cold start for RL (wd1) on 4x4 Sudoku: results", "",
             f"Command: `{command}`  ", f"Commit: `{commit}`  ",
             f"Settings: {', '.join(f'{k}={v}' for k, v in dataclasses.asdict(plan).items())}  ",
             f"Machine: {study.cpu_name()}, torch {torch.__version__}. Total wall time {wall_s / 60:.1f} min.", "",
             f"Held-out: {n_heldout} puzzles from solution grids no training set holds; cell accuracy (d1's metric), "
             "greedy, the toy study's protocol. mean +- sd over the runs; the paper: LLaDA-8B-Instruct, generation "
             "length 512, its appendix table.", "",
             "| | " + " | ".join(COLUMNS) + " |", "|---|" + "---|" * len(COLUMNS)]
    for metric, label in (("cell_acc", "cell acc %"), ("puzzle_acc", "whole puzzles %")):
        cells = []
        for c in COLUMNS:
            mean, sd = study.mean_std([r[metric] for r in rows if r["column"] == c])
            cells.append(f"{study.fmt(mean)} +- {study.fmt(sd)}")
        lines.append(f"| {label}, here | " + " | ".join(cells) + " |")
    lines += ["| cell acc %, the paper (8B) | " + " | ".join(f"{PAPER[c]}" for c in COLUMNS) + " |", "",
              "Paired differences over the (base, seed) pairs (a base's own value where one side is the base):", "",
              "| comparison | cell acc, points [95% CI] | p | wins | whole puzzles, points [95% CI] |",
              "|---|---|---|---|---|"]
    for a, b in COMPARISONS:
        c, p = paired(rows, a, b), paired(rows, a, b, "puzzle_acc")
        lines.append(f"| {a} - {b} | {study.fmt(c['diff'], 2)} [{study.fmt(c['lo'], 2)}, {study.fmt(c['hi'], 2)}] | "
                     f"{study.fmt_p(c['p'])} | {c['wins']}/{c['n']} | {study.fmt(p['diff'], 2)} "
                     f"[{study.fmt(p['lo'], 2)}, {study.fmt(p['hi'], 2)}] |")
    return "\n".join(lines) + "\n"


def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    plan = parse_plan(argv)
    command = " ".join(["python experiments/rl_after_gift.py"] + argv)
    commit, t_start, out = study.git_commit(), time.time(), Path(plan.out)
    torch.set_num_threads(plan.threads)
    print(f"plan: {json.dumps(dataclasses.asdict(plan))}\ncommit: {commit}", flush=True)

    # 1. data and bases (the toy study's code)
    splan = study_plan(plan)
    _, ft_data, heldout = sudoku.build_data(splan, out / "data")
    prompts_csv = out / "data" / "rl_prompts.csv"  # the fine-tuning puzzles, as rl.py --data reads them
    prompts_csv.write_text("Puzzle,Solution\n" + "".join(f"{p},{s}\n" for p, s in ft_data))
    bases = study.prepare_bases(splan, commit)
    for b, (_, meta) in sorted(bases.items()):
        print(f"base {b}: held-out cells {meta['eval']['cell_acc']:.1f} %", flush=True)

    # 2. the cold starts: SFT and GIFT, equal steps, from each base and seed (gift_vs_sft.run_one)
    steps = splan.ft_epochs * -(-len(ft_data) // splan.ft_batch)
    common = dict(task="sudoku", task_fields=study.task_fields(splan), data_jsonl=str(out / "data" / "finetune.jsonl"),
                  data_json=str(out / "data" / "data.json"), batch=splan.ft_batch, lr=splan.ft_lr,
                  warmup=splan.ft_warmup, weight_decay=splan.ft_weight_decay, log_every=splan.log_every,
                  eval_batch=splan.eval_batch, n_entropy=splan.n_entropy, checkpoints=1, curve_points=0,
                  curve_heldout=splan.curve_heldout, threads=plan.threads)
    pairs = [(b, s) for b in sorted(bases) for s in study.id_list(plan.seeds)]
    specs = [dict(common, name=n, budget="steps", base=b, base_dir=bases[b][0], base_spec=bases[b][1]["spec"],
                  data_key=bases[b][1]["data_key"], seed=s, steps=steps,
                  out=str(out / "runs" / f"base{b}" / f"{n}-steps-seed{s}")) for b, s in pairs for n in ("sft", "gift")]
    starts = study.run_all(specs, plan.workers, plan.threads, lambda r: None, commit, plan.reuse_other_commit)
    for r in starts:
        print(f"base {r['spec']['base']} {r['spec']['name']} seed {r['spec']['seed']}: {r['steps']} steps, held-out "
              f"cells {r['cell_acc']:.1f} %", flush=True)

    # 3. RL from every cold start: the same steps, rollouts and seed for SFT's and GIFT's
    rl_specs = []
    for r in starts:
        s = r["spec"]
        start = Path(s["out"]) / "checkpoints" / f"step-{r['steps']:07d}" / "model"
        rl_out = out / "rl" / f"base{s['base']}" / f"{s['name']}-seed{s['seed']}"
        rl_specs.append(dict(name=s["name"], base=s["base"], seed=s["seed"], start_spec=study.without_paths(s),
                             argv=rl_argv(plan, start, prompts_csv, rl_out, s["seed"]), out=str(rl_out),
                             data_json=common["data_json"], eval_batch=splan.eval_batch, iterations=plan.iterations,
                             threads=plan.threads))

    def on_done(r):
        print(f"[{(time.time() - t_start) / 60:5.1f} min] base {r['spec']['base']} {r['spec']['name']}+rl seed "
              f"{r['spec']['seed']}: reward {r['rewards'][0][2]:.3f} -> {r['rewards'][-1][2]:.3f}, held-out cells "
              f"{r['cell_acc']:.1f} % ({r['rl_s']:.0f} s)", flush=True)
    rls = study.run_all(rl_specs, plan.workers, plan.threads, on_done, commit, plan.reuse_other_commit, run=run_rl)

    # 4. tables, 5. the reward curves
    rows = table_rows(bases, starts, rls)
    write_csv(out / "results.csv", [dict(r, commit=commit) for r in rows])
    write_csv(out / "rewards.csv", [dict(objective=r["spec"]["name"], base=r["spec"]["base"], seed=r["spec"]["seed"],
                                         step=step, rollout=rollout, reward_mean=reward, commit=commit)
                                    for r in rls for step, rollout, reward in r["rewards"]])
    text = markdown(plan, command, commit, rows, time.time() - t_start, len(heldout))
    (out / "results.md").write_text(text)
    print(text)
    print(f"wrote {out / 'results.md'}, {out / 'results.csv'}, {out / 'rewards.csv'}")


if __name__ == "__main__":
    main()

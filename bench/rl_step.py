"""The cost of one wd1 RL step (rl.py) split into its parts, with and without the early exit, side by side:

    python gift.py                                     # the main job: runs/sudoku-tiny
    python bench/rl_step.py --model runs/sudoku-tiny   # this table (a minute on 2 cores); bench/results/rl_step-cpu.*
    python bench/rl_step.py --smoke                    # a random tiny model, seconds (tests/test_bench.py)

A rollout batch (P prompts x G completions, rl.make_rollout: the block sampler, temperature 0.9) and then the
`--iterations` updates it serves, each split into the likelihood pass (rl.likelihood_input + rl.completion_logps,
d1's one-step estimate: one forward per group), the backward of wd1's loss and the optimizer step. Seconds are one
thread's process CPU time (a neighbour on a shared machine does not inflate them), the rollouts with and without the
early exit alternated in rounds; x = the row's share of the whole step (a rollout batch and its updates). The main
job's model answers in 34 tokens, so a generation of 96 in blocks of 32 leaves the exit its last block to skip.
"""

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "experiments")]  # the repo's top-level files are plain modules
import rl  # noqa: E402
from embedded import make_char_tokenizer, tiny_config_for  # noqa: E402
from gift_vs_sft import cpu_name  # noqa: E402
from model import LLaDA  # noqa: E402


def cpu_seconds(fn):
    t0 = time.process_time()
    out = fn()
    return time.process_time() - t0, out


def model_and_opts(args):
    """The model, its tokenizer and rl.py's options (parse_options, as `python rl.py` would take them)."""
    if args.smoke:
        tokenizer = make_char_tokenizer()
        folder = Path(args.out_dir) / "smoke-model"
        model = LLaDA(tiny_config_for(tokenizer, d_model=32, n_heads=2, n_kv_heads=2, n_layers=1,
                                      mlp_hidden_size=64, max_sequence_length=256))
        model.init_weights(torch.Generator().manual_seed(0), std=0.2).save_pretrained(folder)
        tokenizer.save(str(folder / "tokenizer.json"))
        csv = Path(args.out_dir) / "smoke-prompts.csv"
        csv.write_text("Puzzle,Solution\n0000341221434321,1234341221434321\n1200341221434321,1234341221434321\n")
        flags = ["--model", str(folder), "--data", str(csv), "--prompt-style", "plain"]
    else:
        flags = ["--model", args.model]
    flags += ["--gen-length", str(args.gen_length), "--block-length", "32", "--steps", str(args.gen_length // 2),
              "--group-size", str(args.group_size), "--prompts-per-step", str(args.prompts),
              "--iterations", str(args.iterations), "--out", str(Path(args.out_dir) / "unused"), "--dtype", "float32"]
    opts = rl.parse_options(flags)
    inputs = rl.load_inputs(opts, 0, torch.float32, 1)
    return inputs, opts


def measure(args):
    torch.manual_seed(0)
    inputs, opts = model_and_opts(args)
    model, tokenizer = inputs.model, inputs.tokenizer
    options = rl.rollout_options(opts)
    prompts = rl.rollout_prompts(len(inputs.items), 0, opts.prompts_per_step, opts.seed)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.0)  # lr 0: same model
    parts = {k: [] for k in ("rollout, early exit", "rollout, every block", "likelihood pass", "backward",
                             "optimizer step")}
    counts = {}
    for r in range(args.rounds):
        for exit_on in ((True, False) if r % 2 == 0 else (False, True)):  # alternated
            o = replace(options, early_exit=exit_on, source="flags")
            s, (groups, c) = cpu_seconds(lambda: rl.make_rollout(model, tokenizer, opts.task, inputs.items, prompts,
                                                                 opts, o, 0, inputs.ids))
            parts["rollout, early exit" if exit_on else "rollout, every block"].append(s)
            counts["skipped" if exit_on else "generated"] = c["skipped"] if exit_on else c["generated"]
        mask_id = model.config.mask_token_id
        for step in range(opts.iterations):
            lik = back = 0.0
            for g in groups:
                gen = torch.Generator().manual_seed(rl.stream_seed(opts.seed, "prompt mask", step, g.index))
                s, (loss, _) = cpu_seconds(lambda: rl.group_loss(model, g.prompt_ids, g.completions, g.mask,
                                                                 g.rewards, opts.prompt_mask, gen, mask_id))
                lik += s
                back += cpu_seconds(lambda: (loss / len(groups)).backward())[0]
            parts["likelihood pass"].append(lik)
            parts["backward"].append(back)
            parts["optimizer step"].append(cpu_seconds(lambda: (optimizer.step(), optimizer.zero_grad()))[0])
    med = {k: statistics.median(v) for k, v in parts.items()}
    per_batch = {k: v * (opts.iterations if k in ("likelihood pass", "backward", "optimizer step") else 1)
                 for k, v in med.items()}
    return per_batch, counts, opts, options


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="runs/sudoku-tiny", help="rl.py's --model (the main job's by default)")
    p.add_argument("--gen-length", type=int, default=96)
    p.add_argument("--prompts", type=int, default=8, help="rl.py --prompts-per-step")
    p.add_argument("--group-size", type=int, default=6)
    p.add_argument("--iterations", type=int, default=8)
    p.add_argument("--rounds", type=int, default=4, help="rounds of the alternated timing")
    p.add_argument("--out-dir", default=str(REPO / "bench" / "results"))
    p.add_argument("--smoke", action="store_true", help="a random tiny model, 2 prompts x 2, one round: seconds")
    args = p.parse_args(argv)
    if args.smoke:
        args.prompts, args.group_size, args.iterations, args.rounds, args.gen_length = 2, 2, 2, 1, 64
    torch.set_num_threads(1)
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    per_batch, counts, opts, options = measure(args)
    for exit_on in (True, False):
        rollout = "rollout, early exit" if exit_on else "rollout, every block"
        total = per_batch[rollout] + per_batch["likelihood pass"] + per_batch["backward"] + per_batch["optimizer step"]
        per_batch[f"whole, {'early exit' if exit_on else 'every block'}"] = total
    whole = per_batch["whole, every block"]
    header = (f"rl.py step split: {opts.prompts_per_step} prompts x {opts.group_size} completions of "
              f"{options.gen_length} tokens (blocks of {options.block_length}, {options.steps} steps), "
              f"{opts.iterations} updates per rollout; {args.model if not args.smoke else 'smoke model'}; "
              f"{cpu_name()}, torch {torch.__version__}, one thread, median of {args.rounds} rounds")
    lines = [header, "", "| part (one rollout batch) | CPU s | x whole step (every block) |", "|---|---:|---:|"]
    lines += [f"| {k} | {v:.3f} | {v / whole:.2f} |" for k, v in per_batch.items()]
    lines += ["", f"answer tokens per rollout: {counts['generated']} sampled without the exit, {counts['skipped']} of "
                  "them skipped with it"]
    text = "\n".join(lines) + "\n"
    print(text)
    tag = "smoke" if args.smoke else "cpu"
    (Path(args.out_dir) / f"rl_step-{tag}.md").write_text(text)
    (Path(args.out_dir) / f"rl_step-{tag}.json").write_text(json.dumps(dict(header=header, seconds=per_batch,
                                                                            tokens=counts), indent=1) + "\n")
    return per_batch


if __name__ == "__main__":
    main()

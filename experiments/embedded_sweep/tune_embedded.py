"""Sweep of the embedded default's settings (issue 21): each config trains the tiny Sudoku model with gift.main,
checkpoints every --every steps, then grades every checkpoint on held-out puzzles from unseen grids.

    python experiments/embedded_sweep/tune_embedded.py --configs experiments/embedded_sweep/tune4.json \
        --out runs/tune --jobs 8 --threads 2   # 8 runs side by side, 2 threads each (16 cores)
"""
import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

WORKER = r'''
import json, sys, time
from pathlib import Path
sys.path.insert(0, {repo!r})
import gift, embedded, longjob
cfg = json.loads({cfg!r})
# the config's model and puzzles, where the embedded task's builders read them when the run starts: the model from
# embedded.EMBEDDED_MODEL (embedded.embedded_inputs), the puzzles from embedded.EMBEDDED_PUZZLES
# (embedded.embedded_task), the batch from embedded.EMBEDDED_GLOBAL_BATCH (embedded.apply_defaults)
embedded.EMBEDDED_MODEL.update(cfg.get("model", {{}}))
embedded.EMBEDDED_PUZZLES.update(cfg.get("puzzles", {{}}), test_grids=cfg.get("test_grids", 32))
if "global_batch" in cfg: embedded.EMBEDDED_GLOBAL_BATCH = cfg["global_batch"]
t0 = time.time()
opts = gift.parse_options(cfg["flags"])
with longjob.run_folder(Path(opts.out), opts.resume, opts.overwrite, embedded.REPLACED) as preemption:
    model, inputs, final = gift.train(opts, preemption)
tok, held = inputs.tokenizer, inputs.heldout
t_train = time.time() - t0
from eval import SUDOKU_QUESTION, evaluate
from sample import SamplerOptions
items = [dict(question=SUDOKU_QUESTION.format(puzzle=p), puzzle=p, solution=s) for p, s in held]
rows = []
for ck in sorted(Path(cfg["flags"][cfg["flags"].index("--out") + 1]).glob("checkpoints/step-*")):
    m = gift.LLaDA.from_pretrained(ck / "model")
    acc, recs = evaluate(m, tok, items, "sudoku", SamplerOptions(gen_length=34, steps=34, block_length=34), batch_size=64,
                         prompt_style="plain")
    solved = 100 * sum(r["correct_cells"] == r["empty_cells"] for r in recs) / len(recs)
    rows.append(dict(step=int(ck.name[5:]), cells=acc, puzzles=solved))
print("RESULT " + json.dumps(dict(name=cfg["name"], train_s=t_train, evals=rows)), flush=True)
'''


def run(cfg, out, threads):
    folder = out / cfg["name"]
    cfg = dict(cfg, flags=cfg["flags"] + ["--out", str(folder), "--overwrite", "--keep-last", "1000",
                                          "--log-every", "100000"])
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    t0 = time.time()
    p = subprocess.run([sys.executable, "-c", WORKER.format(repo=str(REPO), cfg=json.dumps(cfg))], env=env,
                       capture_output=True, text=True)
    line = next((l for l in p.stdout.splitlines() if l.startswith("RESULT ")), None)
    if line is None:
        return dict(name=cfg["name"], error=p.stderr[-2000:])
    return dict(json.loads(line[7:]), wall_s=time.time() - t0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", required=True)
    ap.add_argument("--out", default="runs/tune")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    configs = json.loads(Path(a.configs).read_text())
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(a.jobs) as pool, open(out / "results.jsonl", "a") as f:
        for r in pool.map(lambda c: run(c, out, a.threads), configs):
            print(json.dumps(r), flush=True)
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()

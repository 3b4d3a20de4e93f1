"""The Sudoku task of experiments/gift_vs_sft.py: 4x4 puzzles split by solution grid, d1's cell-accuracy grader, and
which answer positions carry the entropy (the analogue of Figure 2 of GIFT, arXiv 2509.20863).

A task module gives the study the same few things (countdown.py is the other one): its plan fields and defaults,
make_tokenizer, build_data, check_prompts, evaluate_heldout, entropy_by_position, answer_rows (for the
figures) and the entropy tables."""

import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's top-level files are plain modules
import gift  # noqa: E402
from data import SUDOKU_TASK_PROMPT, collate, encode  # noqa: E402
from embedded import (EMBEDDED_EVAL, SUDOKU_ANSWER, SUDOKU_UNITS, make_char_tokenizer, sudoku_examples,  # noqa: E402
                      sudoku_split)
from eval import SUDOKU_QUESTION, build_prompt, evaluate  # noqa: E402
from sample import SamplerOptions  # noqa: E402

TITLE = "4x4 Sudoku"
# the Plan fields only this task reads, and the task's defaults for the shared ones (none: Plan's are Sudoku's)
PLAN_FIELDS = ("heldout_grids", "base_blanks", "ft_blanks")
DEFAULTS = {}
# (result key, its standard-error key, table label, short name); the first is the headline metric
METRICS = (("cell_acc", "cell_se", "cell acc %", "cell"), ("puzzle_acc", "puzzle_se", "whole puzzles %", "puzzles"))
COUNTS = ("n_cells", "n_puzzles")  # what one evaluation graded
ANSWER_PREFIX = "<answer>"  # the answer is SUDOKU_ANSWER = "<answer>{16 digits}</answer>", then <|eot_id|>
PEERS = [sorted({j for unit in SUDOKU_UNITS if c in unit for j in unit} - {c}) for c in range(16)]  # 7 per cell


def make_tokenizer():
    return make_char_tokenizer()


def blanks(text):
    low, high = (int(x) for x in text.split(","))
    return low, high


def check_plan(plan, error):
    """One-line errors (error = parser.error) for this task's flags."""
    for name in ("base_blanks", "ft_blanks"):
        try:
            low, high = blanks(getattr(plan, name))
            assert 1 <= low <= high <= 12
        except (ValueError, AssertionError):
            error(f"--{name.replace('_', '-')} {getattr(plan, name)!r}: expected low,high with 1 <= low <= high <= 12, "
                  "e.g. 9,11")


# -----------------------------------------------------------------------------
# Data: split by solution grid, written as the files gift.train and the workers read


def build_data(plan, folder):
    """Pre-training, fine-tuning and held-out puzzles; the first two as prompt/response JSONL (embedded.py's Sudoku
    prompt and answer, so gift.train tokenizes them exactly as embedded.sudoku_examples does) and everything as
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


def describe_data(plan, base, ft, heldout):
    return (f"{len(base)} pre-training, {len(ft)} fine-tuning, {len(heldout)} held-out puzzles ({plan.heldout_grids} "
            "held-out grids)")


def heldout_items(heldout):
    """eval.evaluate items: the embedded task's question (embedded.evaluate_embedded uses the same)."""
    return [dict(question=SUDOKU_QUESTION.format(puzzle=p), puzzle=p, solution=s) for p, s in heldout]


def check_prompts(tokenizer, pairs, plan=None):
    """The prompt the model is trained on (data.py's SUDOKU_TASK_PROMPT through the chat format) must be the prompt
    eval.py builds for prompt_style="plain" (SUDOKU_QUESTION, whose trailing newline the chat format strips)."""
    (ids, prompt_len), = sudoku_examples(tokenizer, pairs[:1])
    item = heldout_items(pairs[:1])[0]
    if encode(tokenizer, build_prompt("sudoku", item, "plain")) != list(ids[:prompt_len]):
        raise RuntimeError("experiments: the training prompt differs from eval.py's plain prompt")


def shapes(tokenizer, pairs, plan=None):
    """(sequence length, prompt length) of the fine-tuning rows: every Sudoku row is 74 + 34 tokens."""
    examples = sudoku_examples(tokenizer, pairs)
    return max(len(ids) for ids, _ in examples), max(p for _, p in examples)


# -----------------------------------------------------------------------------
# Evaluation and the entropy analysis


def evaluate_heldout(model, tokenizer, heldout, batch_size, plan=None):
    """Held-out grades with eval.evaluate (greedy, the 34-token answer in 34 steps as embedded.EMBEDDED_EVAL): the
    counts (hits, trials) of each metric -- cells right among the blanks (d1's metric), whole puzzles solved."""
    e = EMBEDDED_EVAL
    options = SamplerOptions(gen_length=e["gen_length"], steps=e["steps"], block_length=e["block_length"])
    t0 = time.time()
    _, records = evaluate(model, tokenizer, heldout_items(heldout), "sudoku", options, batch_size=batch_size,
                          prompt_style=e["prompt_style"])
    correct = [r["correct_cells"] for r in records]
    empty = [r["empty_cells"] for r in records]
    solved = sum(c == e for c, e in zip(correct, empty))
    return dict(counts=dict(cell_acc=(sum(correct), sum(empty)), puzzle_acc=(solved, len(records))),
                n_cells=sum(empty), n_puzzles=len(records), correct_cells=correct, eval_s=time.time() - t0)


def describe_heldout(plan, e):
    return (f"{e['n_puzzles']} puzzles ({e['n_cells']} blank cells) from {plan.heldout_grids} solution grids never "
            "seen in training. Cell accuracy = correct blanks / blanks (d1's metric); SE = binomial standard error of "
            "one run's accuracy on this held-out set (cells of one puzzle are not independent, so it is a lower "
            "bound)")


@torch.no_grad()
def entropy_by_position(model, tokenizer, pairs, plan=None, batch_size=64):
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


def answer_rows(tokenizer, pairs, plan=None):
    """[(ids, prompt_len)] of the puzzles as gift.train builds them, and each answer token's label (the figures'
    masks.json): "blank" or "given" for the 16 digits, "fixed" for "<answer>", "</answer>" and <|eot_id|>."""
    rows = sudoku_examples(tokenizer, pairs)
    offset = len(encode(tokenizer, ANSWER_PREFIX))
    labels = []
    for (ids, prompt_len), (puzzle, _) in zip(rows, pairs):
        row = ["fixed"] * (len(ids) - prompt_len)
        row[offset:offset + 16] = ["blank" if ch == "0" else "given" for ch in puzzle]
        labels.append(row)
    return rows, labels


def entropy_markdown(plan, rows):
    """The entropy tables of results.md. rows: [(step, [entropy_by_position results, one per model])]."""
    lines = ["", "## Which answer positions have high entropy", "",
             f"gift.entropy_betas on {plan.n_entropy} fine-tuning puzzles (the whole answer masked, Algorithm 1). "
             "Step 0 is the base models (= GIFT*'s fixed betas); later rows are gift's models along training, "
             "averaged over bases and seeds. top-k share = fraction of each answer's k highest betas (k = its number of "
             "blanks) that are blank cells; r blank = mean beta_i / beta_ref on blank cells (how much more often "
             "GIFT masks them than SFT's uniform rate would suggest).", "",
             "| step | beta blank | beta given | beta fixed tokens | top-k share | r blank |",
             "|---|---|---|---|---|---|"]
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
    return lines

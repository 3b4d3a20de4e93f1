"""Grades after the turn end: d1's four graders (eval.grade) on d1's stored LLaDA-8B-Instruct generations, graded as
stored and as the sampler's early exit returns them (the text up to and including the first stop token, then EOS),
per task and gen length: rows, rows whose text after the first stop is not all EOS, grades that differ and how.
A last column says how far each grader reads past the turn end: the rows whose grade changes when the gold answer
(eval.shot_response's whole solved answer, d1's format) is written right after the first stop, against the early
exit's.

    python bench/grades_after_stop.py                          # the fixture, tests/data/d1_{task}.jsonl (675 rows)
    python bench/grades_after_stop.py --data ../shared/data    # all 6,426 stored rows, DATA/d1_generations/

The stored generations are decoded text and there is no LLaDA tokenizer here to count their tokens, so the early
exit's tail is one "<|endoftext|>" per special token and per white-space-separated word of the stored tail (about
its token count; no grader counts EOS). A GSM8K gold that d1 stored as null (its regex misses the sign of -10 and -3)
is never matched, as in d1. Sudoku's grade is its correct cells: "right->wrong" there means fewer cells right.
"""

import argparse
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the repo's top-level files are plain modules
import eval as E  # noqa: E402
from data import EOS, EOT, IM_END  # noqa: E402

STOP = re.compile("|".join(re.escape(t) for t in (EOT, IM_END, EOS)))  # LLaDA's and ChatML's stop tokens
TAIL_TOKENS = re.compile(r"<\|\w+\|>|(?:(?!<\|)\S)+")  # a special token, or a word up to one: ~ a token each
COLUMNS = ("rows", "tail not EOS", "differ", "right->wrong", "wrong->right", "gold after stop read")


def early_exit(text):
    """The text the early exit returns: up to and including the first stop token, then one EOS per tail token."""
    m = STOP.search(text)
    if m is None:
        return text  # the row never stopped: the early exit changes nothing
    return text[:m.end()] + EOS * len(TAIL_TOKENS.findall(text[m.end():]))


def item_of(task, row):
    """The eval item fields a grader reads, from a stored row's question and ground_truth (as tests/test_eval.py)."""
    gt = row["ground_truth"]
    if task == "sudoku":
        return dict(puzzle=re.search(r"puzzle: (\d{16})", row["question"]).group(1), solution=gt)
    if task == "countdown":
        return dict(numbers=gt[0], target=gt[1])
    return dict(gold=float("nan") if gt is None else gt)  # nan equals nothing: d1's null gold is always wrong


def stored_rows(task, data=None):
    """[(gen_length, generation, item)]: the fixture's rows, or with `data` every row of DATA/d1_generations/."""
    if data is None:
        lines = (REPO / "tests" / "data" / f"d1_{task}.jsonl").read_text(encoding="utf-8").splitlines()
        rows = [(r["gen_length"], r["generation"], r) for r in map(json.loads, lines)]
    else:
        files = sorted(Path(data, "d1_generations").glob(f"{task}_instruct_*_generations.json"))
        if not files:
            raise SystemExit(f"grades_after_stop.py: --data {data}: no {task}_instruct_*_generations.json in "
                             "its d1_generations/ folder")
        rows = [(int(f.name.split("_")[2]), r["generations"], r)  # {task}_instruct_{gen_length}_{steps}_{rank}_...
                for f in files for r in json.loads(f.read_text(encoding="utf-8"))["generations"]]
    return [(gen_length, text, item_of(task, r)) for gen_length, text, r in rows]


def score(task, text, item):
    """One grade as a number: 1 right / 0 wrong, Sudoku's correct cells."""
    grade = E.grade(task, text, item)
    return grade["correct_cells"] if task == "sudoku" else int(grade["correct"])


def compare(task, rows):
    """{gen_length: COLUMNS' counts}: each row graded as stored, after early_exit, and with the gold answer written
    right after its first stop (the grader reads past the turn end where that grade differs from early_exit's)."""
    table = {}
    for gen_length, text, item in rows:
        before, after = score(task, text, item), score(task, early_exit(text), item)
        m = STOP.search(text)
        tail_not_eos = m is not None and text[m.end():].replace(EOS, "") != ""
        planted = m is not None and score(task, text[:m.end()] + E.shot_response(task, item) + text[m.end():],
                                          item) != after
        counts = table.setdefault(gen_length, [0] * len(COLUMNS))
        for k, flag in enumerate((True, tail_not_eos, before != after, after < before, after > before, planted)):
            counts[k] += flag
    return {gen_length: tuple(counts) for gen_length, counts in sorted(table.items())}


def main(argv=None):
    p = argparse.ArgumentParser(description="d1's graders on d1's generations, as stored and after the early exit.")
    p.add_argument("--data", default=None, help="the full data folder holding d1_generations/ (default: the fixture)")
    args = p.parse_args(argv)
    rows = {task: stored_rows(task, args.data) for task in E.TASKS}  # a bad --data fails before any output
    print("| task | gen | " + " | ".join(COLUMNS) + " |\n|---|---:|" + "---:|" * len(COLUMNS))
    for task in E.TASKS:
        for gen_length, counts in compare(task, rows[task]).items():
            print(f"| {task} | {gen_length} | " + " | ".join(map(str, counts)) + " |")


if __name__ == "__main__":
    main()

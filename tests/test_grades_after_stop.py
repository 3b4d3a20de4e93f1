"""bench/grades_after_stop.py on the fixture's 675 d1 generations: the sampler's early exit (the text up to the first
stop token, then EOS) changes no grade, and the rows where a gold answer written after the first stop is read are
pinned per task and gen length, so a grader that starts (or stops) reading past the turn end changes a count here."""

import importlib.util

from conftest import REPO

spec = importlib.util.spec_from_file_location("bench_grades_after_stop", REPO / "bench" / "grades_after_stop.py")
G = importlib.util.module_from_spec(spec)
spec.loader.exec_module(G)

# {task: {gen_length: (rows, tail not EOS, differ, right->wrong, wrong->right, gold after stop read)}}
FIXTURE_COUNTS = {
    "sudoku": {128: (65, 0, 0, 0, 0, 0), 256: (65, 0, 0, 0, 0, 8), 512: (65, 0, 0, 0, 0, 19)},
    "countdown": {128: (65, 0, 0, 0, 0, 48), 256: (65, 1, 0, 0, 0, 52), 512: (65, 0, 0, 0, 0, 55)},
    "gsm8k": {128: (45, 0, 0, 0, 0, 12), 256: (45, 0, 0, 0, 0, 12), 512: (45, 1, 0, 0, 0, 0)},
    "math500": {128: (50, 0, 0, 0, 0, 38), 256: (50, 0, 0, 0, 0, 31), 512: (50, 0, 0, 0, 0, 33)},
}


def test_early_exit_text():
    assert G.early_exit("a <answer>5</answer><|eot_id|>\\boxed{7} x<|endoftext|>") == (
        "a <answer>5</answer><|eot_id|>" + "<|endoftext|>" * 3)  # one EOS per word or special token of the tail
    assert G.early_exit("<|im_end|>\n") == "<|im_end|>"  # ChatML's turn end; white space alone is no token
    assert G.early_exit("no stop") == "no stop"


def test_fixture_counts():
    assert {task: G.compare(task, G.stored_rows(task)) for task in FIXTURE_COUNTS} == FIXTURE_COUNTS

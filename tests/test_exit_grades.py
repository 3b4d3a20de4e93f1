"""Why eval.py samples without the early exit unless asked (issue 53, item 1): the early exit returns a row's tokens
after its first turn end as EOS, and every pattern of every d1 grader reads past the turn end. For each pattern a
reply (the text up to the turn end, which the exit keeps) and a tail (what a model may write after it) are built so
that the pattern decides the full text's grade and the grade differs from the exited text's: a proof by construction
that no task's grade is safe from the exit, so none is on by default. Then: eval.evaluate's default skips no token,
and the early exit is a records setting (a run with it never continues one without it)."""

import re

import pytest

import eval as E

EOT, EOS = "<|eot_id|>", "<|endoftext|>"
SOLUTION, PUZZLE = "3142243142131324", "3102200002100320"  # a 4x4 Sudoku (tests/data/ebf2705's first row)
GOLD = dict(gsm8k=dict(gold="5"), math500=dict(gold="5"), countdown=dict(numbers=[1, 2, 3], target=6),
            sudoku=dict(puzzle=PUZZLE, solution=SOLUTION))

# (task, the grader's rule the tail decides, reply, tail)
CASES = [
    ("gsm8k", "the first \\boxed{} holding a number", "It is 4.", "\\boxed{5}"),
    ("gsm8k", "a box whose brace closes after the turn end", "\\boxed{5", "}"),
    ("gsm8k", "no box: the first <answer> tag", "It is 4.", "<answer>5</answer>"),
    ("gsm8k", "an <answer> closed after the turn end", "<answer>5", "</answer>"),
    ("math500", "the last \\boxed", "\\boxed{4}", "\\boxed{5}"),
    ("math500", "no box: the whole text", "It is 5.", "\\boxed{5}"),
    ("math500", "an unclosed box: the first <answer> tag", "\\boxed{x", "<answer>5</answer>"),
    ("countdown", "the last \\boxed", "\\boxed{1+2+4}", "\\boxed{1+2+3}"),
    ("countdown", "an unclosed box: the first <answer> tag", "\\boxed{", "<answer>1+2+3</answer>"),
    ("countdown", "no box: the whole text, cut before its first '='", "I add them.", "1+2+3=6"),
    ("sudoku", "SUDOKU_PATTERNS[0], a code fence in the answer", "<answer>1234", f"```{SOLUTION}```"),
    ("sudoku", "SUDOKU_PATTERNS[1], the answer up to its end", "no answer here", f"<answer>{SOLUTION}</answer>"),
    ("sudoku", "SUDOKU_PATTERNS[2], text after </answer>", "no answer here", f"</answer>{SOLUTION}"),
    ("sudoku", "SUDOKU_PATTERNS[3], 16 digits before </answer>", "no answer here", f"x{SOLUTION}</answer>"),
    ("sudoku", "SUDOKU_PATTERNS[4], a standalone 16-digit run", "no answer here", f" {SOLUTION} "),
]


def exited(text):
    """The text eval.py grades after the early exit: up to the first turn end, then EOS (one per tail token; how
    many does not matter to a grader, tests/test_grades_after_stop.py)."""
    reply, _, tail = text.partition(EOT)
    return reply + EOT + EOS * max(1, len(tail.split()))


def sudoku_pattern(text):
    """The index of the SUDOKU_PATTERNS entry that decides extract_sudoku(text) (its first non-empty capture)."""
    return next(i for i, p in enumerate(E.SUDOKU_PATTERNS) if (m := re.search(p, text, re.DOTALL)) and m.group(1).strip())


@pytest.mark.parametrize("task, rule, reply, tail", CASES, ids=[f"{c[0]}: {c[1]}" for c in CASES])
def test_a_tail_after_the_turn_end_changes_the_grade(task, rule, reply, tail):
    full = reply + EOT + tail + EOT + EOS
    assert E.grade(task, full, GOLD[task]) != E.grade(task, exited(full), GOLD[task]), rule
    if task == "sudoku":  # the case is the pattern it names
        assert sudoku_pattern(full) == int(rule[len("SUDOKU_PATTERNS[")])


def test_every_grader_and_pattern_has_its_case():
    assert {c[0] for c in CASES} == set(E.TASKS)
    assert sorted(int(c[1][len("SUDOKU_PATTERNS[")]) for c in CASES if c[0] == "sudoku") == list(
        range(len(E.SUDOKU_PATTERNS)))


def test_the_issue_generation():
    """Issue 53's: a trained toy model's answer, whose first <answer tag is not closed before its first turn end."""
    full = f"<answer{EOT}4222343143121334</answer>{EOT}" + EOS * 4
    item = GOLD["sudoku"]
    assert E.grade("sudoku", full, item)["correct_cells"] == 6 and E.grade("sudoku", exited(full), item) == dict(
        correct_cells=0, empty_cells=8)


def test_evaluate_default_has_no_early_exit():
    """eval.evaluate with the options' early_exit unset (eval.py's default) skips no token on any task, on a model
    that writes its turn end early; early_exit=True skips some (the opt-in still works)."""
    from test_early_exit import StopBiasHead
    from test_eval import _countdown_items, tiny_model_and_tokenizer

    from sample import SamplerOptions
    from sample import stop_ids as sample_stop_ids
    items = _countdown_items()
    model, tokenizer = tiny_model_and_tokenizer("".join(it["question"] for it in items))
    t = model.model.transformer
    t.ff_out = StopBiasHead(t.ff_out, sample_stop_ids(tokenizer), 3.0, model.config.mask_token_id, 0.0)
    skipped = {}
    for early_exit in (None, True):
        run = E.SeedRun()
        o = SamplerOptions(gen_length=16, steps=8, block_length=4, early_exit=early_exit)
        E.evaluate(model, tokenizer, items, "countdown", o, batch_size=3, prompt_style="plain", run=run)
        skipped[early_exit] = run.tokens["skipped"]
    assert skipped[None] == 0 and skipped[True] > 0


# -----------------------------------------------------------------------------
# Item 2: every option that can change a token or a grade is a records setting

NON_DEFAULT = dict(gen_length=64, steps=32, block_length=16, temperature=0.5, cfg_scale=1.5, remasking="random",
                   logits_eos_inf=True, confidence_eos_eot_inf=True, cache="dual", threshold=0.9, cache_refresh=2,
                   cache_drift=0.9, cache_window=8, early_exit=True, sampler="dream", alg="entropy", alg_temp=0.5,
                   eps=0.01, top_p=0.9, top_k=5)


def test_every_sampler_option_is_a_records_setting():
    """eval.sampler_settings reads SamplerOptions' fields: each set to another value than its default is recorded
    (a field added to SamplerOptions without a value here fails, so a new option is checked too), the block
    sampler's unread by Dream's and Dream's by the block sampler's are not."""
    from dataclasses import fields

    from sample import DREAM_ONLY, NEEDS_CACHE, SamplerOptions
    assert sorted(NON_DEFAULT) == sorted(f.name for f in fields(SamplerOptions))
    lengths = dict(gen_length=64, steps=32, block_length=16)
    for name, value in NON_DEFAULT.items():
        dream = name in DREAM_ONLY or name == "sampler"
        base = dict(sampler="dream") if dream else dict(lengths, cache="dual" if name in NEEDS_CACHE else None)
        o = SamplerOptions(**{**base, name: value})
        assert E.sampler_settings(o)[name] == value, name
        unread = {"early_exit", "cfg_scale", "remasking"} if dream else set(DREAM_ONLY) | {"sampler"}
        assert not unread & set(E.sampler_settings(o)), name
    assert "early_exit" not in E.sampler_settings(SamplerOptions(**lengths))  # unset: as records of older eval.py


def test_records_of_another_early_exit_are_not_continued(tmp_path):
    """`--limit 2 --early-exit` then `--limit 4` (no exit) is refused naming early_exit, not continued into one
    summary; the summary of the first names it."""
    import json

    from test_eval import record_lines
    from test_sample_eval_refusals import eval_argv
    argv = eval_argv(tmp_path, "--batch-size", "2")
    E.main(argv + ["--limit", "2", "--early-exit"])
    with pytest.raises(SystemExit, match="early_exit True in the file, None now"):
        E.main(argv + ["--limit", "4"])
    assert len(record_lines(tmp_path / "r.jsonl")) == 2  # nothing added
    assert json.loads((tmp_path / "r.json").read_text())["early_exit"] is True
    E.main(argv + ["--limit", "4", "--early-exit"])  # the same settings continue
    assert [r["index"] for r in record_lines(tmp_path / "r.jsonl")] == [0, 1, 2, 3]

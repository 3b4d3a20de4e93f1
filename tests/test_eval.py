"""eval.py: d1's protocol constants, the benchmark loaders, prompts, each grading rule and quirk, d1's own verdicts
on its stored generations, and evaluate() / the CLI with a tiny random model.

The data tests read the fixture in tests/data (tests/data/README.md): a few hundred of d1's stored generations per
task with d1's per-item verdicts, on which our graders must agree item by item. The full-set reproduction of d1's
published numbers is opt-in (marker full_data): GIFT_DATA=/path/to/data python -m pytest -q tests/test_eval.py"""

import ast
import glob
import json
import random
import re
import warnings

import pytest
import torch

import eval as E
import longjob
import sample
from conftest import DATA
from sample import SamplerOptions

# d1 paper Table 1 (LLaDA-8B-Instruct) at gen length 128 / 256 / 512. GSM8K: d1's rules on the 1130 problems that
# the stored files hold (the paper's 68.7 / 76.7 / 78.2 are on all 1319; see tests/data/README.md).
D1_GENERATIONS_PUBLISHED = {
    "math500": (26.0, 32.4, 36.2),
    "countdown": (20.7, 19.5, 16.0),
    "sudoku": (11.7, 6.7, 5.5),
    "gsm8k": (69.3, 76.4, 78.1),
}
DATA_FILES = dict(gsm8k="gsm8k_test.jsonl", math500="math500_test.jsonl", countdown="countdown_cd3_test.jsonl",
                  sudoku="sudoku_4x4_test.csv")


GEN_LENGTHS = (128, 256, 512)


def fixture_rows(task):
    """The fixture's rows of d1's generations: {gen_length, file, row, question, ground_truth, generation} and d1's
    verdict, d1_correct (Sudoku: d1_correct_cells, d1_empty_cells)."""
    return [json.loads(line) for line in (DATA / f"d1_{task}.jsonl").read_text(encoding="utf-8").splitlines()]


def d1_rows(folder, task, gen_length):
    """All of d1's stored rows {question, generations, ground_truth} for one task and gen length (full data)."""
    files = sorted(glob.glob(str(folder / "d1_generations" / f"{task}_instruct_{gen_length}_*_generations.json")))
    assert files, f"no d1 generations for {task} {gen_length}"
    return [row for f in files for row in json.load(open(f, encoding="utf-8"))["generations"]]


def puzzle_of(question):
    return re.search(r"puzzle: (\d{16})", question).group(1)


def our_verdict(task, row, generation_key="generation"):
    """Our grader on one stored row: a bool, or (correct cells, empty cells) for Sudoku. d1's GSM8K gold None (the
    two negative answers, whose sign its regex misses) is always wrong."""
    gen, gt = row[generation_key], row["ground_truth"]
    if task == "sudoku":
        return E.grade_sudoku(gen, puzzle_of(row["question"]), gt)
    if task == "countdown":
        return E.grade_countdown(gen, *gt)
    if task == "math500":
        return E.grade_math(gen, gt)
    return gt is not None and E.grade_gsm8k(gen, gt)


# -----------------------------------------------------------------------------
# Protocol constants


def test_instructions_equal_d1_prompts_file():
    d1 = json.loads((DATA / "d1_prompts.json").read_text())
    for name in ("GSM_SYSTEM_PROMPT", "MATH500_SYSTEM_PROMPT", "CTD_SYSTEM_PROMPT", "SUDOKU_SYSTEM_PROMPT"):
        assert getattr(E, name) == d1[name], name


def test_generation_defaults():
    assert E.GEN_LENGTH == dict(sudoku=512, countdown=512, gsm8k=256, math500=256)
    assert E.BLOCK_LENGTH == 32


def test_sudoku_subset_indices():
    idx = E.sudoku_subset(500)
    assert idx[:10] == [361, 73, 374, 155, 104, 394, 377, 124, 68, 450]
    assert len(idx) == len(set(idx)) == 256
    assert sorted(E.sudoku_subset(10)) == list(range(10))  # a small file is only shuffled
    listed = re.search(r"Seed-42 row indices.*?```\s*([\d,]+)\s*```", (DATA / "README.md").read_text(), re.S)
    assert idx == [int(i) for i in listed.group(1).split(",")]  # the full list d1's files confirm (README)


# -----------------------------------------------------------------------------
# Loaders


def check_questions_and_golds(task, items, rows):
    """Our question templates give d1's questions, our golds its ground truths."""
    by_question = {it["question"]: it for it in items}
    for row in rows:
        it = by_question[row["question"]]
        gt = row["ground_truth"]
        if task == "countdown":
            assert [it["numbers"], it["target"]] == gt
        elif task == "sudoku":
            assert (it["puzzle"], it["solution"]) == (puzzle_of(row["question"]), gt)
        elif gt is not None:  # GSM8K: d1's None golds are the two negative answers (see below)
            assert it["gold"] == gt


def test_loaders_match_d1_questions_and_golds():
    """On the fixture: the cut GSM8K / MATH500 files hold the problems of the fixture's rows, Countdown and Sudoku are
    whole; every fixture row, at every gen length, is checked."""
    for task, name in DATA_FILES.items():
        items = E.load_benchmark(task, DATA / name)
        lines = (DATA / name).read_text(encoding="utf-8").splitlines()
        assert len(items) == (256 if task == "sudoku" else len(lines))  # Sudoku: d1's subset of the 500
        check_questions_and_golds(task, items, fixture_rows(task))
    sudoku = E.load_sudoku(DATA / DATA_FILES["sudoku"])
    assert sudoku[0]["puzzle"] == (DATA / DATA_FILES["sudoku"]).read_text().splitlines()[1 + 361][:16]
    assert any(it["puzzle"].startswith("0") for it in sudoku)  # read as text: leading zeros kept


@pytest.mark.full_data
def test_loaders_match_d1_questions_and_golds_full_data(full_data):
    for task, name in DATA_FILES.items():
        items = E.load_benchmark(task, full_data / name)
        assert len(items) == dict(gsm8k=1319, math500=500, countdown=256, sudoku=256)[task]
        check_questions_and_golds(task, items, d1_rows(full_data, task, 256))


def test_gsm8k_gold_parsing():
    assert E.parse_gsm8k_gold("so 2,125 in all\n#### 2,125") == 2125.0
    assert E.parse_gsm8k_gold("#### -10") == -10.0  # d1's regex misses the sign (gold None)
    assert E.parse_gsm8k_gold("#### $5.50") == 5.5
    assert E.parse_gsm8k_gold("no final answer") is None
    item = E.load_gsm8k(DATA / "gsm8k_test.jsonl")[0]  # the file's first line: the fixture keeps it
    assert item["gold"] == 18.0 and "<<" not in item["reasoning"] and "####" not in item["reasoning"]


@pytest.mark.parametrize("task,text,line", [
    ("gsm8k", '{"question": "q", "answer": "#### 1"}\n{"question": "q", "answer": "no number"}\n', 2),
    ("gsm8k", '{"question": "q", "answer": "#### 1"}\n\n{"question": "q", "answer": \n', 3),
    ("math500", '{"problem": "p"}\n', 1),
    ("countdown", '{"input": "1,2,3", "output": "6"}\n{"input": "1,x", "output": "6"}\n', 2),
    ("sudoku", "Puzzle,Solution\n3102200002100320,3142243142131324\n102200002100320,3142243142131324\n", 3),
    ("sudoku", "A,B\n1,2\n", 1),
])
def test_bad_rows_name_file_and_line(tmp_path, task, text, line):
    path = tmp_path / f"bad.{'csv' if task == 'sudoku' else 'jsonl'}"
    path.write_text(text)
    with pytest.raises(ValueError, match=re.escape(f"{path}, line {line}")):
        E.load_benchmark(task, path)


# -----------------------------------------------------------------------------
# Prompts (chat_prompt comes from data.py)


def test_d1_prompt_exact():
    item = dict(question="Numbers: [49, 55, 53]\nTarget: 51", numbers=[49, 55, 53], target=51)
    assert E.build_prompt("countdown", item) == (
        "<|startoftext|><|start_header_id|>user<|end_header_id|>\n\n" + E.CTD_SYSTEM_PROMPT
        + "\n\nNumbers: [49, 55, 53]\nTarget: 51<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n<reasoning>")
    # the template strips the content: Sudoku's leading newline and the question's trailing one go
    sudoku = dict(question=E.SUDOKU_QUESTION.format(puzzle="3102200002100320"))
    text = E.build_prompt("sudoku", sudoku)
    assert text.startswith("<|startoftext|><|start_header_id|>user<|end_header_id|>\n\nPlease solve")
    assert text.endswith("puzzle: 3102200002100320<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
                         "<reasoning>")
    math = E.build_prompt("math500", dict(question="What is 1+1?"))
    assert '</answer>" \n\n\nWhat is 1+1?<|eot_id|>' in math  # the MATH500 prompt's stray '" ' stays inside


def test_plain_prompt_is_the_embedded_task_prompt():
    import data
    import embedded
    sudoku = dict(question=E.SUDOKU_QUESTION.format(puzzle="3102200002100320"))
    assert E.build_prompt("sudoku", sudoku, "plain") == data.chat_prompt(embedded.sudoku_messages("3102200002100320"))


def test_d1_prompt_in_dreams_chat_format():
    """A Dream model (its tokenizer has ChatML's tokens) gets the same user turn in ChatML, after Qwen2.5's default
    system turn, and d1's "<reasoning>" after the assistant header; the plain prompt is the embedded task's in
    ChatML."""
    import data
    import embedded
    item = dict(question="Numbers: [49, 55, 53]\nTarget: 51", numbers=[49, 55, 53], target=51)
    assert E.build_prompt("countdown", item, fmt="chatml") == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n" + E.CTD_SYSTEM_PROMPT
        + "\n\nNumbers: [49, 55, 53]\nTarget: 51<|im_end|>\n<|im_start|>assistant\n<reasoning>")
    sudoku = dict(question=E.SUDOKU_QUESTION.format(puzzle="3102200002100320"))
    assert E.build_prompt("sudoku", sudoku, "plain", fmt="chatml") == data.chat_prompt(
        embedded.sudoku_messages("3102200002100320"), "chatml")
    assert data.chat_format(embedded.make_char_tokenizer(family="dream")) == "chatml"


def test_few_shot_format():
    shots = [dict(question="What is 2+2?", gold=4.0, reasoning="2 + 2 = 4.")]
    text = E.build_prompt("gsm8k", dict(question="What is 3+3?"), shots=shots)
    assert (E.GSM_SYSTEM_PROMPT.strip() + "\n\nExample question:\nWhat is 2+2?\nExample response:\n<reasoning>\n"
            "2 + 2 = 4.\n</reasoning>\n<answer>\n\\boxed{4}\n</answer>\n\nQuestion:\nWhat is 3+3?<|eot_id|>") in text
    plain = E.build_prompt("sudoku", dict(question="Q2"), "plain", [dict(question="Q1", solution="1" * 16)])
    assert "Example question:\nQ1\nExample response:\n<answer>" + "1" * 16 + "</answer>\n\nQuestion:\nQ2" in plain
    assert E.pick_shots(list(range(10)), 3, seed=1) == E.pick_shots(list(range(10)), 3, seed=1)
    with pytest.raises(ValueError, match="only 2"):
        E.pick_shots([1, 2], 3, seed=0)


def test_few_shot_countdown_solutions_grade_correct():
    for it in E.load_countdown(DATA / DATA_FILES["countdown"]):  # the whole file
        expression = E.solve_countdown(it["numbers"], it["target"])
        assert E.grade_countdown("\\boxed{" + expression + "}", it["numbers"], it["target"]), it
    assert E.solve_countdown([2, 3], 100) is None


# -----------------------------------------------------------------------------
# GSM8K rules


def test_gsm8k_first_box_with_a_number_wins():
    text = "\\boxed{} \\boxed{...} \\boxed{....} \\boxed{x} \\boxed{12} \\boxed{13}"
    assert E.grade_gsm8k(text, 12) and not E.grade_gsm8k(text, 13)


def test_gsm8k_box_ends_at_first_brace():
    assert E.grade_gsm8k("\\boxed{\\frac{1}{2}}", 1)  # reads "\frac{1": the number 1
    assert not E.grade_gsm8k("\\boxed{\\frac{1}{2}}", 0.5)
    assert not E.grade_gsm8k("\\boxed{\n5\n}", 5)  # a box over lines is not seen


def test_gsm8k_box_content_float_then_first_number():
    assert E.grade_gsm8k("\\boxed{ 7 }", 7)
    assert E.grade_gsm8k("\\boxed{18 dollars}", 18)
    assert E.grade_gsm8k("\\boxed{x = 5, y = 3}", 5)
    assert E.grade_gsm8k("\\boxed{1,000}", 1) and not E.grade_gsm8k("\\boxed{1,000}", 1000)
    assert E.grade_gsm8k("\\boxed{1_000}", 1000)  # Python's float() accepts underscores
    assert E.grade_gsm8k("\\boxed{-3}", -3)


def test_gsm8k_answer_tag_fallback():
    assert E.grade_gsm8k("<answer>\n 7 \n</answer>", 7)
    assert E.grade_gsm8k("<answer>\nfirst 3, then 42\n</answer>", 42)  # the LAST number
    assert E.grade_gsm8k("<answer>5</answer><answer>6</answer>", 5)  # the first tag
    assert E.grade_gsm8k("\\boxed{x} <answer>4</answer>", 4)  # a box without a number falls through
    assert E.grade_gsm8k("\\boxed{9} <answer>4</answer>", 9)
    assert not E.grade_gsm8k("the answer is 4", 4)  # neither a box nor a tag
    assert not E.grade_gsm8k("<answer>\n</answer> 4", 4)


# -----------------------------------------------------------------------------
# MATH rules


def test_last_boxed():
    assert E.last_boxed("\\boxed{a} then \\boxed{\\frac{1}{2}} end") == "\\frac{1}{2}"
    assert E.last_boxed("$\\boxed 5$ and \\boxed{7}") == "5"  # "\boxed " with a space wins wherever it is
    assert E.last_boxed("no box here") == "no box here"  # the whole text
    assert E.last_boxed("\\boxed{1 + {2}") is None  # never closed
    assert E.last_boxed("\\fbox{3}") == "\\fbox{3}"
    assert E.last_boxed("x} \\boxed{4}") == "4"


def test_grade_math_candidate_fallbacks():
    assert E.grade_math("\\boxed{\\dfrac{1}{2}}", "\\frac12")
    assert E.grade_math("<answer>\n3\n</answer> \\boxed{3", "3")  # unclosed: the <answer> content
    assert E.grade_math("<answer>3</answer> \\boxed{}", "3")  # empty: the <answer> content
    assert not E.grade_math("\\boxed{3", "3")  # unclosed, no tag: no answer
    assert not E.grade_math("<answer>3</answer>", "3")  # no box: the whole text is compared
    assert E.grade_math("3", "3")


@pytest.mark.parametrize("raw,stripped", [
    ("a\nb\\!c", "abc"),
    ("\\\\frac{1}{3}", "\\frac{1}{3}"),
    ("\\tfrac{1}{3}", "\\frac{1}{3}"), ("\\dfrac{1}{3}", "\\frac{1}{3}"),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})"),
    ("90^\\circ", "90"), ("90^{\\circ}", "90"), ("\\$5", "5"),
    ("10\\text{ cm}", "10"), ("10\\text{cm}", "10\\text{cm}"),
    ("50\\%", "50"),
    ("1 .5", "10.5"), ("{.5}", "{0.5}"), (".25", "0.25"),
    ("x = 3", "3"), ("abc = 3", "abc=3"), ("a=b=c", "a=b=c"),
    ("\\sqrt3", "\\sqrt{3}"), ("\\sqrt{3}", "\\sqrt{3}"),
    ("\\frac12", "\\frac{1}{2}"), ("\\frac1b", "\\frac{1}{b}"), ("\\frac1{72}", "\\frac{1}{72}"),
    ("\\frac1", "\\frac1"),  # a one-character remainder leaves the string as is
    ("0.5", "\\frac{1}{2}"), (".5", "\\frac{1}{2}"),
    ("3/4", "\\frac{3}{4}"), ("03/4", "03/4"), ("1/2/3", "1/2/3"),
    ("", ""),
])
def test_strip_string_steps(raw, stripped):
    assert E.strip_string(raw) == stripped


@pytest.mark.parametrize("raw", ["1\\text{ m}\\text{ s}", "2\\sqrt", "2\\frac", "a/b", "1.5/2"])
def test_strip_string_failures_fall_back_to_raw(raw):
    with pytest.raises(Exception):
        E.strip_string(raw)
    assert E.math_equiv(raw, raw)
    assert not E.math_equiv(raw, raw.replace("/", " / ") if "/" in raw else raw + " ")  # raw strings differ


# -----------------------------------------------------------------------------
# Countdown rules


def test_countdown_validity_and_value():
    assert E.grade_countdown("<answer>\\boxed{49 + 55 - 53}</answer>", [49, 55, 53], 51)
    assert not E.grade_countdown("\\boxed{49 + 55 - 53}", [49, 55, 53], 52)
    assert not E.grade_countdown("\\boxed{55 - 4}", [49, 55, 53], 51)  # numbers not all used
    assert not E.grade_countdown("\\boxed{49 + 55 - 53 + 0}", [49, 55, 53], 51)  # an extra number
    assert not E.grade_countdown("\\boxed{5 * 2.5}", [5, 2], 12.5)  # "2.5" counts as 2 and 5


def test_countdown_latex_ops_and_equals():
    assert E.grade_countdown("\\boxed{(30 \\times 4) \\div 8 \\cdot 2}", [30, 4, 8, 2], 30)
    assert E.grade_countdown("\\boxed{49 + 55 - 53 = 51}", [49, 55, 53], 51)
    assert E.grade_countdown("so x: 49+55-53=51", [49, 55, 53], 51)  # no box: the whole text, run before "="
    assert not E.grade_countdown("\\boxed{51 = 49 + 55 - 53}", [49, 55, 53], 51)


def test_countdown_python_arithmetic_semantics():
    assert E.grade_countdown("\\boxed{2**3}", [2, 3], 8)  # "**" is a power
    assert not E.grade_countdown("\\boxed{2^3}", [2, 3], 8)  # "^" is not allowed
    assert E.grade_countdown("\\boxed{7 // 2}", [7, 2], 3)  # floor division
    assert not E.grade_countdown("\\boxed{07 + 1}", [7, 1], 8)  # "07" is a syntax error
    assert E.grade_countdown("\\boxed{ 7 + 1}", [7, 1], 8)  # eval drops leading spaces
    assert not E.grade_countdown("\\boxed{7 / (1 - 1)}", [7, 1, 1], 0)  # division by zero
    assert not E.grade_countdown("\\boxed{9**9**9}", [9, 9, 9], 0)  # refused, not computed
    assert E.grade_countdown("\\boxed{1 ** 99 ** 9}", [1, 99, 9], 1)  # small enough to compute exactly


def test_countdown_expression_fallbacks():
    assert E.grade_countdown("<answer>1 + 2</answer> \\boxed{3", [1, 2], 3)  # unclosed: the tag content
    assert not E.grade_countdown("\\boxed{} <answer>1 + 2</answer>", [1, 2], 3)  # an empty box is kept
    assert E.grade_countdown("1 + 2", [1, 2], 3)  # no box: the whole text


def test_eval_arithmetic_whitelist():
    for bad in ["()", "...", "(1).real", "__import__('os')", "[1]", "1 if 1 else 2", "3(4)"]:
        with pytest.raises((ValueError, SyntaxError)):
            E.eval_arithmetic(bad)


def test_eval_arithmetic_equals_python_eval():
    rng = random.Random(0)
    alphabet = "0123456789+-*/(). \t"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SyntaxWarnings of the reference eval ("3(4)")
        for _ in range(3000):
            s = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 9)))
            try:
                want = ("ok", eval(s, {"__builtins__": None}, {}))  # the reference, on random text we generated
            except Exception:
                want = ("error",)
            try:
                got = ("ok", E.eval_arithmetic(s))
            except Exception:
                got = ("error",)
            assert got == want, s


def test_no_python_eval_in_eval_py():
    tree = ast.parse(open(E.__file__).read())
    calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert "eval" not in calls and "exec" not in calls


# -----------------------------------------------------------------------------
# Sudoku rules

SOLUTION = "3142243142131324"
PUZZLE = "3102200002100320"  # 8 blanks


def test_sudoku_extraction_cascade():
    assert E.extract_sudoku("<answer>\n```\n3142 2431\n4213 1324\n```\n</answer>") == SOLUTION  # code fence
    assert E.extract_sudoku("<answer>\n3142243142131324\n</answer>") == SOLUTION  # across lines (DOTALL)
    assert E.extract_sudoku("<answer>\n3142243142131324<|eot_id|>") == SOLUTION  # up to <|eot_id|>
    assert E.extract_sudoku("grid</answer>\n3142243142131324<|eot_id|>") == SOLUTION  # after </answer>
    assert E.extract_sudoku("grid 3142243142131324\n</answer>") == SOLUTION  # 16 digits before </answer>
    assert E.extract_sudoku("The grid is 3142243142131324.") == SOLUTION  # standalone run
    assert E.extract_sudoku("x31422431421313245") == ""  # not standalone, not 16
    # the first NON-EMPTY capture wins, even if it is not a grid
    assert E.extract_sudoku("<answer>\n</answer> so 3142243142131324<|eot_id|>") == "so3142243142131324"


def test_sudoku_scoring_pads_and_cuts():
    assert E.grade_sudoku("<answer>3142243142131324</answer>", PUZZLE, SOLUTION) == (8, 8)
    # only blanks count: a wrong given cell changes nothing
    assert E.grade_sudoku("<answer>4142243142131324</answer>", PUZZLE, SOLUTION) == (8, 8)
    assert E.grade_sudoku("<answer>3142</answer>", PUZZLE, SOLUTION) == (1, 8)  # padded with "0"
    assert E.grade_sudoku("<answer>31422431421313241111</answer>", PUZZLE, SOLUTION) == (8, 8)  # cut to 16
    assert E.grade_sudoku("<answer>03142243142131324</answer>", PUZZLE, SOLUTION)[0] < 8  # shifted, not aligned
    assert E.grade_sudoku("no answer at all", PUZZLE, SOLUTION) == (0, 8)
    assert E.accuracy("sudoku", [dict(correct_cells=1, empty_cells=8), dict(correct_cells=7, empty_cells=8)]) == 50.0


# -----------------------------------------------------------------------------
# d1's own generations: our graders give d1's verdict on every fixture item (and, opt-in, d1's published numbers on
# the full files)


@pytest.mark.parametrize("task", ["math500", "countdown", "sudoku", "gsm8k"])
def test_graders_agree_with_d1_on_every_fixture_item(task):
    rows = fixture_rows(task)
    for r in rows:
        want = (r["d1_correct_cells"], r["d1_empty_cells"]) if task == "sudoku" else r["d1_correct"]
        assert our_verdict(task, r) == want, (r["file"], r["row"], r["generation"][-300:])
    for gen_length in GEN_LENGTHS:  # both verdicts, at every gen length
        verdicts = {bool(r["d1_correct_cells"] if task == "sudoku" else r["d1_correct"])
                    for r in rows if r["gen_length"] == gen_length}
        assert verdicts == {True, False}, (task, gen_length)
    if task == "sudoku":  # answers scored in full, in part and not at all
        assert {min(r["d1_correct_cells"], 1) + (r["d1_correct_cells"] == r["d1_empty_cells"])
                for r in rows} == {0, 1, 2}


def test_gsm8k_negative_golds_with_our_parsing():
    """d1 drops the sign of the two negative golds (its gold is None: always wrong); ours keeps it, and then our
    verdict is d1's rule's with the signed gold. The fixture holds both items at each gen length."""
    ours = {it["question"]: it["gold"] for it in E.load_gsm8k(DATA / "gsm8k_test.jsonl")}
    rows = fixture_rows("gsm8k")
    negative = [r for r in rows if r["ground_truth"] is None]
    assert sorted((r["gen_length"], ours[r["question"]]) for r in negative) == [
        (n, g) for n in GEN_LENGTHS for g in (-10.0, -3.0)]
    for r in negative:
        assert E.grade_gsm8k(r["generation"], ours[r["question"]]) == r["d1_correct_signed_gold"], (r["file"], r["row"])
    assert all(ours[r["question"]] == r["ground_truth"] for r in rows if r["ground_truth"] is not None)


@pytest.mark.full_data
@pytest.mark.parametrize("task", ["math500", "countdown", "sudoku", "gsm8k"])
def test_d1_generations_reproduce_published_numbers(task, full_data):
    got = []
    for gen_length in GEN_LENGTHS:
        rows = d1_rows(full_data, task, gen_length)
        verdicts = [our_verdict(task, r, "generations") for r in rows]
        if task == "sudoku":
            acc = 100 * sum(c for c, _ in verdicts) / sum(e for _, e in verdicts)
        else:
            acc = 100 * sum(verdicts) / len(rows)
        got.append(round(acc, 1))
    assert tuple(got) == D1_GENERATIONS_PUBLISHED[task]


@pytest.mark.full_data
def test_gsm8k_negative_golds_with_our_parsing_full_data(full_data):
    """With the signed golds, d1's 1130 stored GSM8K generations score 69.5 / 76.5 / 78.2."""
    ours = {it["question"]: it["gold"] for it in E.load_gsm8k(full_data / "gsm8k_test.jsonl")}
    got = []
    for gen_length in GEN_LENGTHS:
        rows = d1_rows(full_data, "gsm8k", gen_length)
        assert len(rows) == 1130
        assert sorted(ours[r["question"]] for r in rows if r["ground_truth"] is None) == [-10.0, -3.0]
        got.append(round(100 * sum(E.grade_gsm8k(r["generations"], ours[r["question"]]) for r in rows) / len(rows), 1))
    assert tuple(got) == (69.5, 76.5, 78.2)


@pytest.mark.full_data
def test_fixture_is_cut_from_the_full_data(full_data):
    """tests/data holds d1's rows and the benchmark lines as they are in the full data (make_fixture.py)."""
    for task in DATA_FILES:
        for r in fixture_rows(task):
            stored = json.load(open(full_data / "d1_generations" / r["file"], encoding="utf-8"))
            row = stored["generations"][r["row"]]
            assert stored["gen_length"] == r["gen_length"]
            assert (row["question"], row["ground_truth"], row["generations"]) == (
                r["question"], r["ground_truth"], r["generation"]), (r["file"], r["row"])
    for name in ("countdown_cd3_test.jsonl", "sudoku_4x4_test.csv", "d1_prompts.json"):
        assert (DATA / name).read_bytes() == (full_data / name).read_bytes(), name
    for name in ("gsm8k_test.jsonl", "math500_test.jsonl"):  # a subsequence of the full file's lines
        full = iter((full_data / name).read_bytes().splitlines(keepends=True))
        assert all(line in full for line in (DATA / name).read_bytes().splitlines(keepends=True)), name


# -----------------------------------------------------------------------------
# evaluate() and the CLI with a tiny random model (the embedded task's code path)


def tiny_model_and_tokenizer(extra_chars=""):
    import embedded
    from model import LLaDA
    chars = "".join(sorted(set(embedded.CHAR_VOCAB + extra_chars)))
    tokenizer = embedded.make_char_tokenizer(chars)
    config = embedded.tiny_config_for(tokenizer, d_model=32, n_heads=2, n_kv_heads=2, n_layers=2, mlp_hidden_size=64)
    model = LLaDA(config).init_weights(torch.Generator().manual_seed(0))
    return model, tokenizer


def test_evaluate_left_padding_and_batching(one_thread):
    items = _countdown_items()
    model, tokenizer = tiny_model_and_tokenizer("".join(it["question"] for it in items))
    model = model.double()  # prompts of different lengths: float64 so padding cannot flip an argmax
    kw = dict(sampler_options=SamplerOptions(gen_length=16, steps=8, block_length=8), prompt_style="plain")
    acc1, rec1 = E.evaluate(model, tokenizer, items, "countdown", batch_size=1, **kw)
    acc3, rec3 = E.evaluate(model, tokenizer, items, "countdown", batch_size=3, **kw)
    assert [r["generation"] for r in rec1] == [r["generation"] for r in rec3]
    assert [r["index"] for r in rec3] == list(range(5)) and acc1 == acc3 == E.accuracy("countdown", rec3)
    assert all(set(r) >= {"question", "generation", "numbers", "target", "correct"} for r in rec3)
    assert model.training  # evaluate restores the mode it found


def test_cli_on_embedded_sudoku_task(tmp_path, capsys, one_thread):
    model, tokenizer = tiny_model_and_tokenizer()
    model.save_pretrained(tmp_path / "ckpt")
    tokenizer.save(str(tmp_path / "ckpt" / "tokenizer.json"))
    csv_path = tmp_path / "sudoku.csv"
    csv_path.write_text("Puzzle,Solution\n3102200002100320,3142243142131324\n0142243142131320,3142243142131324\n"
                        "3142000042131324,3142243142131324\n")
    out = tmp_path / "res.json"
    E.main(["--model", str(tmp_path / "ckpt"), "--task", "sudoku", "--data", str(csv_path), "--prompt-style",
            "plain", "--gen-length", "24", "--steps", "12", "--block-length", "8", "--batch-size", "2",
            "--seeds", "0", "1", "--limit", "2", "--out", str(out)])
    result = json.loads(out.read_text())
    assert [r["seed"] for r in result["runs"]] == [0, 1] and result["accuracy_std"] == 0.0  # greedy
    records = result["runs"][0]["records"]
    assert len(records) == 2 and all(r["empty_cells"] == r["puzzle"].count("0") for r in records)
    assert result["accuracy_mean"] == E.accuracy("sudoku", records)
    assert "sudoku accuracy" in capsys.readouterr().out


def _countdown_items():
    return [dict(question=E.COUNTDOWN_QUESTION.format(numbers=n, target=t), numbers=n, target=t)
            for n, t in [([1, 2, 3], 6), ([10, 20, 300], 5), ([7, 8], 1), ([100, 2, 33, 4], 9), ([5], 5)]]


def _distributed_worker(rank, world, port, out_path):
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    items = _countdown_items()
    model, tokenizer = tiny_model_and_tokenizer("".join(it["question"] for it in items))  # same seed on each rank
    acc, records = E.evaluate(model.double(), tokenizer, items, "countdown",
                              SamplerOptions(gen_length=16, steps=8, block_length=8), batch_size=2,
                              prompt_style="plain")
    if rank == 0:
        out_path.write_text(json.dumps([acc, records]))
    else:
        assert acc is None and records is None
    dist.destroy_process_group()


def test_evaluate_two_ranks_equals_one_process(tmp_path, one_thread):
    """Rank r takes items r, r+2, ...; rank 1 has 2 items, rank 0 has 3, so rank 1 runs a dummy batch to keep the
    batch counts equal; rank 0 gathers everything back in item order."""
    import socket
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_distributed_worker, args=(2, port, tmp_path / "out.json"), nprocs=2)
    acc2, records2 = json.loads((tmp_path / "out.json").read_text())
    items = _countdown_items()
    model, tokenizer = tiny_model_and_tokenizer("".join(it["question"] for it in items))
    acc1, records1 = E.evaluate(model.double(), tokenizer, items, "countdown",
                                SamplerOptions(gen_length=16, steps=8, block_length=8), batch_size=2,
                                prompt_style="plain")
    assert acc2 == acc1 and records2 == json.loads(json.dumps(records1))


# -----------------------------------------------------------------------------
# The command line streams every graded item and continues where it stopped


def sudoku_checkpoint(tmp_path, n_items, max_sequence_length=None):
    """A tiny random model folder and a Sudoku CSV of n_items puzzles."""
    import embedded
    model, tokenizer = tiny_model_and_tokenizer()
    if max_sequence_length:
        model.config.max_sequence_length = max_sequence_length
    model.save_pretrained(tmp_path / "ckpt")
    tokenizer.save(str(tmp_path / "ckpt" / "tokenizer.json"))
    pairs, _ = embedded.sudoku_split(n_items, 0, n_blanks=6, seed=3)
    (tmp_path / "sudoku.csv").write_text("Puzzle,Solution\n" + "".join(f"{p},{s}\n" for p, s in pairs))
    return ["--model", str(tmp_path / "ckpt"), "--task", "sudoku", "--data", str(tmp_path / "sudoku.csv"),
            "--prompt-style", "plain", "--gen-length", "24", "--steps", "12", "--block-length", "8"]


def record_lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("temperature", ["0", "0.8"])
def test_kill_9_mid_eval_then_rerun_equals_an_uninterrupted_run(tmp_path, temperature):
    import signal
    import subprocess
    import sys
    import time
    from conftest import REPO
    argv = sudoku_checkpoint(tmp_path, 48) + ["--batch-size", "2", "--seeds", "0", "1", "--temperature",
                                                temperature]
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(REPO / "eval.py")] + argv
    straight = subprocess.run(cmd + ["--out", str(tmp_path / "straight.json")], env=env, capture_output=True,
                              text=True, timeout=300)
    assert straight.returncode == 0, straight.stderr[-3000:]
    cut = tmp_path / "cut.json"
    proc = subprocess.Popen(cmd + ["--out", str(cut)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and len(cut.with_suffix(".jsonl").read_bytes().splitlines()
                                         if cut.with_suffix(".jsonl").exists() else []) < 10:
        assert proc.poll() is None, "the run ended before it could be killed"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    kept = len(record_lines(cut.with_suffix(".jsonl"))) if cut.with_suffix(".jsonl").exists() else 0
    assert 10 <= kept < 96 and not cut.exists()  # killed mid-run: some items saved, no summary yet
    rerun = subprocess.run(cmd + ["--out", str(cut)], env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    found = int(rerun.stdout.split(" graded items found")[0].rsplit(" ", 1)[1])
    assert found >= kept - 1 and found % 2 == 0  # whole batches kept (a torn last line is dropped)
    a, b = json.loads((tmp_path / "straight.json").read_text()), json.loads(cut.read_text())
    assert a["runs"] == b["runs"] and a["accuracy_mean"] == b["accuracy_mean"]
    lines = record_lines(cut.with_suffix(".jsonl"))
    assert sorted((r["seed"], r["index"]) for r in lines) == [(s, i) for s in (0, 1) for i in range(48)]
    if temperature != "0":  # the noise is drawn: the two seeds differ somewhere
        assert a["runs"][0]["records"] != a["runs"][1]["records"]


def test_random_remasking_is_seeded_per_item_even_when_greedy(tmp_path, one_thread):
    """--remasking random draws its unmasking order at temperature 0 too: from each item's own generator, so two runs
    with one seed agree whatever the global RNG holds and however the items are batched, and two seeds differ (it
    used to draw from torch's global RNG)."""
    argv = sudoku_checkpoint(tmp_path, 6) + ["--remasking", "random", "--seeds", "0", "1"]
    runs = []
    for k, batch in enumerate(("2", "3")):
        torch.manual_seed(100 + k)  # the global RNG differs between the two runs
        E.main(argv + ["--batch-size", batch, "--out", str(tmp_path / f"r{k}.json")])
        runs.append(json.loads((tmp_path / f"r{k}.json").read_text())["runs"])
    generations = [[[r["generation"] for r in run["records"]] for run in rs] for rs in runs]
    assert generations[0] == generations[1]
    assert generations[0][0] != generations[0][1]  # seed 0 against seed 1


def test_a_rerun_with_other_settings_is_refused_naming_them(tmp_path, one_thread):
    argv = sudoku_checkpoint(tmp_path, 4) + ["--out", str(tmp_path / "r.json")]
    E.main(argv + ["--batch-size", "2"])
    before = (tmp_path / "r.jsonl").read_text()
    with pytest.raises(SystemExit, match="batch_size 2 in the file, 3 now"):
        E.main(argv + ["--batch-size", "3"])
    with pytest.raises(SystemExit, match="cache None in the file, 'dual' now"):
        E.main(argv + ["--batch-size", "2", "--cache", "dual"])
    csv_path = tmp_path / "sudoku.csv"
    original = csv_path.read_text()
    csv_path.write_text(original.replace("Puzzle,Solution\n", "Puzzle,Solution\n" + original.splitlines()[2] + "\n"))
    with pytest.raises(SystemExit, match="data_sha256"):  # the test file changed under the same name
        E.main(argv + ["--batch-size", "2"])
    csv_path.write_text(original)
    assert (tmp_path / "r.jsonl").read_text() == before
    E.main(argv + ["--batch-size", "2"])  # the same settings: nothing to generate, the same file
    assert (tmp_path / "r.jsonl").read_text() == before


def test_records_stream_batch_by_batch_with_their_settings(tmp_path, one_thread, capsys):
    argv = sudoku_checkpoint(tmp_path, 5) + ["--batch-size", "2", "--out", str(tmp_path / "r.json"),
                                             "--cache", "dual", "--threshold", "0.5"]
    seen = []
    real = E.append_records

    def spy(path, records, settings):
        seen.append([r["index"] for r in records])
        real(path, records, settings)
    E.append_records = spy
    try:
        E.main(argv)
    finally:
        E.append_records = real
    assert seen == [[0, 1], [2, 3], [4]]
    lines = record_lines(tmp_path / "r.jsonl")
    assert [r["index"] for r in lines] == [0, 1, 2, 3, 4]
    assert all(r["settings"]["cache"] == "dual" and r["settings"]["threshold"] == 0.5 for r in lines)
    assert {"index", "seed", "question", "generation", "correct_cells"} <= set(lines[0])
    out = capsys.readouterr().out
    assert "5/5 items" in out and "tokens/s" in out and "accuracy so far" in out and "ETA" in out


BAD_EVAL_FLAGS = [
    (["--limit", "0"], "--limit 0: must be at least 1"),
    (["--batch-size", "0"], "--batch-size 0: must be at least 1"),
    (["--gen-length", "0"], "--gen-length 0: must be at least 1"),
    (["--steps", "-2"], "--steps -2: must be at least 1"),
    (["--threshold", "1"], "--threshold 1.0: a confidence in [0, 1)"),
    (["--cache", "full"], "invalid choice: 'full'"),
]


@pytest.mark.parametrize("flags,message", BAD_EVAL_FLAGS, ids=[" ".join(f) for f, _ in BAD_EVAL_FLAGS])
def test_bad_eval_flags_are_refused_before_the_model_loads(flags, message, capsys):
    with pytest.raises(SystemExit):
        E.main(["--model", "no-such-folder", "--task", "sudoku", "--data", "x.csv", *flags])
    assert message in capsys.readouterr().err


def test_the_sampler_flags_are_declared_once():
    """sample.py's and eval.py's command lines take the same sampler flags, each made from one SamplerOptions field:
    the same name, type, choices, default and help, in the dataclass's order."""
    from dataclasses import fields
    names = [f.name for f in fields(SamplerOptions)]

    def sampler_flags(parser):
        return {a.dest: (a.option_strings, a.type, a.choices, a.default, a.help) for a in parser._actions
                if a.dest in names}
    eval_flags, sample_flags = sampler_flags(E.make_parser()), sampler_flags(sample.make_parser())
    assert list(eval_flags) == list(sample_flags) == names and eval_flags == sample_flags
    assert {"gen_length", "steps", "block_length", "temperature", "cache", "threshold", "cache_refresh",
            "cache_drift", "sampler", "alg", "alg_temp", "eps", "top_p", "top_k"} <= set(names)
    assert eval_flags["cache"][0] == ["--cache"] and eval_flags["cache"][2] == ("none", "prefix", "dual")
    assert all(help_ for *_, help_ in eval_flags.values())


BAD_SAMPLER_FLAGS = [
    (["--threshold", "1"], "--threshold 1.0: a confidence in [0, 1)"),
    (["--cache-refresh", "2"], "--cache-refresh 2: a number of steps >= 1, with --cache prefix or dual"),
    (["--cache", "dual", "--cache-drift", "0"], "--cache-drift 0.0: a cosine similarity in (0, 1], with --cache"),
    (["--block-length", "0"], "--block-length 0: must be at least 1"),
    (["--temperature", "-1"], "--temperature -1.0: must be 0 (greedy) or more"),
    (["--cfg-scale", "-1"], "--cfg-scale -1.0: must be 0 (off) or more"),
    (["--remasking", "high"], "invalid choice: 'high'"),
    (["--sampler", "fast"], "invalid choice: 'fast'"),
    (["--alg", "greedy"], "invalid choice: 'greedy'"),
    (["--alg-temp", "-1"], "--alg-temp -1.0: must be 0 (off) or more"),
    (["--eps", "1"], "--eps 1.0: the reverse process's last time, in (0, 1)"),
    (["--top-p", "1.5"], "--top-p 1.5: a probability in (0, 1]"),
    (["--top-k", "0"], "--top-k 0: must be at least 1"),
]


@pytest.mark.parametrize("flags,message", BAD_SAMPLER_FLAGS, ids=[" ".join(f) for f, _ in BAD_SAMPLER_FLAGS])
def test_a_bad_sampler_flag_is_refused_in_one_line_by_both_command_lines(flags, message, capsys):
    """One check (sample.check_sampler_options) for both command lines: the same one-line error, before the model
    folder is even looked for (it does not exist here)."""
    errors = []
    for main, argv in ((E.main, ["--model", "no-such-folder", "--task", "sudoku", "--data", "x.csv"]),
                       (sample.main, ["--model", "no-such-folder", "--prompt", "hi"])):
        with pytest.raises(SystemExit) as exit_:
            main(argv + flags)
        assert exit_.value.code == 2  # argparse's usage error
        lines = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
        assert len(lines) == 1 and message in lines[0], lines
        errors.append(lines[0].split("error: ", 1)[1])
    assert errors[0] == errors[1]


def test_out_is_checked_before_the_model_loads(tmp_path, capsys):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("not read before --out is checked")
    for out, message in ((tmp_path, "name the summary .json file"), (tmp_path / "r.jsonl", "name the summary"),
                         (tmp_path / "file" / "r.json", "cannot write")):
        (tmp_path / "file").write_text("a file, not a folder")
        with pytest.raises(SystemExit):
            E.main(["--model", str(tmp_path / "model"), "--task", "sudoku", "--data", "x.csv", "--out", str(out)])
        assert message in capsys.readouterr().err


def test_a_full_disk_names_the_file():
    with pytest.raises(OSError, match="cannot write /dev/full"):
        longjob.append_records(__import__("pathlib").Path("/dev/full"), [dict(index=0)], {})


def test_a_prompt_longer_than_the_context_is_refused(tmp_path, one_thread):
    argv = sudoku_checkpoint(tmp_path, 2, max_sequence_length=64)
    with pytest.raises(ValueError, match="item 0: its prompt of .* tokens \\+ --gen-length 24 exceed the model's "
                                         "max_sequence_length 64"):
        E.main(argv)

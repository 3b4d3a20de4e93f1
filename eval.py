"""Evaluate a LLaDA or Dream checkpoint on Sudoku, Countdown, GSM8K and MATH500 with the d1 / wd1 protocol, so that
numbers are comparable with the GIFT paper's tables (which take their baselines from d1, Zhao et al. 2025).

Protocol (d1's eval/*.py): one user turn = instruction + "\\n\\n" + question, LLaDA's chat template, then the literal
text "<reasoning>" after the assistant header; greedy block diffusion sampling (block 32, steps = gen_length / 2,
low-confidence remasking); d1's answer extraction and grading rules, quirks included (listed above the graders). A
Dream model gets the same protocol (Appendix C) in its chat format, ChatML; --sampler dream: Dream's own sampler.

    torchrun --nproc_per_node 8 eval.py --model DIR [--adapter DIR] --task gsm8k --data gsm8k_test.jsonl \\
        [--shots 5 --shot-data gsm8k_train.jsonl] [--seeds 0 1 2] [--out results.json]
    python eval.py --model DIR --task sudoku --data sudoku_4x4_test.csv --prompt-style plain   # one process
    python harness.py --model DIR --tasks arc_easy,gsm8k   # lm-evaluation-harness's tasks: harness.py (GiftLM, "gift")
"""

import argparse
import ast
import csv
import hashlib
import io
import itertools
import json
import math
import operator
import os
import random
import re
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, fields

import numpy as np
import torch

from cached_sample import generate_with_options
from data import (EOT, IM_END, SUDOKU_TASK_PROMPT, BadRow, chat_format, chat_prompt, check_chat_tokens,
                  check_mask_token, data_text, encode, file_lines, json_object, load_tokenizer, mask_in_text,
                  mixed_seed, read_data_file, special_text, unencodable_characters)
from longjob import (SEED_RULE, SEEDS, adapter_fingerprint, add_dtype_flag, add_model_flags, append_records,
                     broadcast_object, check_summary, compute_dtype, end_distributed, folder_fingerprint,
                     gather_objects, hms, load_weights, open_output, rank_and_world, read_records,
                     run_command_line, seconds_left, setup_distributed)
from model import GENERATION_DEFAULTS, atomic_write_text, read_config, unwrap
from sample import (BLOCK_ONLY, DREAM_ONLY, SamplerOptions, add_sampler_flags, check_step_count, left_padded,
                    options_from_flags, resolve_model, stop_ids, turn_end_id, with_lengths)

# -----------------------------------------------------------------------------
# Protocol constants (d1, github.com/dllm-reasoning/d1, eval/{gsm8k,math500,countdown,sudoku}.py, commit 837888f).
# They must equal d1's prompts character for character (tests/data/d1_prompts.json; a test checks). Stray spaces,
# the missing space before "Respond" in the Countdown prompt and the MATH500 prompt's trailing '" \n' are d1's own.

GSM_SYSTEM_PROMPT = (
    "You are a math expert. You will be given a question to solve. Solve it step by step. Wrap the final answer "
    "in a \\boxed{}. \nRespond in the following format:\n<reasoning>\nYour reasoning here\n</reasoning>\n"
    "<answer>\n\\boxed{...}\n</answer>")
MATH500_SYSTEM_PROMPT = (
    "You are a math expert. You will be given a question to solve. Solve it step by step. Wrap the final answer "
    "in a \\boxed{}.\nRespond in the following format:\n<reasoning>\nYour reasoning here\n</reasoning>\n"
    "<answer>\n\\boxed{...}\n</answer>\" \n")
CTD_SYSTEM_PROMPT = (
    "Using only the provided numbers, create an arithmetic expression that evaluates to exactly the provided target "
    "number. You may use the operations +, -, *, and / as needed, but each number must be used exactly once. Think "
    "step-by-step. After reasoning, provide only your final expression inside \\boxed{} tags without including an "
    "equals sign or the target number. For example: \\boxed{a + b * c}Respond in the following format:\n"
    "<reasoning>\nYour reasoning here\n</reasoning>\n<answer>\n\\boxed{...}\n</answer>")
SUDOKU_SYSTEM_PROMPT = (
    "\nPlease solve the following 4x4 Sudoku puzzle. The puzzle is provided as a 16-character string reading "
    "left-to-right, top-to-bottom, where '0' represents empty cells.\n\nRules:\n- Fill empty cells with digits 1-4\n"
    "- Each row must contain digits 1-4 exactly once\n- Each column must contain digits 1-4 exactly once\n"
    "- Each 2x2 box must contain digits 1-4 exactly once\n\nImportant: Your solution must be a COMPLETE 16-character "
    "string with only the digits 1-4, representing your final solved grid.\n\nRespond in this exact format:\n"
    "<reasoning>\nYour step-by-step solving process\n</reasoning>\n<answer>\n"
    "[16-character solution string with no spaces or separators]\n</answer>\n")

TASKS = ("sudoku", "countdown", "gsm8k", "math500")
INSTRUCTIONS = dict(gsm8k=GSM_SYSTEM_PROMPT, math500=MATH500_SYSTEM_PROMPT, countdown=CTD_SYSTEM_PROMPT,
                    sudoku=SUDOKU_SYSTEM_PROMPT)
# question templates; GSM8K and MATH500 use the problem text as is. Countdown's numbers print as a Python list.
COUNTDOWN_QUESTION = "Numbers: {numbers}\nTarget: {target}"
SUDOKU_QUESTION = SUDOKU_TASK_PROMPT + "\n"  # the "\n" is d1's; the chat template strips it
ASSISTANT_PREFIX = "<reasoning>"  # d1 appends it after the assistant header: the model continues its reasoning

GEN_LENGTH = dict(sudoku=512, countdown=512, gsm8k=256, math500=256)  # d1's defaults (the paper's tables)
BLOCK_LENGTH = 32  # steps default to gen_length // 2 (two tokens unmasked per step)
PROMPT_STYLES = ("d1", "plain")  # plain: the question alone, nothing after the assistant header (embedded task)

# -----------------------------------------------------------------------------
# Benchmark loaders. Each item is a dict with "question" (the text after the instruction) and the gold fields the
# grader needs; GSM8K / MATH500 items also carry the worked solution ("reasoning") for few-shot examples.

def _jsonl_rows(path, raw=None, **strings):
    """(where: "PATH, line N", object) per non-blank line; a bad line (not a JSON object, a field of `strings`
    {key: hint for the error} missing or not a string) raises naming it."""
    for line_no, line, _ in file_lines(io.BytesIO(read_data_file(path) if raw is None else raw), None):
        if not line.strip():
            continue
        try:  # each line read as training reads it: one JSON object (data.json_object)
            row = json_object(path, line_no, line)
        except BadRow as e:
            raise ValueError(f"{path}, line {line_no}: {e.problem}") from None
        for key, hint in strings.items():
            if not isinstance(row.get(key), str):
                raise ValueError(f"{path}, line {line_no}: field {key!r} missing or not a string{hint}")
        yield f"{path}, line {line_no}", row


def parse_gsm8k_gold(answer):
    """The number after "####" (commas removed, its sign kept, unlike d1's: see the graders' notes), else None."""
    m = re.search(r"####\s*\$?(-?[\d,]+(?:\.\d+)?)", answer)
    return float(m.group(1).replace(",", "")) if m else None


def load_gsm8k(path, raw=None):
    """GSM8K JSONL rows {"question", "answer": "...worked solution...\\n#### 18"}."""
    items = []
    for where, row in _jsonl_rows(path, raw, question="",
                                  answer=" (GSM8K's worked solution ending in '#### <number>')"):
        gold = parse_gsm8k_gold(row["answer"])
        if gold is None:
            raise ValueError(f"{where}: field 'answer' has no '#### <number>' final answer")
        reasoning = re.sub(r"<<[^>]*>>", "", row["answer"].split("####")[0]).strip()  # drop the calculator annotations
        items.append(dict(question=row["question"], gold=gold, reasoning=reasoning,
                          answer_text=row["answer"].split("####")[1].strip()))  # as written: d1's RL reward reads it
    return items


def load_math500(path, raw=None):
    """MATH500 JSONL rows {"problem", "answer", "solution", ...} (OpenAI's prm800k test split)."""
    return [dict(question=row["problem"], gold=row["answer"],
                 reasoning=row["solution"] if isinstance(row.get("solution"), str) else "")
            for _, row in _jsonl_rows(path, raw, problem="", answer=" (the final answer in LaTeX)")]


def load_countdown(path, raw=None):
    """Countdown JSONL rows {"input": "30,100,93", "output": "23"}."""
    items = []
    for where, row in _jsonl_rows(path, raw, input=" (comma-separated integers, e.g. \"30,100,93\")",
                                  output=" (the target integer as a string, e.g. \"23\")"):
        try:
            numbers, target = [int(n) for n in row["input"].split(",")], int(row["output"])
        except ValueError:
            raise ValueError(f"{where}: 'input' {row['input']!r} / 'output' {row['output']!r} are not comma-separated "
                             "integers / an integer") from None
        items.append(dict(question=COUNTDOWN_QUESTION.format(numbers=numbers, target=target),
                          numbers=numbers, target=target))
    return items


def sudoku_subset(n_rows, k=256, seed=42):
    """d1's evaluation subset, 256 of the 500 test puzzles in this order: np.random.seed(42); np.random.choice(n, 256,
    replace=False) (legacy RandomState). For d1's file it starts 361, 73, 374, 155, ...; fewer rows are shuffled."""
    return np.random.RandomState(seed).choice(n_rows, min(k, n_rows), replace=False).tolist()


def load_sudoku(path, subset=True, raw=None):
    """Sudoku CSV with header Puzzle,Solution, 16 digits each (0 = blank); subset: d1's 256 puzzles (sudoku_subset)."""
    rows = []
    with io.StringIO(data_text(path, read_data_file(path) if raw is None else raw), newline="") as f:
        reader = csv.DictReader(f)
        if not reader.fieldnames or not {"Puzzle", "Solution"} <= set(reader.fieldnames):
            raise ValueError(f"{path}, line 1: expected a header with columns Puzzle,Solution, got {reader.fieldnames}")
        for row in reader:
            puzzle, solution = (row["Puzzle"] or "").strip(), (row["Solution"] or "").strip()
            if not re.fullmatch(r"[0-4]{16}", puzzle) or not re.fullmatch(r"[1-4]{16}", solution):
                raise ValueError(f"{path}, line {reader.line_num}: Puzzle {puzzle!r} / Solution {solution!r} must be "
                                 "16 digits (0-4 / 1-4); read the CSV as text so leading zeros are kept")
            rows.append(dict(question=SUDOKU_QUESTION.format(puzzle=puzzle), puzzle=puzzle, solution=solution))
    if subset:
        rows = [rows[i] for i in sudoku_subset(len(rows))]
    return rows


def load_benchmark(task, path, raw=None):
    """The items of a test (or shot) file: `raw` its bytes when already read (load_data hashes what it read)."""
    loaders = dict(gsm8k=load_gsm8k, math500=load_math500, countdown=load_countdown, sudoku=load_sudoku)
    if task not in loaders:
        raise ValueError(f"unknown task {task!r}; choose one of {TASKS}")
    items = loaders[task](path, raw=raw)
    if not items:
        raise ValueError(f"{path}: no items found")
    return items


# -----------------------------------------------------------------------------
# Prompts: d1's (the module docstring), or plain: the question alone (the embedded tiny-model Sudoku task, trained on
# "<answer>{16 digits}</answer>"). Few-shot (the paper's 5-shot appendix; d1's few-shot code was broken): K solved
# examples (shot_response) in the same user turn, between the instruction and the question.

def solve_countdown(numbers, target):
    """An expression using each number once with + - * / that reaches target (within 1e-5), or None."""
    def search(terms):  # terms: [(value, text)]; combine two at a time until one is left
        if len(terms) == 1:
            return terms[0][1] if abs(terms[0][0] - target) < 1e-5 else None
        for i, j in itertools.permutations(range(len(terms)), 2):
            (a, ta), (b, tb) = terms[i], terms[j]
            rest = [t for k, t in enumerate(terms) if k not in (i, j)]
            for value, op in [(a + b, "+"), (a - b, "-"), (a * b, "*")] + ([(a / b, "/")] if b != 0 else []):
                found = search(rest + [(value, f"({ta} {op} {tb})")])
                if found:
                    return found
        return None

    found = search([(n, str(n)) for n in numbers])
    return found[1:-1] if found and len(numbers) > 1 else found  # drop the outermost parentheses


def shot_response(task, item, style="d1"):
    """A solved example's answer in the instruction's format: its reasoning (the worked solution, else a one-line
    check) and "\\boxed{gold}" (Countdown: an expression found by brute force; Sudoku: the bare solution)."""
    if task in ("gsm8k", "math500"):
        gold = item["gold"]  # GSM8K's a number: 18.0 is written 18
        gold = str(int(gold)) if task == "gsm8k" and float(gold).is_integer() else str(gold)
        final, reasoning = "\\boxed{" + gold + "}", item.get("reasoning", "")
    elif task == "countdown":
        expression = solve_countdown(item["numbers"], item["target"])
        if expression is None:
            raise ValueError(f"few-shot example {item['question']!r} has no solution; use another shot file")
        final, reasoning = "\\boxed{" + expression + "}", f"{expression} = {item['target']}"
    elif task == "sudoku":
        final, reasoning = item["solution"], f"The completed grid is {item['solution']}."
    else:
        raise ValueError(f"unknown task {task!r}; choose one of {TASKS}")
    if style == "plain":
        return f"<answer>{final}</answer>"
    return f"<reasoning>\n{reasoning.strip()}\n</reasoning>\n<answer>\n{final}\n</answer>"


def build_prompt(task, item, style="d1", shots=(), fmt="llada"):
    """The prompt text for one item (see above); shots: solved items; fmt: "llada" or "chatml" (data.chat_format)."""
    if style not in PROMPT_STYLES:
        raise ValueError(f"unknown prompt style {style!r}; choose one of {PROMPT_STYLES}")
    user = "".join(f"Example question:\n{s['question'].strip()}\nExample response:\n{shot_response(task, s, style)}\n\n"
                   for s in shots)
    user += ("Question:\n" if shots else "") + item["question"]
    if style == "d1":
        return chat_prompt([{"role": "user", "content": INSTRUCTIONS[task] + "\n\n" + user}], fmt) + ASSISTANT_PREFIX
    return chat_prompt([{"role": "user", "content": user}], fmt)


def pick_shots(shot_items, k, seed):
    """K solved examples drawn with `seed`, so several seeds also average over the choice of examples."""
    if k > len(shot_items):
        raise ValueError(f"--shots {k} but the shot file has only {len(shot_items)} items")
    return random.Random(seed).sample(shot_items, k) if k else []


# -----------------------------------------------------------------------------
# Graders: d1's rules (eval/parse_and_get_acc.py and the Hendrycks MATH helpers it uses), exactly: they give d1's
# published LLaDA-8B-Instruct numbers on d1's stored generations (tests/test_eval.py). Its quirks, kept on purpose:
#   GSM8K  - only \boxed{...} up to the FIRST "}" is seen (r"\\boxed{(.*?)}", no DOTALL): "\boxed{\frac{1}{2}}"
#            reads "\frac{1" and so the number 1; a box spanning lines is not seen at all.
#          - the FIRST box that yields a number wins (not the last, the final answer); empty, "..." or dots skipped.
#          - inside a box: float(content) (Python's float: "1_000", "inf", "nan" parse), else the FIRST -?\d+\.?\d*
#            match: "\boxed{18 dollars}" is 18, "\boxed{x = 5, y = 3}" 5, "\boxed{1,000}" 1 (the comma stops it).
#          - no box number: the first <answer>...</answer> (across lines), stripped: float, else its LAST number.
#          - a DIFFERENCE: d1's gold from "####" loses its sign (its regex has no "-"), so the two negative golds
#            (-10, -3) are always wrong there; parse_gsm8k_gold keeps it. On d1's stored generations LLaDA-8B-Instruct
#            answers them right (2, 2, 1 of 2 at gen length 128/256/512): 69.5/76.5/78.2 here, 69.3/76.4/78.1 in d1.
#   MATH   - last_boxed_only_string: if "\boxed " (with a space) occurs anywhere, the text after its last occurrence
#            up to the next "$" is the answer, even if a later "\boxed{...}" exists; otherwise the last "\boxed" (else
#            "\fbox"), braces counted from there. No box: the WHOLE generation is the candidate (it almost never
#            matches); unclosed braces or an empty candidate: the first <answer>...</answer> content. A "\fbox{...}"
#            is kept whole (only a "\boxed{" prefix is removed; d1's generations have none: unverified).
#          - equivalence is Hendrycks' strip_string string equality (no symbolic math): "0.5" == "\frac{1}{2}" but
#            "1/2" == "\frac{1}{2}" only as a whole; when any step raises (two "\text{ ", "\sqrt" or "\frac" at the
#            very end, non-integer "a/b"), the RAW strings are compared instead.
#   Countdown - the MATH candidate (whole text when there is no box; <answer> content, else the whole text, only
#            when the braces never close; an empty box is NOT replaced); "\div", "\times", "\cdot" become / * *; if
#            `[0-9+\-*/() ]+=[0-9. ]+` matches, only that run before the first "=" is kept ("x = 3 + 4 = 7": "3 + 4").
#          - valid iff its sorted integers (\d+, so "2.5" counts as 2 and 5) are the sorted given numbers and its
#            value as Python arithmetic (only digits, + - * / ( ) . and white space: "**" a power, "//" floor
#            division, "07" a syntax error, leading spaces and tabs ignored) the target. d1 calls eval(); we walk the
#            ast instead (eval_arithmetic), a power above 2**100000 bits an error (never the target).
#   Sudoku - the first NON-EMPTY (after strip) capture of SUDOKU_PATTERNS in order, all DOTALL, white space removed,
#            padded with "0" or cut to 16 characters: a too-long or shifted answer is scored cell by cell as is.

ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
NUMBER = re.compile(r"-?\d+\.?\d*")


def _number(text, which):
    """float(text), else its first (which=0) or last (which=-1) NUMBER, else None."""
    try:
        return float(text)
    except ValueError:
        found = NUMBER.findall(text)
        return float(found[which]) if found else None


def grade_gsm8k(generation, gold):
    """d1's GSM8K rule: the first box holding a number, else the <answer> tag; correct iff the float equals gold."""
    pred = None
    for box in re.findall(r"\\boxed{(.*?)}", generation):
        box = box.strip()
        if box and not re.match(r"^\.+$", box):  # empty, "..." or only dots: skipped
            pred = _number(box, 0)
            if pred is not None:
                break
    if pred is None:
        m = ANSWER_TAG.search(generation)
        text = m.group(1).strip() if m else ""
        pred = _number(text, -1) if text else None
    return pred is not None and pred == float(gold)


def last_boxed(text):
    """remove_boxed(last_boxed_only_string(text)) as d1 uses them: the last box's content, the whole text when
    there is no box, None when the braces never close."""
    if "\\boxed " in text:
        return text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
    if start < 0:
        return text
    depth = 0
    for i in range(start, len(text)):  # count braces from the box on; the first return to depth 0 closes it
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                box = text[start:i + 1]
                return box[len("\\boxed{"):-1] if box.startswith("\\boxed{") else box
    return None


# Hendrycks et al.'s MATH normalisation (github.com/hendrycks/math, math_equivalence.py), step by step; a step that
# raises makes math_equiv compare the raw strings.

def _fix_fracs(string):
    """\\frac12 -> \\frac{1}{2}, \\frac1b -> \\frac{1}{b}, \\frac1{72} -> \\frac{1}{72}."""
    parts = string.split("\\frac")
    new = parts[0]
    for part in parts[1:]:
        new += "\\frac"
        if part[0] == "{":  # IndexError when "\frac" ends the string: the step fails
            new += part
        elif len(part) < 2:
            return string  # Hendrycks: a one-character remainder leaves the whole string unchanged
        elif part[1] != "{":
            new += "{" + part[0] + "}{" + part[1] + "}" + part[2:]
        else:
            new += "{" + part[0] + "}" + part[1:]
    return new


def _fix_a_slash_b(string):
    """"a/b" with integers a, b written plainly -> \\frac{a}{b}; int() of a non-integer raises: the step fails."""
    parts = string.split("/")
    if len(parts) != 2:
        return string
    a, b = int(parts[0]), int(parts[1])  # ValueError propagates, as in Hendrycks (only AssertionError is caught there)
    return f"\\frac{{{a}}}{{{b}}}" if string == f"{a}/{b}" else string


def _remove_right_units(string):
    """Keep what precedes "\\text{ " (units); more than one occurrence fails (Hendrycks asserts there is one)."""
    parts = string.split("\\text{ ")
    if len(parts) > 2:
        raise ValueError("more than one '\\text{ '")
    return parts[0]


def _fix_sqrt(string):
    """\\sqrt3 -> \\sqrt{3}; "\\sqrt" at the very end raises (IndexError): the step fails."""
    parts = string.split("\\sqrt")
    new = parts[0]
    for part in parts[1:]:
        new += "\\sqrt" + part if part[0] == "{" else "\\sqrt{" + part[0] + "}" + part[1:]
    return new


def strip_string(string):
    """Hendrycks' _strip_string, in its order. May raise (see the helpers)."""
    string = string.replace("\n", "").replace("\\!", "")
    string = string.replace("\\\\", "\\")
    string = string.replace("tfrac", "frac").replace("dfrac", "frac")
    string = string.replace("\\left", "").replace("\\right", "")
    string = string.replace("^{\\circ}", "").replace("^\\circ", "")
    string = string.replace("\\$", "")
    string = _remove_right_units(string)
    string = string.replace("\\%", "")
    string = string.replace(" .", " 0.").replace("{.", "{0.")
    if not string:
        return string
    if string[0] == ".":
        string = "0" + string
    if len(string.split("=")) == 2 and len(string.split("=")[0]) <= 2:
        string = string.split("=")[1]  # "k = 5" -> " 5"
    string = _fix_sqrt(string)
    string = string.replace(" ", "")
    string = _fix_fracs(string)
    if string == "0.5":
        string = "\\frac{1}{2}"
    return _fix_a_slash_b(string)


def math_equiv(a, b):
    """Hendrycks' is_equiv: strip_string equality, or raw equality when a step fails."""
    try:
        return strip_string(a) == strip_string(b)
    except Exception:
        return a == b


def grade_math(generation, gold):
    """d1's MATH500 rule: last box (whole text if none), <answer> content if unclosed or empty, then is_equiv."""
    candidate = last_boxed(generation)
    if not candidate:
        m = ANSWER_TAG.search(generation)
        candidate = m.group(1).strip() if m else candidate
    return candidate is not None and math_equiv(candidate, gold)


_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Pow: operator.pow}
_UNARYOPS = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_POWER_BITS = 100_000


def _arith(node):
    """Evaluate an ast of numbers and + - * / // ** with Python's semantics; anything else raises."""
    if isinstance(node, ast.Expression):
        return _arith(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARYOPS:
        return _UNARYOPS[type(node.op)](_arith(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        a, b = _arith(node.left), _arith(node.right)  # left first, as Python
        if (isinstance(node.op, ast.Pow) and isinstance(a, int) and isinstance(b, int) and abs(a) > 1
                and b * math.log2(abs(a)) > MAX_POWER_BITS):
            raise OverflowError("power too large")  # eval would compute a huge integer (or never finish)
        return _BINOPS[type(node.op)](a, b)
    raise ValueError(f"not arithmetic: {type(node).__name__}")


def eval_arithmetic(expression):
    """The value Python's eval would give an arithmetic expression, without eval; raises on anything else."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. SyntaxWarning for "3(4)"
        tree = ast.parse(expression.lstrip(" \t"), mode="eval")  # eval() drops leading spaces and tabs, so do we
    return _arith(tree)


def grade_countdown(generation, numbers, target):
    """d1's Countdown rule: the boxed expression uses exactly the given numbers and evaluates to the target."""
    equation = last_boxed(generation)
    if equation is None:  # braces never close
        m = ANSWER_TAG.search(generation)
        equation = m.group(1).strip() if m else generation
    equation = equation.replace("\\div", "/").replace("\\times", "*").replace("\\cdot", "*")
    if m := re.search(r"([0-9+\-*/() ]+)=[0-9. ]+", equation):
        equation = m.group(1).strip()
    used = sorted(int(n) for n in re.findall(r"\d+", equation))  # "2.5" counts as 2 and 5
    if used != sorted(numbers) or not re.match(r"^[\d+\-*/().\s]+$", equation):
        return False
    try:
        value = eval_arithmetic(equation)
        return abs(value - target) < 1e-5
    except Exception:  # syntax errors, division by zero, overflow: the value is "infinity", never the target
        return False


SUDOKU_PATTERNS = (
    r"<answer>.*?```\s*([\d\s]+)```",  # a code fence inside the answer
    r"<answer>(.*?)(?:<\|eot_id\|>|<\|endoftext\|>|</answer>)",  # the answer up to its end
    r"</answer>\s*(.*?)(?:<\|eot_id\|>|<\|endoftext\|>|$)",  # text after </answer>
    r".*?(\d{16})\s*</answer>",  # 16 digits just before </answer>
    r"\b(\d{16})\b",  # any standalone 16-digit run
)


def extract_sudoku(generation):
    """d1's Sudoku answer string: first non-empty capture of SUDOKU_PATTERNS, white space removed ("" if none)."""
    for pattern in SUDOKU_PATTERNS:
        if (m := re.search(pattern, generation, re.DOTALL)) and m.group(1).strip():
            return re.sub(r"\s", "", m.group(1).strip())
    return ""


def grade_sudoku(generation, puzzle, solution):
    """(correct cells, empty cells): the puzzle's blanks that the answer (padded with "0" / cut to 16) fills right."""
    empty = [i for i in range(16) if puzzle[i] == "0"]
    answer = extract_sudoku(generation)[:16].ljust(16, "0")  # no answer: all "0", a digit no solution holds
    return sum(answer[i] == solution[i] for i in empty), len(empty)


def grade(task, generation, item):
    """The grade fields of one record: {"correct"} or, for Sudoku, {"correct_cells", "empty_cells"}. d1's rules know
    LLaDA's turn end <|eot_id|>: Dream's <|im_end|> is graded as it (LLaDA's generations never hold it)."""
    generation = generation.replace(IM_END, EOT)
    if task == "gsm8k":
        return dict(correct=grade_gsm8k(generation, item["gold"]))
    if task == "math500":
        return dict(correct=grade_math(generation, item["gold"]))
    if task == "countdown":
        return dict(correct=grade_countdown(generation, item["numbers"], item["target"]))
    if task == "sudoku":
        correct, empty = grade_sudoku(generation, item["puzzle"], item["solution"])
        return dict(correct_cells=correct, empty_cells=empty)
    raise ValueError(f"unknown task {task!r}; choose one of {TASKS}")


def accuracy(task, records):
    """Percent: share of correct answers; for Sudoku, correct cells / empty cells over all puzzles (d1)."""
    if task == "sudoku":
        return 100.0 * sum(r["correct_cells"] for r in records) / max(1, sum(r["empty_cells"] for r in records))
    return 100.0 * sum(r["correct"] for r in records) / max(1, len(records))


# -----------------------------------------------------------------------------
# Generation and grading, one process or torchrun (gift.py's embedded run calls evaluate: embedded.evaluate_embedded)

def item_generator(seed, index, device):
    """Item `index`'s own generator under `seed`: a resumed or re-batched run draws the same noise for it."""
    return torch.Generator(device).manual_seed(mixed_seed(seed, index))


def d1_options(options, gen_length, source=None):
    """The options, d1's protocol where a length is unset: gen_length, blocks of 32, two tokens per step."""
    return with_lengths(options, gen_length, BLOCK_LENGTH, 2, source)


def sample_answers(model, prompts, options, seed, idx, stops=None, stats=None, eot_id=None):
    """The answers (B, gen_length) to the token-id prompts of items idx, sampled with generate_with_options (stops,
    stats, eot_id: its stop_ids, stats, eot_id). The block sampler draws from each item's own generator; Dream's draws
    over the whole batch (origin even when greedy), from its first item's: the same --batch-size draws the same."""
    device = next(model.parameters()).device
    prompt, attention_mask = left_padded(prompts, model.config.pad_token_id)  # (B, P)
    generators = (item_generator(seed, idx[0], device) if options.sampler == "dream" else
                  [item_generator(seed, i, device) for i in idx] if options.draws else None)
    out = generate_with_options(model, prompt.to(device), attention_mask.to(device), options, generators, stops, stats,
                                eot_id)
    return out[:, prompt.shape[1]:]


def encoded_prompts(tokenizer, task, items, prompt_style, shots, gen_length, context):
    """Each item's prompt as token ids; one that leaves no room in the context for gen_length tokens is refused."""
    fmt = chat_format(tokenizer)
    prompts = [encode(tokenizer, build_prompt(task, item, prompt_style, shots, fmt)) for item in items]
    for i, ids in enumerate(prompts):
        if len(ids) + gen_length > context:
            raise ValueError(f"eval.py: item {i}: its prompt of {len(ids)} tokens + --gen-length {gen_length} exceed "
                             f"the model's max_sequence_length {context}; lower --gen-length or --shots")
    return prompts


def graded_records(tokenizer, task, items, idx, answers, seed, done):
    """The records of the items `idx` not graded before (`done`): each answer (B, gen_length) decoded with its special
    tokens, as d1 stores and grades it, the item's gold fields and its grade."""
    new = []
    for r, i in enumerate(idx):
        if i in done:  # a batch partly done before (a rerun with a larger --limit): its old record stays
            continue
        text = tokenizer.decode(answers[r].tolist(), skip_special_tokens=False)
        gold = {key: v for key, v in items[i].items() if key not in ("question", "reasoning")}
        new.append(dict(index=i, seed=seed, question=items[i]["question"], generation=text, **gold,
                        **grade(task, text, items[i])))
    return new


@dataclass
class SeedRun:
    """What the command line adds to an evaluate() call, one per --seeds seed; the defaults are a library call's."""
    seed: int = 0  # each item's sampling noise comes from item_generator(seed, index); recorded with each item
    shots: tuple = ()  # solved examples put before each question (pick_shots)
    done: dict = None  # {index: record} graded before (a resumed run): a batch whose items are all done is skipped
    on_batch: Callable = None  # called on rank 0 with each round's new records, as soon as they exist (streaming)
    log_every: int = 0  # N > 0: a progress line every N rounds and at the last, on rank 0 (tokens/s, accuracy, ETA)
    tokens: dict = None  # evaluate() sets it: the answer tokens generated and those the early exit skipped (all ranks)


@torch.no_grad()
def evaluate(model, tokenizer, items, task, sampler_options=None, batch_size=8, prompt_style="d1", run=None):
    """Generate an answer for every item and grade it: (accuracy in %, records sorted by item) on rank 0, (None, None)
    on the others. sampler_options: a SamplerOptions (None: greedy), its unset lengths d1's; run: a SeedRun (None:
    seed 0, no shots). Fixed batches of batch_size items, the k-th left to do on rank k % world: results do not depend
    on the number of ranks; every rank runs as many (one with none left repeats item 0 and drops it), so a sharded
    model (FSDP) keeps its collectives in step. Under NCCL, each rank calls torch.cuda.set_device(local_rank) first."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {TASKS}")
    options = d1_options(sampler_options or SamplerOptions(), GEN_LENGTH[task])
    if batch_size < 1:
        raise ValueError(f"eval.py evaluate: batch_size {batch_size}: must be at least 1")
    rank, world = rank_and_world()
    module = unwrap(model)  # DDP: call the real module (its forward would sync buffers)
    run = run or SeedRun()
    prompts = encoded_prompts(tokenizer, task, items, prompt_style, run.shots, options.gen_length,
                              module.config.max_sequence_length)
    done = dict(run.done or {})
    batches = [list(range(k, min(len(items), k + batch_size))) for k in range(0, len(items), batch_size)]
    todo = [idx for idx in batches if not all(i in done for i in idx)]
    rounds = math.ceil(len(todo) / world)  # the same on every rank
    was_training = module.training
    module.eval()  # LoRA dropout off
    # the early exit (a row's tokens after its turn end returned as EOS) only when asked for: each of d1's graders
    # reads past the turn end (every pattern of each: tests/test_exit_grades.py), so it could change a grade
    stops = stop_ids(tokenizer) if options.early_exit else None
    records, start, tokens = list(done.values()), time.time(), dict(generated=0, skipped=0)
    eot_id = turn_end_id(tokenizer)  # confidence_eos_eot_inf's EoT
    for round_ in range(rounds):
        idx = todo[round_ * world + rank] if round_ * world + rank < len(todo) else []
        stats = {}  # the early exit's skipped tokens
        answers = sample_answers(module, [prompts[i] for i in idx or [0]], options, run.seed, idx or [0], stops, stats,
                                 eot_id)
        new = graded_records(tokenizer, task, items, idx, answers, run.seed, done)
        parts = gather_objects(new)  # every rank's records of the round (in rank order), which rank 0 streams
        new = [r for part in parts for r in part] if rank == 0 else []
        records += new
        skipped = stats.get("skipped", 0) if idx else 0
        tokens["generated"] += len(idx) * options.gen_length - skipped
        tokens["skipped"] += skipped
        if rank == 0 and run.on_batch and new:
            run.on_batch(new)
        if rank == 0 and run.log_every and ((round_ + 1) % run.log_every == 0 or round_ == rounds - 1):
            elapsed = time.time() - start
            rate, eta = sum(tokens.values()) / max(elapsed, 1e-9), seconds_left(start, round_ + 1, rounds - round_ - 1)
            print(f"  seed {run.seed}: {len(records)}/{len(items)} items, {rate:.0f} answer tokens/s "
                  f"({tokens['generated']} generated, {tokens['skipped']} skipped: the early exit), accuracy so far "
                  f"{accuracy(task, records):.1f}%, ETA {hms(eta)}", flush=True)
    module.train(was_training)
    parts = gather_objects(tokens)  # every rank's counts
    run.tokens = {k: sum(part[k] for part in parts) for k in tokens}
    if rank != 0:
        return None, None
    records.sort(key=lambda r: r["index"])
    return accuracy(task, records), records


# -----------------------------------------------------------------------------
# The command line: streaming, resumable results

def make_parser():
    """eval.py's flags: the model, the benchmark, the sampler's (sample.add_sampler_flags), the output."""
    p = argparse.ArgumentParser(description="Evaluate a LLaDA or Dream checkpoint with the d1 / wd1 protocol "
                                            "(torchrun --nproc_per_node N eval.py ... for several GPUs).")
    add_model_flags(p)
    p.add_argument("--task", required=True, choices=TASKS, help="benchmark (sets the grader and the instruction)")
    p.add_argument("--data", default=None, help="test file: GSM8K / MATH500 / Countdown JSONL or Sudoku CSV (default: "
                   "the test file the model folder's generation_defaults.json names for this task)")
    p.add_argument("--shots", type=int, default=0, help="solved examples put before each question (needs --shot-data)")
    p.add_argument("--shot-data", default=None,
                   help="file in the --data format (a train split, not the test file) to draw the solved examples from")
    p.add_argument("--seeds", type=int, nargs="+", default=[0],
                   help="one run per seed (sampling noise and few-shot choice); mean and std are reported")
    add_sampler_flags(p)  # --gen-length, --steps, --block-length, --temperature, ..., --cache-drift (sample.py's)
    p.add_argument("--batch-size", type=int, default=8, help="prompts per generate() call on each rank")
    add_dtype_flag(p)
    p.add_argument("--limit", type=int, default=None, help="evaluate only the first N items (a quick check)")
    p.add_argument("--prompt-style", choices=PROMPT_STYLES, default=None, help="d1 (the default): instruction + "
                   "question, then '<reasoning>'; plain: the question alone (the embedded task, whose folder says so)")
    p.add_argument("--out", default=None, help="summary JSON file; every graded item streams to the same name with "
                                                ".jsonl as its batch finishes, and rerunning the command continues")
    p.add_argument("--log-every", type=int, default=1, help="batches between progress lines")
    return p


def parse_args(argv=None):
    """(parser, args): the flags checked before anything is read (a one-line error naming the flag), then args.folder,
    .adapter (resolve_model), .data, .prompt_style and .options: a flag, else the folder's generation_defaults.json
    for this task (or for every task when it names none), else d1's protocol."""
    p = make_parser()
    args = p.parse_args(argv)
    for flag, least in (("shots", 0), ("limit", 1), ("batch_size", 1), ("log_every", 1)):
        value = getattr(args, flag)
        if value is not None and value < least:
            p.error(f"--{flag.replace('_', '-')} {value}: must be {'0 (none) or more' if least == 0 else 'at least 1'}")
    if args.shots and not args.shot_data:
        p.error("--shots needs --shot-data (a file to take the solved examples from)")
    try:
        options_from_flags(args)  # the flags' values, checked (SamplerOptions), before the folder is read
        if len(set(args.seeds)) < len(args.seeds):
            raise ValueError(f"--seeds {' '.join(map(str, args.seeds))}: each seed once "
                             "(the std is over distinct runs)")
        if bad := [seed for seed in args.seeds if seed not in SEEDS]:  # an item's noise: mixed_seed(seed, index)
            raise ValueError(f"--seeds {bad[0]}: must be {SEED_RULE}")
        args.folder, args.adapter, defaults, o = resolve_model(args, args.task)  # the folder's task's settings
        if defaults.get("prompt_style") not in (None,) + PROMPT_STYLES:
            raise ValueError(f"{args.folder / GENERATION_DEFAULTS}: field 'prompt_style' = "
                             f"{defaults['prompt_style']!r}: expected one of {PROMPT_STYLES}")
        if args.data is None and not defaults.get("test_data"):
            raise ValueError(f"--data: give the {args.task} test file (the model folder names none for this task)")
        args.data = str(args.folder / defaults["test_data"]) if args.data is None else args.data
        if args.shots and os.path.realpath(args.shot_data) == os.path.realpath(args.data):
            raise ValueError(f"--shot-data {args.shot_data}: it is the --data file; "
                             "draw the examples from another split")
        args.prompt_style = args.prompt_style or defaults.get("prompt_style", "d1")
        args.options = d1_options(o, GEN_LENGTH[args.task], "flags")  # a flag, else the folder's, else d1's
        check_step_count(args.options, given=args.steps is not None)  # the context is load_data's check, after --out
    except (FileNotFoundError, ValueError) as e:
        p.error(str(e))
    return p, args


def seed_free(args):
    """True when the generations cannot depend on the seed: no few-shot draw, and a sampler that draws nothing."""
    return not args.shots and not args.options.draws


def load_data(p, args):
    """The test items (the first --limit), the few-shot pool and the model's tokenizer; every prompt is checked
    readable by the tokenizer, and a missing or malformed file named in one line, before the model loads."""
    flag, path = "--data", args.data
    try:
        raw = read_data_file(args.data)
        args.data_sha256 = hashlib.sha256(raw).hexdigest()[:16]  # of the bytes the items come from (run_settings)
        every = load_benchmark(args.task, args.data, raw)
        items = every[:args.limit]
        flag, path = "--shot-data", args.shot_data
        shot_items = load_benchmark(args.task, args.shot_data) if args.shots else []
        if args.shots > len(shot_items):
            raise ValueError(f"--shots {args.shots} but {args.shot_data} has only {len(shot_items)} items")
        if leak := {i["question"] for i in shot_items} & {i["question"] for i in every}:  # a copy, a link, a subset
            raise ValueError(f"holds {len(leak)} question(s) of the --data file {args.data} (e.g. {min(leak)[:40]!r}): "
                             "the shots must not show the test items; draw them from another split")
        tokenizer = load_tokenizer(args.folder)
        check_chat_tokens(tokenizer, args.folder)
        config = read_config(args.folder)
        check_mask_token(tokenizer, config)  # the ids within the embedding, before the weights load
    except (OSError, ValueError) as e:
        p.error(str(e) if str(path) in str(e) or str(args.folder) in str(e) else f"{flag} {path}: {e}")
    fmt, specials = chat_format(tokenizer), special_text(tokenizer)  # chat-token text: a turn injected in the prompt
    for path, item in [(args.data, i) for i in items] + [(args.shot_data, i) for i in shot_items]:
        if specials and (hit := next(filter(None, map(specials.search, map(str, item.values()))), None)):
            p.error(f"{path}: the item {item['question'][:40]!r}... holds {hit.group()!r}, which the tokenizer reads "
                    "as its chat token (a turn of the prompt), not as text; remove it from the file")
        prompt = build_prompt(args.task, item, args.prompt_style, (), fmt)
        if bad := unencodable_characters(tokenizer, prompt):
            hint = ("; the embedded Sudoku model reads plain prompts (--prompt-style plain)"
                    if args.prompt_style != "plain" else "")
            p.error(f"{path}: a {args.prompt_style} prompt has characters this model's tokenizer cannot encode: "
                    f"{', '.join(map(repr, bad))}{hint}")
        if problem := mask_in_text(tokenizer, prompt):
            p.error(f"{path}: the question {item['question'][:40]!r}... {problem}")
    for seed in args.seeds if args.shots else args.seeds[:1]:  # each seed's shots: every prompt fits the context
        shots = pick_shots(shot_items, args.shots, seed)
        if bad := unencodable_characters(tokenizer, build_prompt(args.task, items[0], args.prompt_style, shots, fmt)):
            p.error(f"--shots {args.shots}: the few-shot prompt has characters this model's tokenizer cannot encode: "
                    f"{', '.join(map(repr, bad))}")
        encoded_prompts(tokenizer, args.task, items, args.prompt_style, shots, args.options.gen_length,
                        config.max_sequence_length)  # a ValueError naming the item, as evaluate() would raise
    return items, shot_items, tokenizer


def run_settings(args, dtype):
    """What the generations depend on, stored with every record: a rerun continues a file only with the same."""
    o, path = args.options, os.path.abspath
    settings = dict(task=args.task, model=path(args.folder), model_fingerprint=folder_fingerprint(args.folder),
                    adapter=args.adapter and path(args.adapter), data=path(args.data), data_sha256=args.data_sha256,
                    batch_size=args.batch_size, shots=args.shots, shot_data=args.shot_data and path(args.shot_data),
                    prompt_style=args.prompt_style, dtype=str(dtype).replace("torch.", "")) | sampler_settings(o)
    if args.adapter:  # another adapter at the same path is told apart
        settings["adapter_fingerprint"] = adapter_fingerprint(args.adapter)
    return settings


SAMPLER_ALWAYS = ("gen_length", "steps", "block_length", "temperature", "cache", "threshold")  # in every record


def sampler_settings(o):
    """The records settings of every SamplerOptions field o's sampler reads (a new one too): SAMPLER_ALWAYS's, Dream's
    own when set, the others when set and not their default (so older records, which lack them, continue)."""
    unread = BLOCK_ONLY if o.sampler == "dream" else DREAM_ONLY
    values = ((f, getattr(o, f.name)) for f in fields(SamplerOptions))  # (field, its value in o)
    return {f.name: v for f, v in values if f.name in SAMPLER_ALWAYS or (
        f.name not in unread and v not in (None, False) and (v != f.default or f.name in DREAM_ONLY))}


def evaluate_seeds(args, model, tokenizer, items, shot_items, finished, on_batch):
    """One evaluate() per --seeds seed, going on from the records `finished`: rank 0's [{seed, accuracy, records}]."""
    o, rank, runs = args.options, rank_and_world()[0], []
    sampler = ("exact" if o.exact else f"cache {o.cache or 'none'}, threshold {o.threshold}, cache refresh "
               f"{o.cache_refresh}, cache drift {o.cache_drift}, cache window {o.cache_window}")
    if o.sampler == "dream":
        sampler = f"Dream's own, alg {o.alg}, alg_temp {o.alg_temp}, eps {o.eps}, top_p {o.top_p}, top_k {o.top_k}"
    for seed in args.seeds:
        if rank == 0:
            print(f"{args.task}: {len(items)} items, seed {seed}, gen_length {o.gen_length}, steps {o.steps}, block "
                  f"{o.block_length}, {args.shots}-shot, {args.prompt_style} prompts, sampler {sampler}", flush=True)
        done = {i: r for (s, i), r in finished.items() if s == seed and i < len(items)}
        run = SeedRun(seed, pick_shots(shot_items, args.shots, seed), done, on_batch, args.log_every)
        acc, records = evaluate(model, tokenizer, items, args.task, o, args.batch_size, args.prompt_style, run)
        if records is not None:  # rank 0
            print(f"seed {seed}: accuracy {acc:.2f}% ({run.tokens['generated']} answer tokens generated, "
                  f"{run.tokens['skipped']} skipped: the early exit)", flush=True)
            runs.append(dict(seed=seed, accuracy=acc,  # the token counts are this invocation's: printed only
                             records=[{k: v for k, v in r.items() if k != "settings"} for r in records]))
    return runs


def report(args, settings, n_items, runs, out, records_path):
    """Rank 0: the accuracy's mean (and sample std) over the seeds, and the summary JSON, written atomically."""
    accs = [r["accuracy"] for r in runs]
    mean, std = statistics.mean(accs), (statistics.stdev(accs) if len(accs) > 1 else 0.0)  # sample std
    print(f"{args.task} accuracy: {mean:.2f}" + (f" +- {std:.2f} (std over {len(accs)} seeds)" if len(accs) > 1
                                                  else "") + " %")
    if out:
        result = dict(settings, accuracy_mean=mean, accuracy_std=std, n_items=n_items, runs=runs)
        atomic_write_text(out, json.dumps(result, indent=1))  # a full disk names the file
        print(f"wrote {out} (every graded item: {records_path})")


def main(argv=None):
    if "--harness" in (sys.argv[1:] if argv is None else argv):  # moved: before any slow work, one line
        raise ValueError("--harness is gone: the lm-evaluation-harness command is `python harness.py ...` (the same "
                         "flags, without --harness)")
    p, args = parse_args(argv)
    if len(args.seeds) > 1 and seed_free(args) and int(os.environ.get("RANK", "0")) == 0:  # they still run
        print(f"eval.py: warning: --seeds {' '.join(map(str, args.seeds))}: greedy decoding with {args.shots} shots "
              "draws nothing from the seed, so every seed repeats the same evaluation and the std over them is 0 by "
              "construction; sample with --temperature > 0, or use --shots, for a spread", flush=True)
    out, records_path, lock = open_output(p, args)  # all checked before the model loads
    try:
        rank, _, device = setup_distributed()  # torchrun's processes; a plain `python eval.py` is one
        dtype = compute_dtype(args.dtype, device)
        items, shot_items, tokenizer = load_data(p, args)
        settings = run_settings(args, dtype)
        finished = read_records(records_path, settings) if rank == 0 else {}  # its records first: named settings
        if out:
            check_summary(out, settings)
        finished = broadcast_object(finished)  # rank 0's, on every rank
        model = load_weights(args.folder, args.adapter, dtype, device, merge=True).eval()  # mask token: load_data's

        def on_batch(new):  # a new records file comes with its first batch, locked: kept open to the end
            if (new_lock := append_records(records_path, new, settings)) is not None:
                lock.callback(new_lock.close)  # beside the run's own (longjob.lock_records)
        runs = evaluate_seeds(args, model, tokenizer, items, shot_items, finished, on_batch if records_path else None)
        if rank == 0:
            report(args, settings, len(items), runs, out, records_path)
        end_distributed()
    except KeyboardInterrupt:  # Ctrl-C: run_command_line says it in one line; the records written stay
        raise KeyboardInterrupt(f"the graded items so far are kept in {records_path}; rerun the same command to "
                                "continue") if records_path else KeyboardInterrupt() from None
    finally:
        if lock is not None:
            lock.close()  # the next eval of this file, in this process too, may start


if __name__ == "__main__":
    run_command_line(main, "eval.py")  # a user's mistake: one line, exit status 1

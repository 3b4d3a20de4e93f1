"""Evaluate a LLaDA or Dream checkpoint on Sudoku, Countdown, GSM8K and MATH500 with the d1 / wd1 protocol, so that
numbers are comparable with the GIFT paper's tables (which take their baselines from d1, Zhao et al. 2025).

Protocol (d1's eval/*.py): one user turn = instruction + "\\n\\n" + question, LLaDA's chat template, then the literal
text "<reasoning>" after the assistant header; greedy block diffusion sampling (block 32, steps = gen_length / 2,
low-confidence remasking); d1's answer extraction and grading rules, quirks included (listed above the graders).
A Dream model gets the same protocol (the paper's Appendix C) in its own chat format, ChatML (the tokenizer says
which); --sampler dream samples with Dream's own diffusion_generate instead.

    torchrun --nproc_per_node 8 eval.py --model DIR [--adapter DIR] --task gsm8k --data gsm8k_test.jsonl \\
        [--shots 5 --shot-data gsm8k_train.jsonl] [--seeds 0 1 2] [--out results.json]
    python eval.py --model DIR --task sudoku --data sudoku_4x4_test.csv --prompt-style plain   # one process
    python eval.py --harness --model DIR --tasks arc_easy,gsm8k   # lm-evaluation-harness's tasks (GiftLM, at the end)
"""

import argparse
import ast
import contextlib
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
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from data import (BOS, EOT, IM_END, SUDOKU_TASK_PROMPT, BadRow, chat_format, chat_prompt, check_chat_tokens,
                  check_mask_token, data_text, encode, encode_text, file_lines, json_object, load_tokenizer,
                  mask_in_text, read_data_file, unencodable_characters)
from longjob import (DTYPES, SEED_RULE, SEEDS, adapter_fingerprint, add_dtype_flag, add_model_flags, append_records,
                     barrier, broadcast_object, check_adapter, check_harness_out, check_summary, compute_dtype,
                     end_distributed, find_model, folder_fingerprint, gather_objects, load_weights, mixed_seed,
                     open_output, rank_and_world, read_records, run_command_line, setup_distributed)
from model import GENERATION_DEFAULTS, LLaDAConfig, atomic_write_text, shift_right, unwrap
from sample import (SamplerOptions, add_sampler_flags, check_sampler_choice, check_step_count, decode_until_stop,
                    folder_defaults, generate, generate_with_options, options_from_flags, stop_ids, with_lengths)

try:  # lm-evaluation-harness, optional: GiftLM (its model "gift") and eval.py --harness need it
    import lm_eval.models  # noqa: F401  the harness's own models, registered first (lazily), stay available
    from lm_eval.api.model import LM
    from lm_eval.api.registry import model_registry
    HARNESS_MISSING = None
except ImportError as e:  # then eval.GiftLM and eval.py --harness say how to install it, in one line
    LM, HARNESS_MISSING = object, (f"lm-evaluation-harness is not installed ({e}); install it with: "
                                   "pip install -r requirements-extras.txt (lm-eval==0.4.13)")

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

def _file_text(path, raw=None):
    """The data file's text, from raw (its bytes, as load_data read them) or read now, through data.py's checks."""
    return data_text(path, read_data_file(path) if raw is None else raw)


def _jsonl_rows(path, raw=None, **strings):
    """(where, object) per non-blank line, `where` ("PATH, line N") starting an error about it; a bad line (not JSON,
    not an object, a field of `strings` {key: hint for the error} missing or not a string, ...) raises naming it."""
    raw = read_data_file(path) if raw is None else raw
    for line_no, line, _ in file_lines(io.BytesIO(raw), None):
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
        items.append(dict(question=row["question"], gold=gold, reasoning=reasoning))
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
    """Sudoku CSV with header Puzzle,Solution: 16-character strings read as text (leading zeros matter), 0 = blank;
    subset=True keeps d1's 256 puzzles in d1's order (sudoku_subset)."""
    rows = []
    with io.StringIO(_file_text(path, raw), newline="") as f:
        reader = csv.DictReader(f)
        if not reader.fieldnames or not {"Puzzle", "Solution"} <= set(reader.fieldnames):
            raise ValueError(f"{path}, line 1: expected a header with columns Puzzle,Solution, got {reader.fieldnames}")
        for row in reader:
            line_no = reader.line_num
            puzzle, solution = (row["Puzzle"] or "").strip(), (row["Solution"] or "").strip()
            if not re.fullmatch(r"[0-4]{16}", puzzle) or not re.fullmatch(r"[1-4]{16}", solution):
                raise ValueError(f"{path}, line {line_no}: Puzzle {puzzle!r} / Solution {solution!r} must be 16 "
                                 "digits (0-4 / 1-4); read the CSV as text so leading zeros are kept")
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
            options = [(a + b, "+"), (a - b, "-"), (a * b, "*")] + ([(a / b, "/")] if b != 0 else [])
            for value, op in options:
                found = search(rest + [(value, f"({ta} {op} {tb})")])
                if found:
                    return found
        return None

    found = search([(n, str(n)) for n in numbers])
    return found[1:-1] if found and len(numbers) > 1 else found  # drop the outermost parentheses


def shot_response(task, item, style="d1"):
    """A solved example's full answer in the instruction's format: its reasoning (the data's worked solution, else a
    one-line check) and "\\boxed{gold}" (Countdown: an expression found by brute force; Sudoku: the bare solution)."""
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
    """The prompt text for one item (see above); shots: solved items; fmt: data.chat_format(tokenizer), "llada" or
    Dream's "chatml" (d1's "<reasoning>" then follows ChatML's assistant header)."""
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
# Graders: d1's rules (eval/parse_and_get_acc.py and the Hendrycks MATH helpers it uses), reproduced exactly;
# they give d1's published LLaDA-8B-Instruct numbers on d1's stored generations (tests/test_eval.py).
#
# d1 quirks reproduced on purpose:
#   GSM8K  - only \boxed{...} up to the FIRST "}" is seen (r"\\boxed{(.*?)}", no DOTALL): "\boxed{\frac{1}{2}}"
#            reads "\frac{1" and so the number 1; a box spanning lines is not seen at all.
#          - boxes are tried in order, the FIRST that yields a number wins (not the last, the final answer);
#            contents that are empty, "..." or only dots are skipped.
#          - inside a box: float(content) (Python's float: "1_000", "inf", "nan" parse), else the FIRST
#            -?\d+\.?\d* match; so "\boxed{18 dollars}" is 18 but "\boxed{x = 5, y = 3}" is 5 and
#            "\boxed{1,000}" is 1 (the comma stops the number).
#          - no box number: the first <answer>...</answer> (across lines), stripped: float, else its LAST number.
#          - a DIFFERENCE: d1's gold from "####" loses its sign (its regex has no "-"), so the two negative golds
#            (-10, -3) are always wrong there; parse_gsm8k_gold keeps it. On d1's stored generations LLaDA-8B-Instruct
#            answers them right (2, 2, 1 of 2 at gen length 128/256/512): 69.5/76.5/78.2 here, 69.3/76.4/78.1 in d1.
#   MATH   - last_boxed_only_string: if "\boxed " (with a space) occurs anywhere, the text after its last
#            occurrence up to the next "$" is the answer, even if a later "\boxed{...}" exists.
#          - otherwise the last "\boxed" (else last "\fbox") with braces counted from there; no box at all means the
#            WHOLE generation is the candidate (so it almost never matches); unclosed braces or an empty candidate
#            fall back to the first <answer>...</answer> content. A "\fbox{...}" span is kept whole (only a
#            "\boxed{" prefix is removed); d1's stored generations have no \fbox, so this case is unverified.
#          - equivalence is Hendrycks' strip_string string equality (no symbolic math): "0.5" == "\frac{1}{2}" but
#            "1/2" == "\frac{1}{2}" only as a whole; when any step raises (two "\text{ ", "\sqrt" or "\frac" at the
#            very end, non-integer "a/b"), the RAW strings are compared instead.
#   Countdown - the expression is the MATH candidate (whole text when there is no box; <answer> content, else the
#            whole text, only when the braces never close; an empty box is NOT replaced).
#          - "\div", "\times", "\cdot" become / * *; if `[0-9+\-*/() ]+=[0-9. ]+` matches, only the run of those
#            characters just before the first such "=" is kept ("x = 3 + 4 = 7" -> "3 + 4").
#          - valid iff the sorted integers in it (\d+, so "2.5" counts as 2 and 5) equal the sorted given numbers.
#          - evaluated as Python arithmetic would (only digits, + - * / ( ) . and white space allowed): "**" is a
#            power, "//" floor division, "07" a syntax error, leading spaces and tabs ignored. d1 calls eval(); we
#            walk the ast instead (eval_arithmetic), a power above 2**100000 bits an error (never the target).
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
    if len(string.split("/")) != 2:
        return string
    a, b = string.split("/")
    a, b = int(a), int(b)  # ValueError propagates, as in Hendrycks (only AssertionError is caught there)
    return f"\\frac{{{a}}}{{{b}}}" if string == f"{a}/{b}" else string


def _remove_right_units(string):
    """Keep what precedes "\\text{ " (units); more than one occurrence fails (Hendrycks asserts there is one)."""
    if "\\text{ " not in string:
        return string
    parts = string.split("\\text{ ")
    if len(parts) != 2:
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
    m = re.search(r"([0-9+\-*/() ]+)=[0-9. ]+", equation)
    if m:
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
        m = re.search(pattern, generation, re.DOTALL)
        if m and m.group(1).strip():
            return re.sub(r"\s", "", m.group(1).strip())
    return ""


def grade_sudoku(generation, puzzle, solution):
    """(correct cells, empty cells): the puzzle's blanks that the answer (padded with "0" / cut to 16) fills right."""
    empty = [i for i in range(16) if puzzle[i] == "0"]
    answer = extract_sudoku(generation)
    if not answer:
        return 0, len(empty)
    answer = answer[:16].ljust(16, "0")
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


def d1_options(options, task, source=None):
    """The options, d1's protocol where a length is unset: the task's GEN_LENGTH, block 32, two tokens per step."""
    return with_lengths(options, GEN_LENGTH[task], BLOCK_LENGTH, 2, source)


def left_padded(prompts, pad_id):
    """Token-id lists as one batch: ids (B, P) left-padded with pad_id, and the attention mask (B, P), 1 = a real
    token. Left padding puts every answer at the same positions, P onwards."""
    P = max(len(x) for x in prompts)
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)  # (B, P)
    attention_mask = torch.zeros((len(prompts), P), dtype=torch.long)  # (B, P)
    for r, x in enumerate(prompts):
        ids[r, P - len(x):] = torch.tensor(x, dtype=torch.long)
        attention_mask[r, P - len(x):] = 1
    return ids, attention_mask


def sample_answers(model, prompts, options, seed, idx, stops=None, stats=None):
    """The answers (B, gen_length) to the token-id prompts of items idx. The block sampler draws (its noise at
    temperature > 0, its order with --remasking random) from each item's own generator; Dream's sampler draws over the
    whole batch (origin even when greedy), from its first item's: the same batch (--batch-size) draws the same again.
    stops, stats: the block samplers' early exit (sample.generate's stop_ids, stats), on unless options say not."""
    device = next(model.parameters()).device
    prompt, attention_mask = left_padded(prompts, model.config.pad_token_id)  # (B, P)
    generators = None
    if options.sampler == "dream":
        generators = item_generator(seed, idx[0], device)
    elif options.temperature > 0 or options.remasking == "random":
        generators = [item_generator(seed, i, device) for i in idx]
    out = generate_with_options(model, prompt.to(device), attention_mask.to(device), options, generators, stops, stats)
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
    """The records of the batch's items `idx` not graded before (`done`): each answer (B, gen_length), decoded with
    its special tokens ("<|eot_id|>", "<|endoftext|>") as d1 stores and grades it, the item's gold fields, its grade."""
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
    on the others; without torch.distributed a plain function. sampler_options: a sample.SamplerOptions (None: d1's
    protocol, greedy), its unset lengths d1's (d1_options); run: a SeedRun (None: seed 0, no shots, nothing before).
    Fixed batches of batch_size items, the k-th left to do on rank k % world: results do not depend on the number of
    ranks; every rank runs as many batches (one with none left repeats item 0 and drops it), so a sharded model (FSDP)
    keeps its collectives in step. Under NCCL each rank must have called torch.cuda.set_device(local_rank) first."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {TASKS}")
    options = d1_options(sampler_options or SamplerOptions(), task)
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
    records, start, tokens, stops = list(done.values()), time.time(), dict(generated=0, skipped=0), stop_ids(tokenizer)
    for round_ in range(rounds):
        idx = todo[round_ * world + rank] if round_ * world + rank < len(todo) else []
        stats = {}  # the early exit's skipped tokens
        answers = sample_answers(module, [prompts[i] for i in idx or [0]], options, run.seed, idx or [0], stops, stats)
        new = graded_records(tokenizer, task, items, idx, answers, run.seed, done)
        if world > 1:  # every rank's records of the round (in rank order), which rank 0 streams
            parts = gather_objects(new)
            new = [r for part in parts for r in part] if rank == 0 else []
        records += new
        skipped = stats.get("skipped", 0) if idx else 0
        tokens["generated"] += len(idx) * options.gen_length - skipped
        tokens["skipped"] += skipped
        if rank == 0 and run.on_batch and new:
            run.on_batch(new)
        if rank == 0 and run.log_every and ((round_ + 1) % run.log_every == 0 or round_ == rounds - 1):
            elapsed = time.time() - start
            eta = elapsed / (round_ + 1) * (rounds - round_ - 1)
            rate = sum(tokens.values()) / max(elapsed, 1e-9)
            print(f"  seed {run.seed}: {len(records)}/{len(items)} items, {rate:.0f} answer tokens/s "
                  f"({tokens['generated']} generated, {tokens['skipped']} skipped: the early exit), accuracy so far "
                  f"{accuracy(task, records):.1f}%, ETA {eta / 60:.1f} min", flush=True)
    module.train(was_training)
    parts = gather_objects(tokens) if world > 1 else [tokens]  # every rank's counts
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
    p.add_argument("--prompt-style", choices=PROMPT_STYLES, default=None,
                   help="d1 (the default): instruction + question, then '<reasoning>'; plain: the question alone (the "
                   "embedded task, whose model folder says so)")
    p.add_argument("--out", default=None, help="summary JSON file; every graded item streams to the same name with "
                                                ".jsonl as its batch finishes, and rerunning the command continues")
    p.add_argument("--log-every", type=int, default=1, help="batches between progress lines")
    return p


def parse_args(argv=None):
    """(parser, args): the flags, their values checked before anything is read (a one-line error naming the flag)."""
    p = make_parser()
    args = p.parse_args(argv)
    if args.shots < 0:
        p.error(f"--shots {args.shots}: must be 0 (none) or more")
    if args.shots and not args.shot_data:
        p.error("--shots needs --shot-data (a file to take the solved examples from)")
    for flag in ("limit", "batch_size", "log_every"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            p.error(f"--{flag.replace('_', '-')} {value}: must be at least 1")
    try:
        options_from_flags(args)  # the flags' values, checked (SamplerOptions)
    except ValueError as e:
        p.error(str(e))
    if len(set(args.seeds)) < len(args.seeds):
        p.error(f"--seeds {' '.join(map(str, args.seeds))}: each seed once (the std is over distinct runs)")
    for seed in args.seeds:  # an item's noise comes from mixed_seed(seed, index) (item_generator)
        if seed not in SEEDS:
            p.error(f"--seeds {seed}: must be {SEED_RULE}")
    return p, args


def resolve_model(p, args):
    """Sets args.folder and .adapter (a run or checkpoint folder finds its model), and .data, .prompt_style and
    .options (checked): a flag, else the folder's generation_defaults.json for this task (or for every task when it
    names none), else d1's protocol."""
    try:
        args.folder, adapter = find_model(args.model)
        defaults = folder_defaults(args.folder)
        args.adapter = args.adapter or adapter
        check_adapter(args.folder, args.adapter)  # a merged export with its own adapter, an adapter on another base
    except (FileNotFoundError, ValueError) as e:
        p.error(str(e))
    if defaults.get("prompt_style") not in (None,) + PROMPT_STYLES:
        p.error(f"{args.folder / GENERATION_DEFAULTS}: field 'prompt_style' = {defaults['prompt_style']!r}: expected "
                f"one of {PROMPT_STYLES}")
    defaults = defaults if defaults.get("task") in (None, args.task) else {}  # the folder's own task's settings
    if args.data is None:
        if not defaults.get("test_data"):
            p.error(f"--data: give the {args.task} test file (the model folder names none for this task)")
        args.data = str(args.folder / defaults["test_data"])
    if args.shots and os.path.realpath(args.shot_data) == os.path.realpath(args.data):
        p.error(f"--shot-data {args.shot_data}: it is the --data file; draw the examples from another split")
    args.prompt_style = args.prompt_style or defaults.get("prompt_style", "d1")
    try:
        o = d1_options(options_from_flags(args, defaults), args.task, "flags")  # a flag, else the folder's, else d1's
        check_sampler_choice(args, o, args.folder)
        check_step_count(o, given=args.steps is not None)  # the context is load_data's check, after --out
    except ValueError as e:
        p.error(str(e))
    args.options = o


def seed_free(args):
    """True when the generations cannot depend on the seed: no few-shot draw, and a sampler that draws nothing."""
    o = args.options
    if args.shots or o.temperature > 0:
        return False
    if o.sampler == "dream":
        return o.alg != "origin" and not o.alg_temp  # origin draws which masks to unmask even when greedy
    return o.remasking == "low_confidence"


def warn_seed_free(args, rank):
    """Rank 0: a warning when --seeds names several seeds that give the same generations (seed_free); they still run."""
    if len(args.seeds) > 1 and seed_free(args) and rank == 0:
        print(f"eval.py: warning: --seeds {' '.join(map(str, args.seeds))}: greedy decoding with {args.shots} shots "
              "draws nothing from the seed, so every seed repeats the same evaluation and the std over them is 0 by "
              "construction; sample with --temperature > 0, or use --shots, for a spread", flush=True)


def load_data(p, args):
    """The test items (the first --limit), the few-shot pool and the model's tokenizer; every prompt is checked
    readable by the tokenizer, and a missing or malformed file named in one line, before the model loads."""
    flag, path = "--data", args.data
    try:
        raw = read_data_file(args.data)
        args.data_sha256 = hashlib.sha256(raw).hexdigest()[:16]  # of the bytes the items come from (run_settings)
        items = load_benchmark(args.task, args.data, raw)[:args.limit]
        flag, path = "--shot-data", args.shot_data
        shot_items = load_benchmark(args.task, args.shot_data) if args.shots else []
        if args.shots > len(shot_items):
            raise ValueError(f"--shots {args.shots} but {args.shot_data} has only {len(shot_items)} items")
        tokenizer = load_tokenizer(args.folder)
        check_chat_tokens(tokenizer, args.folder)
        config = LLaDAConfig.from_json(args.folder / "config.json")
        check_mask_token(tokenizer, config)  # the ids within the embedding, before the weights load
    except (OSError, ValueError) as e:
        p.error(str(e) if str(path) in str(e) or str(args.folder) in str(e) else f"{flag} {path}: {e}")
    fmt = chat_format(tokenizer)
    for item in items + shot_items:
        prompt = build_prompt(args.task, item, args.prompt_style, (), fmt)
        bad = unencodable_characters(tokenizer, prompt)
        if bad:
            hint = ("; the embedded Sudoku model reads plain prompts (--prompt-style plain)"
                    if args.prompt_style != "plain" else "")
            p.error(f"{args.data}: a {args.prompt_style} prompt has characters this model's tokenizer cannot encode: "
                    f"{', '.join(map(repr, bad))}{hint}")
        problem = mask_in_text(tokenizer, prompt)
        if problem:
            p.error(f"{args.data}: the question {item['question'][:40]!r}... {problem}")
    for seed in args.seeds if args.shots else args.seeds[:1]:  # each seed's shots: every prompt fits the context
        shots = pick_shots(shot_items, args.shots, seed)
        bad = unencodable_characters(tokenizer, build_prompt(args.task, items[0], args.prompt_style, shots, fmt))
        if bad:
            p.error(f"--shots {args.shots}: the few-shot prompt has characters this model's tokenizer cannot encode: "
                    f"{', '.join(map(repr, bad))}")
        encoded_prompts(tokenizer, args.task, items, args.prompt_style, shots, args.options.gen_length,
                        config.max_sequence_length)  # a ValueError naming the item, as evaluate() would raise
    return items, shot_items, tokenizer


def run_settings(args, dtype):
    """What the generations depend on, stored with every record: a rerun continues a file only with the same."""
    o = args.options
    settings = dict(task=args.task, model=os.path.abspath(args.folder),
                    model_fingerprint=folder_fingerprint(args.folder),
                    adapter=args.adapter and os.path.abspath(args.adapter), data=os.path.abspath(args.data),
                    data_sha256=args.data_sha256,
                    gen_length=o.gen_length, steps=o.steps, block_length=o.block_length, batch_size=args.batch_size,
                    shots=args.shots, shot_data=args.shot_data and os.path.abspath(args.shot_data),
                    prompt_style=args.prompt_style, temperature=o.temperature, cache=o.cache,
                    threshold=o.threshold, dtype=str(dtype).replace("torch.", ""))
    # settings that only some runs use, recorded only when set: a record names the options its run used
    extra = dict(cache_refresh=o.cache_refresh, cache_drift=o.cache_drift, cache_window=o.cache_window,
                 cfg_scale=o.cfg_scale, remasking=None if o.remasking == "low_confidence" else o.remasking)
    if o.sampler == "dream":  # Dream's sampler reads none of the block sampler's options, and its own
        extra = dict(sampler=o.sampler, alg=o.alg, alg_temp=o.alg_temp, eps=o.eps, top_p=o.top_p, top_k=o.top_k)
    if args.adapter:  # another adapter at the same path is told apart
        extra["adapter_fingerprint"] = adapter_fingerprint(args.adapter)
    return settings | {k: v for k, v in extra.items() if v}


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
    if "--harness" in (sys.argv[1:] if argv is None else argv):  # lm-evaluation-harness's tasks (GiftLM, below)
        return harness_main(argv)
    p, args = parse_args(argv)
    resolve_model(p, args)
    warn_seed_free(args, int(os.environ.get("RANK", "0")))
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
            nonlocal lock
            lock = append_records(records_path, new, settings) or lock
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


# =============================================================================
# lm-evaluation-harness (EleutherAI's, optional; the d1 protocol above does without): this repo's models as "gift".
#     torchrun --nproc_per_node 8 eval.py --harness ...          # lm-eval gives each rank a slice of the documents
#     lm_eval.simple_evaluate(model="gift", model_args="model=DIR,mc_num=128,gen_length=256", tasks=[...])
# generate_until: the sampler of SamplerOptions on left-padded batches, as evaluate() runs it.
# loglikelihood: LLaDA's Monte Carlo estimate of its likelihood bound (Nie et al. 2025, arXiv 2502.09992; the official
#   evaluation/eval_llada.py). For a continuation y of L tokens after the context x:
#       ELBO = E_{l ~ U{1..L}} E_{M ~ U(l-subsets of y)} [ (L / l) sum_{i in M} log p(y_i | x, y with M masked) ]
#   one draw = one row of a forward pass, the draws of consecutive requests sharing passes of `batch_size` rows (right-
#   padded), each request's from its own generator: no draw depends on its neighbours. The l of the mc_num draws are
#   stratified over 1..L; the context is never masked; Dream reads token i at position i - 1. ELBO <= log p(y | x).
# paired (--paired-draws; common random numbers): a question's choices (one context) draw from one generator seeded by
#   the context alone: equal lengths share their l and masks, so the noise of their difference cancels; other lengths
#   share k = floor(u L) + 1 (one u: the same fractions l / L) and keys drawn per position (the l lowest are masked).
#   Each l stays uniform on 1..L (to 2^-53), each mask uniform given l: each choice's estimate stays unbiased.

@dataclass
class HarnessOptions:
    """GiftLM's model_args besides SamplerOptions' (those unset: the folder's generation_defaults.json, the task's)."""
    model: str  # a model folder, or a checkpoint or run folder (as eval.py's --model)
    adapter: str = None  # a LoRA adapter folder, merged before sampling
    dtype: str = "auto"  # auto, float32, bfloat16, float64
    device: str = None  # one process only: torchrun's ranks each take their own
    batch_size: int = 8  # prompts per generate call, and likelihood draws per forward pass
    mc_num: int = 128  # likelihood draws per request
    seed: int = 0  # of the likelihood draws and of sampling
    check_greedy: bool = True  # False: is_greedy is always False, without its L extra passes
    paired: bool = False  # the choices of a question (one context) share their likelihood draws (paired, above)
    add_bos_token: bool = False  # every context starts with the family's BOS token (Dream's evaluation sets it)

    def __post_init__(self):  # lm-eval's --model_args arrive typed by guess: "maybe", "1.5", "cuda:0" on any machine
        if not all(type(n) is int and n >= 1 for n in (self.batch_size, self.mc_num)):
            raise ValueError(f"GiftLM: batch_size {self.batch_size!r} and mc_num {self.mc_num!r} must be integers >= 1 "
                             "(no 'auto')")
        if type(self.seed) is not int or self.seed not in SEEDS:
            raise ValueError(f"GiftLM: seed {self.seed!r}: must be {SEED_RULE}")
        if self.dtype not in DTYPES + ("float64",):
            raise ValueError(f"GiftLM: dtype {self.dtype!r}: must be one of {', '.join(DTYPES)}, float64")
        for name in ("check_greedy", "paired", "add_bos_token"):
            if type(getattr(self, name)) is not bool:
                raise ValueError(f"GiftLM: {name} {getattr(self, name)!r}: must be true or false")
        if not all(isinstance(v, str) for v in (self.model, self.adapter or "", self.device or "")):
            raise ValueError(f"GiftLM: model {self.model!r}, adapter {self.adapter!r}, device {self.device!r}: must be "
                             "strings (folders, a device name)")
        try:
            device = torch.device(self.device or "cpu")
        except RuntimeError:  # not a device name
            device = None
        if device is None or device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            raise ValueError(f"GiftLM: device {self.device!r}: not a device of this machine (it has "
                             f"{torch.cuda.device_count()} CUDA devices); e.g. cpu or cuda:0")


def stratified_mask_counts(L, b, generator, paired=False):
    """How many of the L continuation tokens each of b draws masks: l_j = ((k - 1 + round(j L / b)) mod L) + 1,
    j = 0 .. b - 1, k ~ U{1..L} (eval_llada.py's stratified draws: the b counts spread evenly over 1..L). The offsets
    are rounded apart from k, so each l_j is exactly uniform on 1..L (eval_llada.py rounds k + j L / b with torch.round,
    whose half-to-even ties make l_j depend on k's parity). paired: k = floor(r L / 2^53) + 1, r ~ U{0..2^53 - 1}, the
    same r for any L (paired, above). (b,) long, on the CPU."""
    k = ((int(torch.randint(2 ** 53, (), generator=generator)) * L >> 53) + 1 if paired
         else int(torch.randint(1, L + 1, (), generator=generator)))
    offsets = (2 * torch.arange(b) * L + b) // (2 * b)  # round(j L / b), halves up, in integers
    return (k - 1 + offsets) % L + 1


def continuation_masks(L, counts, generator, paired=False):
    """For each count l, a uniformly random set of l of the L positions: (b, L) bool, row j with counts[j] True. The
    keys are drawn row by row, or paired position by position (position i's b keys the same for any L > i)."""
    b = len(counts)
    keys = torch.rand(L, b, generator=generator).T if paired else torch.rand(b, L, generator=generator)  # (b, L)
    order = keys.argsort(dim=1)  # a random permutation per row
    first = torch.arange(L)[None, :] < counts[:, None]  # (b, L): the permutation's first l entries are masked
    return torch.zeros(b, L, dtype=torch.bool).scatter(1, order, first)


def elbo_rows(context, continuation, mc_num, generator, paired=False):
    """One request's mc_num draws (the estimator above) as rows for elbo_passes: (x0 (P + L,) token ids, masked
    (P + L,) bool, never the context, L / l), the context non-empty (Dream reads the first continuation token at its
    last position). The counts first, then the masks (torch.rand reads the generator in order): a rerun and any device
    give the same."""
    P, L = len(context), len(continuation)
    if P < 1 or L < 1:
        raise ValueError(f"elbo_rows: a context of {P} and a continuation of {L} tokens; each needs at least one")
    counts, x0 = stratified_mask_counts(L, mc_num, generator, paired), torch.tensor(list(context) + list(continuation))
    masked = torch.cat([torch.zeros(mc_num, P, dtype=torch.bool), continuation_masks(L, counts, generator, paired)], 1)
    return [(x0, m, L / l) for m, l in zip(masked, counts.tolist())]


@torch.no_grad()
def elbo_passes(model, rows, batch_size):
    """The draw of each row (x0, masked, L / l) of `rows` (any requests' in turn), float64, yielded in order:
    batch_size rows per forward pass, right-padded to its longest (the padding hidden by the attention mask, the
    positions unchanged), so a draw is the same beside any others, up to rounding."""
    device, mask_id, rows = next(model.parameters()).device, model.config.mask_token_id, iter(rows)
    while batch := list(itertools.islice(rows, batch_size)):
        x0, masked = (torch.nn.utils.rnn.pad_sequence([r[i] for r in batch], batch_first=True).to(device)
                      for i in (0, 1))  # (b, T): padded with token 0, never masked
        lengths = torch.tensor([len(r[0]) for r in batch])
        real = (torch.arange(x0.shape[1])[None, :] < lengths[:, None]).to(device)  # (b, T): False = padding
        hidden = model(torch.where(masked, mask_id, x0), attention_mask=real, return_hidden=True)  # (b, T, D)
        hidden = shift_right(hidden) if model.predicts_shifted else hidden  # position i: predicting token i
        rows_, cols = masked.nonzero(as_tuple=True)  # the N masked tokens: the only logits the estimate reads
        logits = model.head(hidden[rows_, cols])  # (N, V)
        logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
        logp_y = logp.gather(-1, x0[rows_, cols][:, None])[:, 0].double()  # (N,)
        sums = torch.zeros(len(batch), dtype=torch.float64, device=device).index_add_(0, rows_, logp_y)  # (b,)
        yield from (torch.tensor([r[2] for r in batch], dtype=torch.float64, device=device) * sums).tolist()


def elbo_draws(model, context, continuation, mc_num, batch_size, generator, paired=False):
    """mc_num unbiased draws of the continuation's ELBO (the estimator above), float64 (mc_num,): one request's
    elbo_rows through elbo_passes."""
    rows = elbo_rows(context, continuation, mc_num, generator, paired)
    return torch.tensor(list(elbo_passes(model, rows, batch_size)), dtype=torch.float64)


def greedy_continuation(model, context, L):
    """The L token ids the block sampler gives greedily after the context, one per step (eval_llada.py's is_greedy)."""
    prompt = torch.tensor([list(context)], device=next(model.parameters()).device)  # (1, P)
    return generate(model, prompt, steps=L, gen_length=L, block_length=L)[0, len(context):].tolist()


def max_gen_toks(task, gen_kwargs):
    """A generation task's max_gen_toks (lm-eval's default 256), or a ValueError naming the task."""
    n = gen_kwargs.get("max_gen_toks", 256)
    if type(n) is not int or n < 1:
        raise ValueError(f"GiftLM: task {task!r}: max_gen_toks {n!r}: must be an integer >= 1")
    return n


def cut_at_stops(text, until):
    """The text before the first occurrence of any of the `until` strings (lm-eval's stop sequences)."""
    for stop in until:
        if stop:
            text = text.split(stop)[0]
    return text


PROGRESS_SECONDS = 10  # GiftLM's likelihood requests: rank 0 says how far it is at most this often

# The model_args of LLaDA's evaluation/eval_llada.py, Dream's eval/eval.py and dllm's harnesses, so that their published
# lm-eval commands run with --model gift (docs/harness.md: each name, its meaning there, and the commands).
THEIR_NAMES = {"model_path": "model", "pretrained": "model", "is_check_greedy": "check_greedy",  # theirs: ours
               "max_new_tokens": "gen_length", "diffusion_steps": "steps", "block_size": "block_length"}
THEIR_FIXED = {  # their name: (the values that are what GiftLM does anyway, why another is refused)
    "cfg": ((0,), "LLaDA's cfg also guides its likelihood estimate, GiftLM's has no guidance (cfg_scale: sampling)"),
    "classifier_free_guidance": ((1,), "Dream's guidance of its likelihood estimate (1 = none); GiftLM's has none"),
    "nll_type": (("mc",), "GiftLM's likelihood is the Monte Carlo ELBO, Dream's 'mc' (not its autoregressive ones)"),
    "log_type": (("ftb",), "GiftLM scores the continuation given the context, Dream's 'ftb'"),
    "sampling_eps": ((0,), "GiftLM's ELBO estimate masks l of the L tokens, l uniform: no floor on the masking rate"),
    "escape_until": ((False,), "GiftLM cuts each answer at the task's stop strings"),
    "suppress_tokens": (([], "[]"), "GiftLM's samplers suppress no token"),
    "begin_suppress_tokens": (([], "[]"), "GiftLM's samplers suppress no token"),
}


def their_model_args(model_args):
    """GiftLM's model_args from ones in LLaDA's, Dream's or dllm's names too, checked against config.json before the
    model loads (a ValueError naming the argument); on Dream, Dream's lengths also pick its sampler as it evaluates."""
    args = {k: v for k, v in model_args.items() if k not in THEIR_NAMES}
    for theirs, ours in THEIR_NAMES.items():
        if theirs in model_args:
            if ours in args:
                raise ValueError(f"GiftLM: {theirs} is GiftLM's {ours}, given twice; give it once")
            args[ours] = model_args[theirs]
    for name, (honoured, why) in THEIR_FIXED.items():
        if name in args and args.pop(name) not in honoured:
            raise ValueError(f"GiftLM: {name}={model_args[name]!r}: {why}")
    if isinstance(args.get("batch_size"), str) and args["batch_size"].isdigit():  # lm-eval's --batch_size 8: a string
        args["batch_size"] = int(args["batch_size"])
    if not isinstance(args.get("model"), str):
        raise ValueError(f"GiftLM: model {args.get('model')!r}: give a model folder (model, model_path or pretrained)")
    config = LLaDAConfig.from_json(find_model(args["model"])[0] / "config.json")
    if args.pop("mask_id", config.mask_token_id) != config.mask_token_id:
        raise ValueError(f"GiftLM: mask_id={model_args['mask_id']!r}: the model's mask token is {config.mask_token_id}")
    n = args.setdefault("max_length", config.max_sequence_length)  # the context a request is cut to, as theirs
    if type(n) is not int or not 1 < n <= config.max_sequence_length:
        raise ValueError(f"GiftLM: max_length={n!r}: the model reads 2 to {config.max_sequence_length} tokens")
    if config.predicts_shifted and {"max_new_tokens", "diffusion_steps"} & set(model_args) and "sampler" not in args:
        args = {"sampler": "dream", "alg": "entropy"} | args
    return args


DREAM_BOS = "<|beginoftext|>"  # Dream's (Qwen2.5's) BOS: its evaluation's add_bos_token puts it before each context


class GiftLM(LM):
    """A model folder of this repo for lm-evaluation-harness; model_args: HarnessOptions' and SamplerOptions' fields,
    and LLaDA's, Dream's and dllm's names (their_model_args)."""

    def __init__(self, model=None, **model_args):
        super().__init__()
        model_args.pop("max_batch_size", None)  # lm-eval's, for a batch_size "auto", which GiftLM does not take
        model_args = their_model_args(model_args | ({"model": model} if model is not None else {}))
        max_length = model_args.pop("max_length")
        own, names = [f.name for f in fields(HarnessOptions)], [f.name for f in fields(SamplerOptions)]
        unknown = sorted(set(model_args) - set(own) - set(names))
        if unknown:
            raise ValueError(f"GiftLM: unknown model_args {', '.join(unknown)}; GiftLM takes {', '.join(own)} and "
                             f"{', '.join(names)} (and LLaDA's, Dream's and dllm's names: docs/harness.md)")
        opts = HarnessOptions(**{k: v for k, v in model_args.items() if k in own})
        self.folder, found = find_model(opts.model)
        self.adapter = opts.adapter or found
        check_adapter(self.folder, self.adapter)
        given = argparse.Namespace(**{n: model_args.get(n) for n in names})
        self.options = options_from_flags(given, folder_defaults(self.folder))  # model_args, else the folder's
        check_sampler_choice(given, self.options, self.folder)
        self.tokenizer = load_tokenizer(self.folder)
        check_chat_tokens(self.tokenizer, self.folder)  # as eval.py's: the chat format's tokens, before the weights
        bos_text = DREAM_BOS if chat_format(self.tokenizer) == "chatml" else BOS
        self.bos = [self.tokenizer.token_to_id(bos_text)] if opts.add_bos_token else []  # before every context
        if None in self.bos:
            raise ValueError(f"GiftLM: add_bos_token=True: the tokenizer of {self.folder} has no {bos_text}")
        self._rank, self._world_size, where = setup_distributed()  # torchrun's ranks: each gets a slice
        self._device = torch.device(opts.device) if opts.device and self._world_size == 1 else where
        self.model = load_weights(self.folder, self.adapter, compute_dtype(opts.dtype, self._device), self._device,
                                  merge=True).eval()
        check_mask_token(self.tokenizer, self.model.config)
        self.fmt = chat_format(self.tokenizer)
        self.batch_size, self.mc_num, self.seed = opts.batch_size, opts.mc_num, opts.seed
        self.check_greedy, self.max_length = opts.check_greedy, max_length  # the model's, or a shorter max_length
        self.paired = opts.paired
        bos = self.tokenizer.token_to_id(BOS)  # an empty context is this one token (add_bos_token: the family's BOS)
        eos = self.model.config.eos_token_id  # ChatML's (Dream's) empty context
        self.prefix_id = (self.bos or [eos if bos is None or self.fmt == "chatml" else bos])[0]

    # --- what the harness asks of a model ---

    @property
    def tokenizer_name(self):
        return str(self.folder).replace("/", "__")

    def chat_template(self, chat_template=False):
        return self.fmt

    def apply_chat_template(self, chat_history, add_generation_prompt=True):
        """The model's own chat format (data.chat_prompt); without add_generation_prompt the last (assistant)
        message is continued as is (a task's gen_prefix, e.g. d1's "<reasoning>")."""
        if add_generation_prompt:
            return chat_prompt(chat_history, self.fmt)
        return chat_prompt(chat_history[:-1], self.fmt) + chat_history[-1]["content"]

    def all_gather(self, tensor):  # the harness's collectives (gather_object and barrier: longjob's)
        if self._world_size == 1:
            return tensor
        parts = [torch.zeros_like(tensor) for _ in range(self._world_size)]
        dist.all_gather(parts, tensor)
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def gather_object(self, obj, dst=0):
        parts = gather_objects(obj)
        return parts if self._rank == dst else None

    def barrier(self):
        barrier()

    # --- requests ---

    def _args(self, request, n, kind):
        """The request's arguments, refusing a shape this model does not read (e.g. a multimodal task's images)."""
        if len(request.args) != n:
            raise ValueError(f"GiftLM: task {request.task_name!r}: a {kind} request with {len(request.args)} "
                             f"arguments (this model reads text only: {n}); not supported")
        return request.args

    def _encode(self, text, request):
        return encode_text(self.tokenizer, text, what=f"task {request.task_name!r}: the text")

    def _context_and_continuation(self, context, continuation, request):
        """Token ids of both, split as the harness's models split them: the context's trailing spaces move to the
        continuation; an empty context is the prefix token; a long context keeps its last tokens."""
        n = len(context) - len(context.rstrip())
        if n:
            context, continuation = context[:-n], context[-n:] + continuation
        ctx = self._encode(context, request) if context else []
        whole = self._encode(context + continuation, request)
        cont = whole[len(ctx):] if whole[:len(ctx)] == ctx else self._encode(continuation, request)
        if not cont or len(cont) >= self.max_length:
            raise ValueError(f"GiftLM: task {request.task_name!r}: a continuation of {len(cont)} tokens (the "
                             f"model reads 1 to {self.max_length - 1})")
        return (self.bos + ctx or [self.prefix_id])[-(self.max_length - len(cont)):], cont

    def _elbos(self, pairs, paired=False):
        """The ELBO estimate (the mean of mc_num draws) of each (context, continuation) in turn, consecutive ones
        sharing forward passes; seeded by the seed and token ids (paired: the context's alone, so a question's choices
        share their draws), so the same in any order, batch or rank."""
        def rows(context, continuation):
            key = [self.seed, context] if paired else [self.seed, context, continuation]
            digest = hashlib.sha256(json.dumps(key).encode()).digest()
            g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
            return elbo_rows(context, continuation, self.mc_num, g, paired)
        draws = elbo_passes(self.model, (row for pair in pairs for row in rows(*pair)), self.batch_size)
        for _ in pairs:
            yield torch.tensor(list(itertools.islice(draws, self.mc_num)), dtype=torch.float64).mean().item()

    def loglikelihood(self, requests):
        """(ELBO estimate of log p(continuation | context), is_greedy) per request."""
        pairs = [self._context_and_continuation(*self._args(r, 2, "loglikelihood"), r) for r in requests]
        out, elbos = [], self._elbos(pairs, self.paired)
        for request, (ctx, cont), elbo in zip(self._with_progress(requests, "loglikelihood"), pairs, elbos):
            out.append((elbo, bool(self.check_greedy) and greedy_continuation(self.model, ctx, len(cont)) == cont))
            self.cache_hook.add_partial("loglikelihood", request.args, out[-1])
        return out

    def loglikelihood_rolling(self, requests):
        """The ELBO of the whole text after the prefix token; a text longer than the context in windows of
        max_length / 2 tokens, each after the max_length / 2 before it (a sum of conditional ELBOs, a lower bound)."""
        windows = []
        for request in requests:
            (text,) = self._args(request, 1, "loglikelihood_rolling")
            ids = [self.prefix_id] + (self._encode(text, request) if text else [])
            window = self.max_length - 1 if len(ids) <= self.max_length else self.max_length // 2
            windows.append([(ids[max(0, s - (self.max_length - window)):s], ids[s:s + window])
                            for s in range(1, len(ids), window)])
        out, elbos = [], self._elbos([pair for ws in windows for pair in ws])  # never paired: one text each
        for request, ws in zip(self._with_progress(requests, "loglikelihood_rolling"), windows):
            out.append(sum(next(elbos) for _ in ws))
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, out[-1])
        return out

    def _with_progress(self, requests, kind):
        """The requests in turn; rank 0 says how far it is every PROGRESS_SECONDS (a likelihood request is mc_num /
        batch_size forward passes: with a large mc_num, hours of them)."""
        start = said = time.time()
        for done, request in enumerate(requests, 1):
            yield request
            if self._rank == 0 and time.time() - said >= PROGRESS_SECONDS:
                said = time.time()
                print(f"GiftLM: {kind}: {done}/{len(requests)} requests, ETA "
                      f"{(said - start) / done * (len(requests) - done) / 60:.1f} min", flush=True)

    def _generation_options(self, gen_kwargs, task):
        """The sampler's options for a task: model_args' (or the folder's) lengths, else gen_length = the task's
        max_gen_toks (rounded up to whole blocks), block 32, steps = gen_length / 2 (d1's two per step)."""
        o = self.options
        gen_length = o.gen_length or max_gen_toks(task, gen_kwargs)
        if o.sampler == "block":
            block = o.block_length or min(BLOCK_LENGTH, gen_length)
            gen_length = -(-gen_length // block) * block
        return with_lengths(replace(o, gen_length=gen_length), gen_length, BLOCK_LENGTH, 2)

    def generate_until(self, requests):
        """Each context sampled with the options, in batches of batch_size consecutive requests with the same
        generation arguments; the text up to the family's turn end, then up to the first `until` string. A prompt that
        leaves no room for its answer in the context is refused, naming its task, before any is sampled (as eval.py's
        prompts are); an empty one is the prefix token."""
        out, start, seen, noise, prompts = [], 0, {}, [], []
        for request in requests:  # its sampling noise: item_generator(seed, doc_id), as eval.py's items'
            key = (request.task_name, request.doc_id)
            noise.append((request.doc_id or 0) + seen.get(key, 0) * 2 ** 32)  # a repeat (same doc) draws anew
            seen[key] = seen.get(key, 0) + 1
            context, kwargs = self._args(request, 2, "generate_until")
            prompts.append(self.bos + self._encode(context, request) or [self.prefix_id])
            gen_length = self._generation_options(kwargs, request.task_name).gen_length
            if len(prompts[-1]) + gen_length > self.max_length:
                raise ValueError(f"GiftLM: task {request.task_name!r}: a prompt of {len(prompts[-1])} tokens + "
                                 f"{gen_length} to generate exceed the model's max_sequence_length {self.max_length}; "
                                 "lower the task's max_gen_toks (or gen_length) or its few-shot examples")
        while start < len(requests):
            kwargs = self._args(requests[start], 2, "generate_until")[1]
            end = start + 1
            while (end < len(requests) and end - start < self.batch_size
                   and self._args(requests[end], 2, "generate_until")[1] == kwargs):
                end += 1
            options, until = self._generation_options(kwargs, requests[start].task_name), kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            answers = sample_answers(self.model, prompts[start:end], options, self.seed, noise[start:end],
                                     stop_ids(self.tokenizer))  # (B, gen_length)
            for request, answer in zip(requests[start:end], answers.tolist()):
                out.append(cut_at_stops(decode_until_stop(self.tokenizer, answer), until))
                self.cache_hook.add_partial("generate_until", request.args, out[-1])
            start = end
        return out


if HARNESS_MISSING:
    del GiftLM  # eval.GiftLM says how to install lm-eval (__getattr__)
else:
    with contextlib.suppress(ValueError):  # registered already by this file loaded under another name (__main__)
        model_registry.register("gift")(GiftLM)


def __getattr__(name):
    """eval.GiftLM without lm-eval installed: an ImportError saying how to install it, in one line."""
    if name == "GiftLM" and HARNESS_MISSING:
        raise ImportError(HARNESS_MISSING)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def harness_tasks(args):
    """--tasks as lm-eval's Task (and Group) objects, and their TaskManager, checked before the model loads (a
    ValueError naming the flag or task): each name known and its YAML read (lm-eval renders the first document),
    its max_gen_toks, a document for each torchrun rank (a rank without one stops the others), its few-shot examples."""
    from lm_eval.evaluator_utils import get_sample_size
    from lm_eval.tasks import TaskManager
    names = [name.strip() for name in args.tasks.split(",")]
    if not all(names):
        raise ValueError(f"--tasks {args.tasks!r}: an empty name (names are separated by commas)")
    if args.include_path and not os.path.isdir(args.include_path):
        raise ValueError(f"--include-path {args.include_path}: no such folder")
    if args.limit is not None and args.limit <= 0:
        raise ValueError(f"--limit {args.limit:g}: must be > 0 (documents, or a share of them below 1)")
    if (args.num_fewshot or 0) < 0:
        raise ValueError(f"--num-fewshot {args.num_fewshot}: must be 0 or more")
    here = TaskManager(include_path=args.include_path, include_defaults=False) if args.include_path else None
    if here is None or not set(names) <= set(here.all_tasks):  # lm-eval's own: indexing them takes a while
        here = TaskManager(include_path=args.include_path)
    loaded = dict(tasks={}, groups={}, group_map={})
    for name in names:
        try:  # a user's YAML: a template that fails, a missing data file; lm-eval's index skips one it cannot read
            for key, part in here.load(name).items():
                loaded[key].update(part)
        except Exception as e:
            bad = "".join(f"; it cannot read {path} ({' '.join(str(why).split())[:200]})"
                          for path, why in unreadable_yamls(args.include_path))
            raise ValueError(f"--tasks {name}: lm-eval cannot load it ({type(e).__name__}: "
                             f"{' '.join(str(e).split())[:300]}){bad}") from e
    world = int(os.environ.get("WORLD_SIZE", "1"))
    for name, task in loaded["tasks"].items():
        docs, own = task.eval_docs, task.get_config("num_fewshot")
        if min(len(docs), get_sample_size(task, args.limit) or len(docs)) < world:
            raise ValueError(f"task {name}: fewer documents to evaluate (--limit {args.limit}) than the {world} ranks; "
                             "each rank needs one")
        shots = own if args.num_fewshot is None or own == 0 else args.num_fewshot  # as simple_evaluate sets it
        pool = (len(task.sampler.fewshot_docs()) - (task.fewshot_cfg.split == task.config.test_split)
                if hasattr(task, "sampler") else 0)  # a test document is not its own example
        if (shots or 0) > pool:
            raise ValueError(f"--num-fewshot {shots}: task {name} has {max(pool, 0)} few-shot examples")
        if task.get_config("output_type") == "generate_until":
            max_gen_toks(name, task.get_config("generation_kwargs") or {})
    children = {child for group in loaded["group_map"].values() for child in group}  # the named ones, in groups
    return [o for name, o in {**loaded["groups"], **loaded["tasks"]}.items() if name not in children], here


def unreadable_yamls(folder):
    """(path, exception) of each YAML file under `folder` (None: none) that lm-eval's loader cannot read."""
    from lm_eval.tasks._yaml_loader import load_yaml
    for path in sorted(Path(folder).rglob("*.yaml")) if folder else []:
        try:
            load_yaml(path, resolve_func=False)
        except Exception as e:  # what lm-eval's index catches, and skips
            yield path, e


def harness_main(argv=None):
    """python eval.py --harness: lm-eval's tasks (or --include-path's YAMLs); rank 0 prints the table, writes --out."""
    p = argparse.ArgumentParser(description="Evaluate a LLaDA or Dream model on lm-evaluation-harness tasks "
                                            "(torchrun --nproc_per_node N eval.py --harness ... for several GPUs).")
    p.add_argument("--harness", action="store_true", help="run lm-evaluation-harness tasks (this command line)")
    add_model_flags(p)
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task names, e.g. arc_easy,gsm8k")
    p.add_argument("--include-path", default=None, help="folder of task YAMLs of your own")
    p.add_argument("--limit", type=float, default=None, help="only the first N documents of each task")
    p.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples (default: the task's)")
    p.add_argument("--apply-chat-template", action="store_true", help="wrap each prompt in the model's chat format")
    p.add_argument("--mc-num", type=int, default=128, help="Monte Carlo draws (forward passes) per likelihood")
    p.add_argument("--no-check-greedy", action="store_true",
                   help="is_greedy always False (saves the L greedy passes of each likelihood request)")
    p.add_argument("--paired-draws", action="store_true", help="the choices of a question share their likelihood "
                   "draws (the same l and masks): less noise between choices, each estimate still unbiased")
    p.add_argument("--seed", type=int, default=0, help="seed of the likelihood draws and of sampling")
    p.add_argument("--batch-size", type=int, default=8,
                   help="prompts per generate call; likelihood draws per forward pass")
    add_dtype_flag(p, DTYPES + ("float64",))
    p.add_argument("--out", default=None, help="write the harness's results (JSON) here")
    add_sampler_flags(p)
    args = p.parse_args(argv)
    if HARNESS_MISSING:
        raise SystemExit(f"eval.py: {HARNESS_MISSING}")
    import lm_eval
    from lm_eval.utils import make_table
    try:  # the flags (GiftLM checks its model_args again), --out and the tasks, before the model loads
        HarnessOptions(args.model, adapter=args.adapter, dtype=args.dtype, batch_size=args.batch_size,
                       mc_num=args.mc_num, seed=args.seed)
        options_from_flags(args)
        if args.out:
            check_harness_out(Path(args.out))
        tasks, task_manager = harness_tasks(args)
    except ValueError as e:
        p.error(str(e))
    sampler = {f.name: getattr(args, f.name) for f in fields(SamplerOptions) if getattr(args, f.name) is not None}
    lm = GiftLM(model=args.model, adapter=args.adapter, dtype=args.dtype, batch_size=args.batch_size,
                mc_num=args.mc_num, seed=args.seed, check_greedy=not args.no_check_greedy, paired=args.paired_draws,
                **sampler)
    limit = int(args.limit) if args.limit and args.limit >= 1 else args.limit
    results = lm_eval.simple_evaluate(model=lm, tasks=tasks, num_fewshot=args.num_fewshot, limit=limit,
                                      apply_chat_template=args.apply_chat_template, log_samples=False,
                                      task_manager=task_manager, random_seed=args.seed, numpy_random_seed=args.seed,
                                      torch_random_seed=args.seed, fewshot_random_seed=args.seed)
    if lm.rank == 0:
        print(make_table(results))
        if args.out:
            atomic_write_text(args.out, json.dumps(results, indent=1, default=str))
            print(f"wrote {args.out}")
    end_distributed()
    return results


if __name__ == "__main__":
    run_command_line(main, "eval.py")  # a user's mistake: one line, exit status 1

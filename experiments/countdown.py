"""The toy Countdown task of experiments/gift_vs_sft.py: reach a target from 3-4 small numbers with + - * /, graded by
d1's Countdown rule (eval.grade_countdown), and which answer positions carry the entropy (the analogue of Figure 2
of GIFT, arXiv 2509.20863).

A problem is drawn from a seed: numbers uniform in a range, a random binary expression tree over them (a random
order, a random split at every node, a random operator among those that keep every value a positive integer no
larger than max_target: subtraction only to a positive result, division only when exact), its value the target and
its text, with the fewest parentheses and the larger operand first under + and *, the one training answer. The
prompt is eval.py's plain Countdown question ("Numbers: [3, 5, 7]\\nTarget: 56"; by default the numbers in the order
the expression uses them, a hint without which the tiny model solved no 4-number problem in the sizing probes) and the
answer eval.shot_response's plain answer "<answer>\\boxed{(3+5)*7}</answer>" (d1's grader reads the box;
it does not accept a bare "<answer>(3+5)*7</answer>"), padded with <|eot_id|> to one fixed length, so that the
whole answer is one block generated in as many steps as it has tokens, as embedded.EMBEDDED_EVAL does for Sudoku.
A problem is its (sorted numbers, target): no held-out problem is in any training set, and no fine-tuning problem
in pre-training."""

import json
import math
import random
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's top-level files are plain modules
import gift  # noqa: E402
from data import EOT, collate, encode, encode_examples, encode_text  # noqa: E402
from embedded import CHAR_VOCAB, make_char_tokenizer  # noqa: E402
from eval import COUNTDOWN_QUESTION, build_prompt, evaluate, last_boxed  # noqa: E402
from sample import SamplerOptions  # noqa: E402

TITLE = "toy Countdown"
# the Plan fields only this task reads, and this task's defaults for the shared ones (flags given still win)
PLAN_FIELDS = ("number_range", "base_numbers", "ft_numbers", "max_target", "number_order")
DEFAULTS = dict(out="runs/countdown-gift-vs-sft", objectives="sft,gift,gift-k4,gift-star")
# (result key, its standard-error key, table label, short name); the first is the headline metric
METRICS = (("acc", "acc_se", "solved %", "solved"), ("numbers_ok", "numbers_ok_se", "uses the numbers %", "numbers"))
COUNTS = ("n_problems",)
VOCAB = CHAR_VOCAB + "NT[],+-*()\\{}"  # the char vocabulary plus what the prompts and expressions use
PREFIX, SUFFIX = "<answer>\\boxed{", "}</answer>"  # around the expression: eval.shot_response(..., "plain")'s answer
PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}
LEAF = 3  # a number needs no parentheses
CLASSES = ("digit", "operator", "parenthesis", "prefix", "suffix", "eot", "pad")


def make_tokenizer():
    return make_char_tokenizer(VOCAB)


def int_pair(text):
    low, high = (int(x) for x in text.split(","))
    return low, high


def counts(text):
    return [int(x) for x in text.split(",") if x.strip()]


def check_plan(plan, error):
    """One-line errors (error = parser.error) for this task's flags."""
    try:
        low, high = int_pair(plan.number_range)
        assert 1 <= low <= high <= 999
    except (ValueError, AssertionError):
        error(f"--number-range {plan.number_range!r}: expected low,high with 1 <= low <= high <= 999, e.g. 1,9")
    for name in ("base_numbers", "ft_numbers"):
        try:
            assert counts(getattr(plan, name)) and all(2 <= n <= 6 for n in counts(getattr(plan, name)))
        except (ValueError, AssertionError):
            error(f"--{name.replace('_', '-')} {getattr(plan, name)!r}: expected comma-separated counts of numbers "
                  "in 2..6, e.g. 3 or 3,4 (a problem's count is drawn from the list)")
    if plan.max_target < high:
        error(f"--max-target {plan.max_target}: must be at least the largest number ({high})")


# -----------------------------------------------------------------------------
# The generator


def apply(op, a, b):
    """a op b if it is a positive integer, else None: subtraction only to a positive result, division only when
    exact."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b if a > b else None
    if op == "*":
        return a * b
    return a // b if a % b == 0 else None


def wrap(node, op, right):
    """A child's text under `op`, in parentheses only where they change the value: a lower precedence, or the right
    operand of - or / at the same precedence."""
    _, text, precedence = node
    need = precedence < PRECEDENCE[op] or (right and precedence == PRECEDENCE[op] and op in "-/")
    return f"({text})" if need else text


def random_tree(leaves, rng, max_value):
    """(value, text, precedence) of a random expression over `leaves` [(value, text, precedence)] in their order:
    a random split, both sides built the same way, a random operator among those whose value is a positive integer
    <= max_value. None if no operator fits somewhere (the caller draws again)."""
    if len(leaves) == 1:
        return leaves[0]
    split = rng.randint(1, len(leaves) - 1)
    left, right = random_tree(leaves[:split], rng, max_value), random_tree(leaves[split:], rng, max_value)
    if left is None or right is None:
        return None
    values = {op: apply(op, left[0], right[0]) for op in "+-*/"}
    options = [op for op, value in values.items() if value is not None and value <= max_value]
    if not options:
        return None
    op = rng.choice(options)
    if op in "+*" and left[0] < right[0]:  # the canonical answer: the larger operand first where the order is free
        left, right = right, left
    return values[op], wrap(left, op, False) + op + wrap(right, op, True), PRECEDENCE[op]


def draw_problem(rng, n_numbers, low, high, max_target, number_order="drawn"):
    """One problem: {numbers (in the prompt's order), target, expression (the training answer)}. number_order
    "expression": the prompt lists the numbers in the order the expression uses them (a hint: what is left to find is
    the operators and parentheses, not an order of the numbers)."""
    while True:
        numbers = [rng.randint(low, high) for _ in range(n_numbers)]
        order = list(numbers)
        rng.shuffle(order)  # the expression's order is not the prompt's
        tree = random_tree([(x, str(x), LEAF) for x in order], rng, max_target)
        if tree is not None:
            if number_order == "expression":
                numbers = [int(x) for x in re.findall(r"\d+", tree[1])]
            return dict(numbers=numbers, target=tree[0], expression=tree[1])


def problem_key(problem):
    """What makes two problems the same: the numbers as a multiset and the target."""
    return tuple(sorted(problem["numbers"])), problem["target"]


def draw_problems(n, n_numbers, plan, rng, taken, what, distinct=True):
    """n problems, each with a count of numbers drawn from n_numbers, none in `taken`; distinct ones are added to
    `taken` (distinct=False: a stream of draws in which a problem may come again, as the pre-training set, whose
    3-number problems are too few to be distinct). Bounded: a request larger than the space of problems fails with
    a one-line error instead of hanging."""
    low, high = int_pair(plan.number_range)
    out = []
    for _ in range(50 * n + 1000):
        if len(out) == n:
            break
        problem = draw_problem(rng, rng.choice(n_numbers), low, high, plan.max_target, plan.number_order)
        if problem_key(problem) not in taken:
            if distinct:
                taken.add(problem_key(problem))
            out.append(problem)
    if len(out) < n:
        raise ValueError(f"countdown: could draw only {len(out)} of {n} distinct {what} problems with {n_numbers} "
                         f"numbers in {plan.number_range} and targets <= {plan.max_target}; ask for fewer or widen "
                         "--number-range / --max-target")
    return out


def answer_tokens(plan):
    """The fixed answer length in tokens (one character each, <|eot_id|> one token): the answer of the longest
    possible expression (n numbers of the widest width, n - 1 operators, parentheses around at most n - 2 inner
    nodes) and gift.py's closing <|eot_id|>."""
    n = max(counts(plan.base_numbers) + counts(plan.ft_numbers))
    width = len(str(int_pair(plan.number_range)[1]))
    return len(PREFIX + SUFFIX) + n * width + (n - 1) + 2 * (n - 2) + 1


def question(problem):
    return COUNTDOWN_QUESTION.format(numbers=problem["numbers"], target=problem["target"])


def answer_text(problem, n_tokens):
    """The training answer, padded with <|eot_id|> to n_tokens including the one gift.py's data path appends."""
    answer = PREFIX + problem["expression"] + SUFFIX
    pads = n_tokens - 1 - len(answer)
    if pads < 0:
        raise ValueError(f"countdown: the answer {answer!r} is longer than {n_tokens - 1} tokens")
    return answer + EOT * pads


def build_data(plan, folder):
    """Held-out problems first (ft_numbers, distinct), then the fine-tuning set (ft_numbers, distinct, none held out),
    then the pre-training set (base_numbers, repeats allowed, none held out or in fine-tuning), each from its own
    stream of data_seed; the last two as prompt/response JSONL for gift.train and everything in data.json."""
    folder.mkdir(parents=True, exist_ok=True)
    taken = set()
    heldout = draw_problems(plan.n_heldout, counts(plan.ft_numbers), plan,
                            random.Random(f"countdown {plan.data_seed} heldout"), taken, "held-out")
    ft = draw_problems(plan.n_ft, counts(plan.ft_numbers), plan, random.Random(f"countdown {plan.data_seed} finetune"),
                       taken, "fine-tuning")
    base = draw_problems(plan.n_base, counts(plan.base_numbers), plan,
                         random.Random(f"countdown {plan.data_seed} base"), taken, "pre-training", distinct=False)
    n_tokens = answer_tokens(plan)
    for name, problems in (("base", base), ("finetune", ft)):
        with open(folder / f"{name}.jsonl", "w") as f:
            for p in problems:
                f.write(json.dumps({"prompt": question(p), "response": answer_text(p, n_tokens)}) + "\n")
    (folder / "data.json").write_text(json.dumps({"base": base, "finetune": ft, "heldout": heldout,
                                                  "answer_tokens": n_tokens}))
    return base, ft, heldout


def describe_data(plan, base, ft, heldout):
    return (f"{len(base)} pre-training problems ({plan.base_numbers} numbers), {len(ft)} fine-tuning and "
            f"{len(heldout)} held-out problems ({plan.ft_numbers} numbers); numbers in {plan.number_range}, targets "
            f"<= {plan.max_target}; answers of {answer_tokens(plan)} tokens")


def examples(tokenizer, problems, n_tokens):
    """[(ids, prompt_len)] as gift.train builds them from the JSONL rows."""
    return encode_examples(tokenizer, [([{"role": "user", "content": question(p)}], answer_text(p, n_tokens))
                                       for p in problems])


def heldout_items(problems):
    """eval.evaluate items (what eval.load_countdown makes of a d1 Countdown row)."""
    return [dict(question=question(p), numbers=p["numbers"], target=p["target"]) for p in problems]


def check_prompts(tokenizer, problems, plan):
    """Every character of the prompts and answers must be in the char vocabulary (a one-line error names the
    others), and the prompt the model is trained on must be eval.py's plain Countdown prompt."""
    text = "".join(question(p) + PREFIX + p["expression"] + SUFFIX for p in problems)
    encode_text(tokenizer, "".join(sorted(set(text))), what="the Countdown prompts and answers")
    n_tokens = answer_tokens(plan)
    for p, (ids, prompt_len) in zip(problems[:8], examples(tokenizer, problems[:8], n_tokens)):
        if encode(tokenizer, build_prompt("countdown", heldout_items([p])[0], "plain")) != list(ids[:prompt_len]):
            raise RuntimeError("experiments: the training prompt differs from eval.py's plain prompt")


def shapes(tokenizer, problems, plan):
    """(sequence length, prompt length) of the longest fine-tuning rows (the prompt's length moves with the digits)."""
    rows = examples(tokenizer, problems, answer_tokens(plan))
    return max(len(ids) for ids, _ in rows), max(p for _, p in rows)


# -----------------------------------------------------------------------------
# Evaluation and the entropy analysis


def uses_the_numbers(generation, numbers):
    """The first half of d1's rule alone: the integers of the boxed expression are exactly the given numbers."""
    expression = last_boxed(generation) or ""
    return sorted(int(n) for n in re.findall(r"\d+", expression)) == sorted(numbers)


def evaluate_heldout(model, tokenizer, heldout, batch_size, plan):
    """Held-out grades with eval.evaluate (task "countdown", prompt_style "plain", greedy, the fixed-length answer
    as one block in as many steps as tokens): the counts (hits, trials) of problems solved by d1's rule and of
    answers that use exactly the given numbers."""
    n_tokens = answer_tokens(plan)
    t0 = time.time()
    _, records = evaluate(model, tokenizer, heldout_items(heldout), "countdown",
                          SamplerOptions(gen_length=n_tokens, steps=n_tokens, block_length=n_tokens),
                          batch_size=batch_size, prompt_style="plain")
    correct = [int(r["correct"]) for r in records]
    numbers_ok = [int(uses_the_numbers(r["generation"], r["numbers"])) for r in records]
    return dict(counts=dict(acc=(sum(correct), len(records)), numbers_ok=(sum(numbers_ok), len(records))),
                n_problems=len(records), correct=correct, answers=[last_boxed(r["generation"]) for r in records],
                eval_s=time.time() - t0)


def describe_heldout(plan, e):
    return (f"{e['n_problems']} problems with {plan.ft_numbers} numbers in {plan.number_range}, none of whose "
            "(numbers, target) is in any training set. solved = d1's rule (eval.grade_countdown: the boxed "
            "expression uses exactly the given numbers and evaluates to the target); uses the numbers = its first half "
            "alone; SE = binomial standard error of one run's accuracy on this held-out set")


def position_classes(expression, n_tokens):
    """What each answer token holds: the fixed "<answer>\\boxed{" (prefix), the expression's digits, operators and
    parentheses, the fixed "}</answer>" (suffix), and the <|eot_id|> padding."""
    labels = ["prefix"] * len(PREFIX)
    labels += ["digit" if c.isdigit() else "operator" if c in PRECEDENCE else "parenthesis" for c in expression]
    labels += ["suffix"] * len(SUFFIX)
    return labels + ["eot"] * (n_tokens - len(labels))


def answer_rows(tokenizer, problems, plan):
    """[(ids, prompt_len)] of the problems as gift.train builds them, and each answer token's label
    (position_classes; the figures' masks.json)."""
    n_tokens = answer_tokens(plan)
    return examples(tokenizer, problems, n_tokens), [position_classes(p["expression"], n_tokens) for p in problems]


@torch.no_grad()
def entropy_by_position(model, tokenizer, problems, plan, batch_size=64):
    """Which answer positions get high entropy. gift.entropy_betas (Algorithm 1: the whole answer masked,
    beta_i = H_i^0.5) on fine-tuning problems, grouped by what the position holds (position_classes; "pad" = the
    <|endoftext|> that collate adds after a row shorter than the batch's longest), by the character's index in
    the expression, the share of each row's k highest betas (k = its expression's length) that fall in the
    expression, and the expression's mean r_i = beta_i / beta_ref (GIFT's masking-rate multiplier, Theorem 1)."""
    model.eval()
    n_tokens = answer_tokens(plan)
    sums = {c: [0.0, 0] for c in CLASSES}
    sums.update(ratio_expression=[0.0, 0], topk_expression=[0.0, 0])
    by_index = {}  # str keys: the result goes through JSON
    for start in range(0, len(problems), batch_size):
        chunk = problems[start:start + batch_size]
        rows = examples(tokenizer, chunk, n_tokens)
        input_ids, answer_mask = collate(rows, model.config.pad_token_id)  # (B, L), (B, L)
        beta = gift.first_pass_betas(model, "entropy", input_ids, answer_mask, model.config.mask_token_id)  # (B, L)
        for row, (problem, (_, prompt_len)) in enumerate(zip(chunk, rows)):
            labels = position_classes(problem["expression"], n_tokens)
            labels += ["pad"] * (input_ids.shape[1] - prompt_len - n_tokens)
            b_answer = beta[row, prompt_len:]  # (answer positions,)
            assert tokenizer.decode(input_ids[row, prompt_len:prompt_len + len(labels) - labels.count("pad")].tolist(),
                                    skip_special_tokens=True) == PREFIX + problem["expression"] + SUFFIX
            for label, value in zip(labels, b_answer.tolist()):
                sums[label][0] += value
                sums[label][1] += 1
            in_expression = torch.tensor([label in ("digit", "operator", "parenthesis") for label in labels])
            k = int(in_expression.sum())
            beta_ref = float(b_answer.mean())
            if beta_ref > 0:
                sums["ratio_expression"][0] += float(b_answer[in_expression].sum()) / beta_ref
                sums["ratio_expression"][1] += k
            top = torch.topk(b_answer, k).indices
            sums["topk_expression"][0] += float(in_expression[top].float().mean())
            sums["topk_expression"][1] += 1
            for i, value in enumerate(b_answer[in_expression].tolist()):
                by_index.setdefault(str(i), [0.0, 0])
                by_index[str(i)][0] += value
                by_index[str(i)][1] += 1
    mean = {k: (s / n if n else math.nan) for k, (s, n) in sums.items()}
    return dict(beta={c: mean[c] for c in CLASSES}, count={c: sums[c][1] for c in CLASSES},
                ratio_expression=mean["ratio_expression"], topk_expression_share=mean["topk_expression"],
                beta_by_index={k: s / n for k, (s, n) in by_index.items()},
                count_by_index={k: n for k, (_, n) in by_index.items()})


def nan_mean(values):
    values = [v for v in values if not math.isnan(v)]
    return statistics.mean(values) if values else math.nan


def entropy_markdown(plan, rows):
    """The entropy tables of results.md. rows: [(step, [entropy_by_position results, one per model])]."""
    def f(x, digits=3):
        return "-" if math.isnan(x) else f"{x:.{digits}f}"
    lines = ["", "## Which answer positions have high entropy", "",
             f"gift.entropy_betas on {plan.n_entropy} fine-tuning problems (the whole answer masked, Algorithm 1). "
             "Step 0 is the base models (= GIFT*'s fixed betas); later rows are gift's models along training, "
             "averaged over bases and seeds. Mean beta on the expression's digits, operators and parentheses, on the "
             f"fixed `{PREFIX}` and `{SUFFIX}`, on the `<|eot_id|>` padding and on the `<|endoftext|>` pads of rows "
             "shorter than their batch's longest; top-k share = fraction of each answer's k highest betas (k = its "
             "expression's length) that are expression characters; r expr = mean beta_i / beta_ref on the expression "
             "(how much more often GIFT masks it than SFT's uniform rate would suggest).", "",
             "| step | " + " | ".join(CLASSES) + " | top-k share | r expr |", "|---|" + "---|" * (len(CLASSES) + 2)]
    for step, stats in rows:
        cells = [f(nan_mean([s["beta"][c] for s in stats])) for c in CLASSES]
        cells += [f(nan_mean([s["topk_expression_share"] for s in stats]), 2),
                  f(nan_mean([s["ratio_expression"] for s in stats]), 2)]
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    width = max(int(k) for _, stats in rows for s in stats for k in s["beta_by_index"]) + 1
    lines += ["", "By the character's position in the expression (1 = its first character), mean beta; the last row "
              "counts the characters at each position:", "",
              "| step | " + " | ".join(str(i + 1) for i in range(width)) + " |", "|---|" + "---|" * width]
    for step, stats in rows:
        cells = [f(nan_mean([s["beta_by_index"].get(str(i), math.nan) for s in stats])) for i in range(width)]
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    lines.append("| count | " + " | ".join(str(rows[0][1][0]["count_by_index"].get(str(i), 0)) for i in range(width))
                 + " |")
    return lines

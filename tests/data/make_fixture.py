"""Cut the grader fixture in tests/data from the full benchmark data and d1's stored generations.

    python tests/data/make_fixture.py --data ../shared/data --d1 PATH/TO/d1

--data  the folder holding d1_generations/, gsm8k_test.jsonl, math500_test.jsonl, countdown_cd3_test.jsonl,
        sudoku_4x4_test.csv, d1_prompts.json and SOURCES.md (default: $GIFT_DATA, else ../shared/data beside the repo)
--d1    a checkout of github.com/dllm-reasoning/d1 at commit 837888f22c21a5da91a0af2b0d7b19e81d9b47ec. d1's stored
        generation files hold no per-item verdicts, so this script grades every stored generation with d1's own
        code (eval/parse_and_get_acc.py and eval/parser_helper.py, checked by sha256), and the fixture stores that
        verdict. It does not import the repository's eval.py: the fixture is what eval.py is tested against.
--out   where to write (default: this folder)

What it writes (see README.md): d1_{task}.jsonl, a few hundred of d1's generations per task with d1's verdicts,
chosen so that every answer-extraction path the data holds appears, each with right and wrong verdicts where the
data has both; gsm8k_test.jsonl and math500_test.jsonl cut to the problems those rows ask (lines kept byte for
byte, in the original order); and countdown_cd3_test.jsonl, sudoku_4x4_test.csv, d1_prompts.json copied whole.

Deterministic: the same inputs give byte-identical files (a fixed seed, sorted groups, no clocks).
"""

import argparse
import glob
import hashlib
import importlib.util
import json
import os
import random
import re
import shutil
import sys
import types
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

TASKS = ("sudoku", "countdown", "gsm8k", "math500")
GEN_LENGTHS = (128, 256, 512)
D1_COMMIT = "837888f22c21a5da91a0af2b0d7b19e81d9b47ec"
D1_CODE_SHA256 = {
    "eval/parse_and_get_acc.py": "f005055bd925467fb42517eb13e46ad76d102915ea410c8bbd786ba4b1f598bf",
    "eval/parser_helper.py": "0417d0d59b1379116dc1462a2c78a479fbcdbf054e88c66701540167384cadd2",
}
DATA_SHA256 = {  # ../shared/data/SOURCES.md
    "gsm8k_test.jsonl": "3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14",
    "math500_test.jsonl": "35dc41080a3680858b27fa7e0533d2d547825316fc5dafe5d316f4ccc5a06132",
    "sudoku_4x4_test.csv": "ef86c7c28ebef88484d85fda59b3909a7b621241aa1abf36343437dbc4a3ffb6",
    "countdown_cd3_test.jsonl": "9916f614621e26fb2b035ed4ea641e35e4fff0d533bb9b9c7bcaaa61017d88c6",
}
# d1's rules on exactly these files (d1 paper Table 1; GSM8K on the 1130 stored problems), gen length 128/256/512
PUBLISHED = dict(math500=(26.0, 32.4, 36.2), countdown=(20.7, 19.5, 16.0), sudoku=(11.7, 6.7, 5.5),
                 gsm8k=(69.3, 76.4, 78.1))

SEED = 20
PER_GROUP = 4  # rows kept from every (extraction path, verdict) group, whatever their gen length
PER_LENGTH = dict(sudoku=65, countdown=65, gsm8k=45, math500=50)  # then filled at random up to this many per length


def sha256(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def load_d1_code(d1):
    """d1's parse_and_get_acc module. tiktoken (used there only to count tokens, and which fetches its encoding from
    the network) is replaced by a stub: the verdicts do not depend on it."""
    for rel, want in D1_CODE_SHA256.items():
        if not (d1 / rel).exists():
            sys.exit(f"{d1 / rel} not found: --d1 must name a checkout of github.com/dllm-reasoning/d1")
        if sha256(d1 / rel) != want:
            sys.exit(f"{d1 / rel}: not the file of d1 commit {D1_COMMIT} (sha256 differs)")
    stub = types.ModuleType("tiktoken")
    stub.get_encoding = lambda name: types.SimpleNamespace(encode=lambda text: text.split())
    sys.modules.setdefault("tiktoken", stub)
    sys.path.insert(0, str(d1 / "eval"))
    spec = importlib.util.spec_from_file_location("d1_parse_and_get_acc", d1 / "eval" / "parse_and_get_acc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.strip_string = importlib.import_module("parser_helper").strip_string  # for path_math500
    return module


def d1_files(data, task, gen_length):
    files = sorted(glob.glob(str(data / "d1_generations" / f"{task}_instruct_{gen_length}_*_generations.json")))
    assert files, f"no d1 generations for {task} {gen_length} under {data / 'd1_generations'}"
    return files


def signed_gsm8k_golds(data):
    """question -> the gold after '####' with its sign (d1's regex drops it: its gold is None for -10 and -3), and
    question -> whether that gold is written with a thousands comma."""
    golds, commas = {}, {}
    for line in open(data / "gsm8k_test.jsonl", encoding="utf-8"):
        row = json.loads(line)
        m = re.search(r"####\s*\$?(-?[\d,]+(?:\.\d+)?)", row["answer"])
        golds[row["question"]] = float(m.group(1).replace(",", ""))
        commas[row["question"]] = "," in m.group(1)
    return golds, commas


# -----------------------------------------------------------------------------
# Which extraction path a generation takes under d1's rules: used only to choose rows, so that every path appears.


def _last_box(d1, text):
    try:
        return d1.remove_boxed(d1.last_boxed_only_string(text))
    except Exception:
        return None


def path_gsm8k(d1, row, gold_has_comma):
    g = row["generations"]
    boxes = re.findall(r"\\boxed{(.*?)}", g)
    source = None
    for box in boxes:
        box = box.strip()
        if not box or box == "..." or re.match(r"^\.+$", box):
            continue
        try:
            float(box)
            source = "box-float"
        except ValueError:
            source = "box-first-number" if re.findall(r"-?\d+\.?\d*", box) else None
        if source:
            break
    if source is None:
        m = re.search(r"<answer>(.*?)</answer>", g, re.DOTALL)
        text = m.group(1).strip() if m else ""
        try:
            float(text)
            source = "tag-float"
        except ValueError:
            source = "tag-last-number" if re.findall(r"-?\d+\.?\d*", text) else "no-answer"
        if boxes:
            source = "box-without-number," + source
    flags = [source]
    flags += ["several-boxes"] if len(boxes) > 1 else []
    flags += ["box-across-lines"] if g.count("\\boxed{") > len(boxes) else []
    flags += ["gold-none"] if row["ground_truth"] is None else []
    flags += ["gold-comma"] if gold_has_comma else []
    return flags


def path_math500(d1, row, parsed):
    g, gold = row["generations"], row["ground_truth"]
    if "\\boxed " in g:
        source = "boxed-space"
    elif "\\boxed" in g:
        source = "box" if d1.last_boxed_only_string(g) is not None else "box-unclosed"
    elif "\\fbox" in g:
        source = "fbox"
    else:
        source = "no-box-whole-text"
    box = _last_box(d1, g)
    flags = [source]
    flags += ["answer-tag-fallback"] if not box and re.search(r"<answer>(.*?)</answer>", g, re.DOTALL) else []
    for name, s in (("strip-fails-answer", parsed), ("strip-fails-gold", gold)):
        try:
            if s is not None:
                d1.strip_string(s)
        except Exception:
            flags.append(name)
    flags += ["no-answer"] if parsed is None else []
    try:
        if parsed is not None and parsed != gold and d1.strip_string(parsed) == d1.strip_string(gold):
            flags.append("equal-after-normalising")
    except Exception:
        pass
    return flags


def path_countdown(d1, row, item):
    g = row["generations"]
    if d1.last_boxed_only_string(g) is None:
        source = "box-unclosed," + ("answer-tag" if re.search(r"<answer>(.*?)</answer>", g, re.DOTALL)
                                    else "whole-text")
    elif "\\boxed " in g:
        source = "boxed-space"
    elif "\\boxed" in g or "\\fbox" in g:
        source = "box"
    else:
        source = "no-box-whole-text"
    raw = _last_box(d1, g) or ""
    flags = [source]
    flags += ["latex-operator"] if any(op in raw for op in ("\\div", "\\times", "\\cdot")) else []
    flags += ["equals-sign"] if "=" in raw else []
    result = item["evaluation_result"]
    flags += ["numbers-not-the-given"] if result is None else []
    flags += ["not-evaluable"] if result == float("inf") else []
    return flags


SUDOKU_PATTERNS = (
    r"<answer>.*?```\s*([\d\s]+)```",
    r"<answer>(.*?)(?:<\|eot_id\|>|<\|endoftext\|>|</answer>)",
    r"</answer>\s*(.*?)(?:<\|eot_id\|>|<\|endoftext\|>|$)",
    r".*?(\d{16})\s*</answer>",
    r"\b(\d{16})\b",
)


def path_sudoku(d1, row, item):
    source = "no-answer"
    for i, pattern in enumerate(SUDOKU_PATTERNS):
        m = re.search(pattern, row["generations"], re.DOTALL)
        if m and m.group(1).strip():
            source = f"pattern-{i}"
            break
    answer = re.sub(r"\s", "", m.group(1).strip()) if source != "no-answer" else ""
    size = "empty" if not answer else "short" if len(answer) < 16 else "long" if len(answer) > 16 else "16"
    cells = item["correct_cells"]
    score = "none" if cells == 0 else "all" if cells == item["empty_cells"] else "some"
    return [source, size, score]


# -----------------------------------------------------------------------------


def grade_all(d1, data, task, golds, commas):
    """Every stored row of one task, with d1's verdict and its extraction path."""
    parse = dict(gsm8k=d1.parse_gsm_answers, math500=d1.parse_math_answers, countdown=d1.parse_countdown_answers,
                 sudoku=d1.parse_sudoku_answers)[task]
    out = []
    for gen_length, published in zip(GEN_LENGTHS, PUBLISHED[task]):
        got, total = 0, 0
        for f in d1_files(data, task, gen_length):
            stored = json.load(open(f, encoding="utf-8"))
            correct, processed, items, _ = parse(json_data=stored)  # Sudoku: correct and empty cells
            got, total = got + correct, total + processed
            for i, (row, item) in enumerate(zip(stored["generations"], items)):
                rec = dict(gen_length=gen_length, file=os.path.basename(f), row=i, question=row["question"],
                           ground_truth=row["ground_truth"], generation=row["generations"])
                if task == "sudoku":
                    rec.update(d1_correct_cells=item["correct_cells"], d1_empty_cells=item["empty_cells"])
                    path = path_sudoku(d1, row, item)
                else:
                    rec["d1_correct"] = bool(item["is_correct"])
                    if task == "gsm8k":
                        path = path_gsm8k(d1, row, commas[row["question"]])
                        if row["ground_truth"] is None:  # d1's rules with the gold's sign kept
                            signed = dict(row, ground_truth=golds[row["question"]])
                            rec["d1_correct_signed_gold"] = bool(
                                d1.parse_gsm_answers(json_data=dict(generations=[signed]))[2][0]["is_correct"])
                    elif task == "math500":
                        path = path_math500(d1, row, item["extracted_answer"])
                    else:
                        path = path_countdown(d1, row, item)
                    path.append("right" if rec["d1_correct"] else "wrong")
                out.append((rec, ",".join(path)))
        assert round(100 * got / total, 1) == published, (task, gen_length, 100 * got / total, published)
    return out


def choose(task, graded):
    """Every GSM8K row with a null gold, PER_GROUP rows of every path group, then rows at random up to PER_LENGTH per
    gen length. Returns the rows in file order and the paths they cover."""
    rng = random.Random(f"{SEED}-{task}")
    groups = defaultdict(list)
    for rec, path in graded:
        groups[path].append(rec)
    chosen = [rec for rec, _ in graded if task == "gsm8k" and rec["ground_truth"] is None]  # all 6: see README
    for key in sorted(groups):
        members = [rec for rec in groups[key] if id(rec) not in {id(c) for c in chosen}]
        chosen += rng.sample(members, min(PER_GROUP, len(members)))
    picked = {id(r) for r in chosen}
    asked = {r["question"] for r in chosen}
    for gen_length in GEN_LENGTHS:  # questions already asked first: the benchmark cut stays small
        rest = [rec for rec, _ in graded if rec["gen_length"] == gen_length and id(rec) not in picked]
        rest = rng.sample(rest, len(rest))
        rest.sort(key=lambda r: r["question"] not in asked)
        have = sum(r["gen_length"] == gen_length for r in chosen)
        chosen += rest[:max(0, PER_LENGTH[task] - have)]
    chosen.sort(key=lambda r: (r["gen_length"], r["file"], r["row"]))
    ids = {id(r) for r in chosen}
    return chosen, sorted({path for rec, path in graded if id(rec) in ids})


def cut_lines(src, dst, keep):
    """The lines of src for which keep(line index, JSON object) holds, byte for byte, in order."""
    with open(src, "rb") as f, open(dst, "wb") as out:
        n = 0
        for i, line in enumerate(f):
            if keep(i, json.loads(line)):
                out.write(line)
                n += 1
    return n


def main(argv=None):
    default_data = os.environ.get("GIFT_DATA") or REPO.parent / "shared" / "data"
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=Path(default_data))
    parser.add_argument("--d1", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=HERE)
    args = parser.parse_args(argv)
    data, out = args.data, args.out
    for name, want in DATA_SHA256.items():
        if sha256(data / name) != want:
            sys.exit(f"{data / name}: sha256 differs from SOURCES.md")
    d1 = load_d1_code(args.d1)
    golds, commas = signed_gsm8k_golds(data)
    out.mkdir(parents=True, exist_ok=True)
    questions = {}
    for task in TASKS:
        chosen, paths = choose(task, grade_all(d1, data, task, golds, commas))
        with open(out / f"d1_{task}.jsonl", "w", encoding="utf-8") as f:
            for rec in chosen:
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        questions[task] = {r["question"] for r in chosen}
        print(f"{task}: {len(chosen)} rows, {len(paths)} extraction paths x verdicts")
    n = cut_lines(data / "gsm8k_test.jsonl", out / "gsm8k_test.jsonl",  # line 0 too: a test reads it
                  lambda i, row: i == 0 or row["question"] in questions["gsm8k"])
    print(f"gsm8k_test.jsonl: {n} lines")
    n = cut_lines(data / "math500_test.jsonl", out / "math500_test.jsonl",
                  lambda i, row: row["problem"] in questions["math500"])
    print(f"math500_test.jsonl: {n} lines")
    for name in ("countdown_cd3_test.jsonl", "sudoku_4x4_test.csv", "d1_prompts.json"):
        shutil.copyfile(data / name, out / name)


if __name__ == "__main__":
    main()

"""Are two runs of experiments/gift_vs_sft.py the same, bit for bit? Compares the data files and every base and
fine-tuning run that both output folders hold: the settings, the weights (a hash of each model file) and every
number the tables are made from (losses, betas, each held-out answer and grade, the entropy analysis). Times and
commits are not compared (they are expected to differ).

    python experiments/compare_runs.py runs/sudoku-gift-vs-sft runs/one   # the full study against one row rerun

Prints one line per base and run, and exits with status 1 if anything differs (0 if all that is shared is equal).
"""

import hashlib
import json
import sys
from pathlib import Path

from gift_vs_sft import without_paths  # the study beside this file: a spec without its file locations

TIMES = ("train_s", "step_time_s", "loop_s", "eval_s")  # fields of base.json / result.json (and of base.json's eval)


def file_hash(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def models(folder):
    """{relative path: hash} of every model.safetensors under folder (a base's initial and trained weights, a run's
    kept models)."""
    return {str(p.relative_to(folder)): file_hash(p) for p in sorted(folder.rglob("model.safetensors"))}


def without_times(record):
    return {k: (without_times(v) if isinstance(v, dict) else v) for k, v in record.items() if k not in TIMES}


def differences(a_json, b_json):
    """The names of what differs between two result files (base.json or result.json) and their folders' models."""
    a, b = (without_times(json.loads(p.read_text())) for p in (a_json, b_json))
    diff = ["settings"] if without_paths(a["spec"]) != without_paths(b["spec"]) else []
    diff += [f for f in sorted(set(a) | set(b)) if f not in ("spec", "commit") and a.get(f) != b.get(f)]
    if models(a_json.parent) != models(b_json.parent):
        diff.append("model weights")
    return diff


def shared(a, b, pattern):
    return sorted(p.relative_to(a) for p in a.glob(pattern) if (b / p.relative_to(a)).exists())


def data_differences(a, b):
    """The files of a's data/ folder that b's data/ holds with other contents."""
    return [p.name for p in sorted((a / "data").glob("*"))
            if (b / "data" / p.name).exists() and file_hash(p) != file_hash(b / "data" / p.name)]


def compare(a, b):
    """[(item, [what differs])] for every base and run that both folders hold (none: []), after their data."""
    results = shared(a, b, "base*/base.json") + shared(a, b, "runs/*/*/result.json")
    if not results:
        return []
    return [("data", data_differences(a, b))] + [(str(rel.parent), differences(a / rel, b / rel)) for rel in results]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0].startswith("-"):
        raise SystemExit("usage: python experiments/compare_runs.py OUT_A OUT_B (two --out folders of gift_vs_sft.py)")
    a, b = Path(argv[0]), Path(argv[1])
    for folder in (a, b):
        if not folder.is_dir():
            raise SystemExit(f"{folder}: no such folder")
    items = compare(a, b)
    if not items:
        raise SystemExit(f"{a} and {b} share no base and no run")
    for item, diff in items:
        print(f"{item}: {'identical' if not diff else 'DIFFERS in ' + ', '.join(diff)}")
    n_diff = sum(bool(d) for _, d in items)
    print(f"{len(items) - n_diff} of {len(items)} identical")
    return 1 if n_diff else 0


if __name__ == "__main__":
    sys.exit(main())

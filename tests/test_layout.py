"""The repository's layout. The five card files (model.py, data.py, sample.py, eval.py, gift.py) hold the card;
each capability beyond it is one flat file beside them, which imports them. Every top-level file has its place in
ORDER and imports only files below it (every import counts, the ones inside functions too: a lazy import is still a
cycle), so harness.py, on top, is imported by none; a card file imports a capability's file only where the card's own
job needs it (CARD_USES); and sample.py's exact sampler, the part readers copy, imports only torch and model.py.
Also: every script under bench/ and experiments/ imports without starting work and names only what the top-level
files define (a script calling a function that was moved or renamed fails here, not in a user's hands hours into a
run)."""

import ast
import importlib
import importlib.util
import sys
from pathlib import Path

import pytest
from conftest import REPO

# bottom to top: a file may import only the files before it (a new top-level file must be given its place here)
ORDER = ("model", "adapters", "dream", "data", "longjob", "sample", "cached_sample", "eval", "embedded", "gift",
         "harness", "rl")
CARD = ("model", "data", "sample", "eval", "gift")
# the capability files a card file may import (the long-job machinery and the PEFT files are every card file's)
CARD_USES = dict(data={"dream"}, sample={"dream"}, eval={"cached_sample"}, gift={"embedded"})
MACHINERY = {"longjob", "adapters"}
EXACT_SAMPLER_END = "# The options of every sampler"  # sample.py: the exact sampler is everything above this banner
EXACT_SAMPLER_IMPORTS = {"torch", "torch.nn.functional", "model"}


# -----------------------------------------------------------------------------
# The import graph of the top-level files


def imports(tree):
    """[(module as written, line)] for every import statement anywhere in the tree (functions, try / if blocks)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, node.lineno))
    return found


def import_edges(folder):
    """{module: {imported module: first line}} for the .py files directly in `folder`: every import statement
    anywhere in each file, kept when it names another of these files."""
    files = {p.stem: p for p in sorted(Path(folder).glob("*.py"))}
    edges = {}
    for name, path in files.items():
        edges[name] = {}
        for module, line in imports(ast.parse(path.read_text(), str(path))):
            target = module.split(".")[0]
            if target in files and (target not in edges[name] or line < edges[name][target]):
                edges[name][target] = line
    return edges


def find_cycles(edges):
    """One cycle per back edge of a depth-first search, each as its path [a, b, ..., a]; [] when there is none."""
    cycles, state, path = [], {}, []

    def visit(name):
        state[name] = "open"
        path.append(name)
        for target in sorted(edges.get(name, ())):
            if state.get(target) == "open":  # a back edge: the path from target to here, and back
                cycles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target)
        path.pop()
        state[name] = "done"

    for name in sorted(edges):
        if name not in state:
            visit(name)
    return cycles


def exact_sampler_errors(folder):
    """sample.py's exact sampler (above EXACT_SAMPLER_END) importing anything but torch and model.py."""
    path = Path(folder) / "sample.py"
    if not path.exists():
        return []
    text = path.read_text()
    end = text[:text.index(EXACT_SAMPLER_END)].count("\n") + 1 if EXACT_SAMPLER_END in text else None
    if end is None:
        return [f"sample.py: no banner {EXACT_SAMPLER_END!r} ending the exact sampler"]
    return [f"sample.py:{line}: the exact sampler imports {module} (only torch and model.py)"
            for module, line in imports(ast.parse(text)) if line < end and module not in EXACT_SAMPLER_IMPORTS]


def layout_errors(folder):
    """What breaks the intended order in `folder`'s top-level files, one string per cycle or forbidden edge, each
    naming its files and lines ('gift.py:2032 -> eval'); [] when the layout holds."""
    edges = import_edges(folder)

    def edge(a, b):
        return f"{a}.py:{edges[a][b]} -> {b}"

    errors = [f"cycle {' -> '.join(c)} ({', '.join(edge(a, b) for a, b in zip(c, c[1:]))})"
              for c in find_cycles(edges)]
    for name, targets in sorted(edges.items()):
        if name not in ORDER:
            errors.append(f"{name}.py has no place in the layout: add it to ORDER")
            continue
        above = sorted(t for t in targets if t in ORDER and ORDER.index(t) > ORDER.index(name))
        if above:
            errors.append(f"{name}.py imports a file above it: {', '.join(edge(name, t) for t in above)}")
        if name in CARD:
            extra = sorted(t for t in targets if t not in CARD and t not in MACHINERY | CARD_USES.get(name, set()))
            if extra:
                errors.append(f"{name}.py, a card file, imports a capability's file: "
                              f"{', '.join(edge(name, t) for t in extra)}")
    return errors + exact_sampler_errors(folder)


def test_the_top_level_files_import_in_one_direction():
    """Every file in its place, no cycle (not even through an import inside a function), the card files importing
    only the capabilities their job needs, the exact sampler only torch and model.py."""
    errors = layout_errors(REPO)
    assert not errors, "import layout: " + "; ".join(errors)


def test_every_top_level_file_has_its_line_in_the_readme():
    """Each top-level file's job is one row of the README's table (`| `name.py` | ... |`)."""
    readme = (REPO / "README.md").read_text()
    missing = [p.name for p in sorted(REPO.glob("*.py")) if f"| `{p.name}` |" not in readme]
    assert not missing, f"README.md's table has no row for {', '.join(missing)}"


def write_files(folder, files):
    for name, text in files.items():
        (folder / f"{name}.py").write_text(text)
    return folder


# the intended layout, each kind of import once: module level, in a function, in try / if blocks, `import a.b`
GOOD = dict(model="import math\n",
            adapters="from model import m\n",
            dream="import torch\nfrom model import m\n",
            data="import json\n\ndef config():\n    from dream import d  # here, not at the top\n",
            longjob="import data\ntry:\n    import model.sub\nexcept ImportError:\n    pass\nimport adapters\n",
            sample="import torch\nimport torch.nn.functional as F\nfrom model import y\n"
                   f"{EXACT_SAMPLER_END}\nfrom longjob import x\nimport dream\n",
            cached_sample="from sample import generate\n",
            eval="import sample, data\nif True:\n    from longjob import z\nimport cached_sample\n",
            embedded="import eval\n",
            gift="import sample\n\ndef main():\n    from embedded import evaluate\n",
            harness="import eval, sample\nfrom longjob import run_command_line\n")


def test_the_checker_passes_the_intended_layout(tmp_path):
    """On files laid out as intended (imports at every depth), the checker finds nothing, and it sees every edge."""
    folder = write_files(tmp_path, GOOD)
    assert layout_errors(folder) == []
    assert {a: set(b) for a, b in import_edges(folder).items()} == dict(
        model=set(), adapters={"model"}, dream={"model"}, data={"dream"}, longjob={"data", "model", "adapters"},
        sample={"model", "longjob", "dream"}, cached_sample={"sample"}, eval={"sample", "data", "longjob",
        "cached_sample"}, embedded={"eval"}, gift={"sample", "embedded"}, harness={"eval", "sample", "longjob"})


def test_the_checker_finds_a_cycle_through_a_function_level_import(tmp_path):
    """A cycle closed by an import inside a function is a cycle, reported with its path and lines (with the edge
    that runs up the order)."""
    folder = write_files(tmp_path, dict(GOOD, embedded="def f():\n    if True:\n        import gift\n"))
    errors = layout_errors(folder)
    assert "cycle embedded -> gift -> embedded (embedded.py:3 -> gift, gift.py:4 -> embedded)" in errors
    assert "embedded.py imports a file above it: embedded.py:3 -> gift" in errors


BROKEN = dict(  # each rule broken once: (the file's new text, the message)
    model=("def f():\n    import data\n", "model.py imports a file above it: model.py:2 -> data"),
    data=("import model\nimport longjob\n", "data.py imports a file above it: data.py:2 -> longjob"),
    sample=(GOOD["sample"] + "import cached_sample\n",
            "sample.py, a card file, imports a capability's file: sample.py:7 -> cached_sample"),
    eval=("import sample\ntry:\n    import harness\nexcept ImportError:\n    pass\n",
          "eval.py imports a file above it: eval.py:3 -> harness"),
    gift=("import sample\n\ndef main():\n    from harness import GiftLM\n",
          "gift.py imports a file above it: gift.py:4 -> harness"),
    notes=("import os\n", "notes.py has no place in the layout: add it to ORDER"),
    dream=("import torch\nimport data\n", "dream.py imports a file above it: dream.py:2 -> data"))


@pytest.mark.parametrize("name", list(BROKEN))
def test_the_checker_names_an_edge_against_the_order(tmp_path, name):
    """Each rule of the order, broken once: the message names the file, its line and the module it imports (and,
    every such edge closing a loop here, the cycle too)."""
    text, expected = BROKEN[name]
    errors = layout_errors(write_files(tmp_path, dict(GOOD, **{name: text})))
    assert expected in errors
    culprit = expected.rsplit(": ", 1)[1]  # the edge, 'sample.py:7 -> cached_sample' (or the file's own rule)
    assert all(culprit in e or e.startswith("cycle ") for e in errors), errors


@pytest.mark.parametrize("bad", ["from data import encode\n", "import longjob\n", "    import json\n"])
def test_the_exact_sampler_imports_only_torch_and_model(tmp_path, bad):
    """An import of anything but torch and model.py above the banner, at any depth, is named with its line."""
    text = "import torch\nfrom model import y\n" + ("def f():\n" if bad.startswith(" ") else "") + bad
    folder = write_files(tmp_path, dict(GOOD, sample=text + GOOD["sample"].split("import y\n", 1)[1]))
    module = bad.split()[1]
    assert layout_errors(folder) == [f"sample.py:{3 + bad.startswith(' ')}: the exact sampler imports {module} "
                                     "(only torch and model.py)"]


# -----------------------------------------------------------------------------
# The scripts under bench/ and experiments/: they import without work, and name what exists

PROJECT = sorted(p.stem for p in REPO.glob("*.py"))
SCRIPTS = sorted(p.relative_to(REPO).as_posix() for folder in ("bench", "experiments")
                 for p in (REPO / folder).rglob("*.py"))
SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef, ast.ListComp, ast.SetComp, ast.DictComp,
          ast.GeneratorExp)


def scope_bindings(scope, project):
    """{name: {project module M}} for the names `scope` binds by `import M` / `import M as name`, {name: None} for
    the names it binds otherwise (assignments, arguments, defs, `from M import name`, loop and `as` targets)."""
    bound = {}

    def bind(name, module=None):
        previous = bound.get(name, set())
        bound[name] = None if module is None or previous is None else previous | {module}

    if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        a = scope.args
        for arg in a.posonlyargs + a.args + a.kwonlyargs + [x for x in (a.vararg, a.kwarg) if x]:
            bind(arg.arg)
    if isinstance(scope, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
        todo = list(ast.iter_child_nodes(scope))  # the loop targets are the comprehension's own
    else:
        todo = list(scope.body) if isinstance(scope.body, list) else [scope.body]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bind(node.name)  # its body is its own scope
            continue
        if isinstance(node, SCOPES):
            continue
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            bind(node.id)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                module = top if top in project and (alias.asname is None or "." not in alias.name) else None
                bind(alias.asname or top, module)
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                bind(alias.asname or alias.name)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bind(node.name)
        todo.extend(ast.iter_child_nodes(node))
    return bound


def project_names(tree, project):
    """[(module, name, line)] for every `M.name` whose M is a project module in its scope (bound by `import M`, not a
    variable that happens to be called `model` or `data`), and every `from M import name`, M one of `project`."""
    found = []

    def visit(node, chain):  # chain: [(bindings, is a class body)], innermost scope first
        if isinstance(node, SCOPES):  # a class body's names are not seen by the scopes inside it
            chain = [(scope_bindings(node, project), isinstance(node, ast.ClassDef))] + [
                (bound, is_class) for bound, is_class in chain if not is_class]
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            modules = next((bound[node.value.id] for bound, _ in chain if node.value.id in bound), None)
            if modules and len(modules) == 1:  # the name is a project module here, and only that one
                found.append((next(iter(modules)), node.attr, node.lineno))
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in project:
            found.extend((node.module, alias.name, node.lineno) for alias in node.names if alias.name != "*")
        for child in ast.iter_child_nodes(node):
            visit(child, chain)

    for node in tree.body:
        visit(node, [(scope_bindings(tree, project), False)])
    return found


class AnyField(dict):
    """str.format_map's fields for a template of code: each one reads as 0 (`{cfg!r}` -> '0')."""

    def __missing__(self, key):
        return 0


def code_in_strings(tree):
    """[(tree, line)] for the Python code a script holds in a string (a worker it runs with `python -c`), parsed as
    it is or as a str.format template ({field} -> 0, {{ -> {), with the line the string starts at (its line 1)."""
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str) and "import" in node.value):
            continue
        for text in (lambda: node.value, lambda: node.value.format_map(AnyField())):
            try:
                found.append((ast.parse(text()), node.lineno))
                break
            except (SyntaxError, ValueError, LookupError, AttributeError, TypeError):  # prose, or no template
                continue
    return found


def test_the_name_finder_tells_modules_from_variables():
    """`model.X` is a project name only where `model` is the module (a variable called model is common); the
    function-level and aliased imports count, and so do `from M import X` at any depth and the code a script keeps in
    a string (tune_embedded.py's worker, a str.format template run with `python -c`)."""
    tree = ast.parse("import gift\nimport eval as E\nfrom model import LLaDA\n"
                     "def f(model):\n    return model.parameters(), gift.train, E.evaluate\n"
                     "def g():\n    import model\n    return model.LLaDA, [data.x for data in ()]\n"
                     "def h():\n    from data import encode as enc\n    gift = 1\n    return gift.real\n"
                     "gift.patched = 1\n"
                     "WORKER = \'\'\'\nimport json, gift\ncfg = json.loads({cfg!r})\n"
                     "gift.X.update(cfg.get(1, {{}}))\n\'\'\'\n")
    project = {"gift", "eval", "model", "data"}
    assert sorted(project_names(tree, project)) == [
        ("data", "encode", 10), ("eval", "evaluate", 5), ("gift", "patched", 13), ("gift", "train", 5),
        ("model", "LLaDA", 3), ("model", "LLaDA", 8)]
    # a worker's code in a str.format template: its names count too, at their line in the string
    [(code, at)] = code_in_strings(tree)
    assert at == 14 and project_names(code, project) == [("gift", "X", 4)]


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_script_imports_without_work_and_names_what_exists(script, monkeypatch, capsys):
    """The script, imported by its path with its own folder first on sys.path (as `python <script>` runs it), starts
    no work (it keeps its work under `if __name__ == "__main__":`, and prints nothing), and every name it takes from a
    top-level file (`gift.X`, `from eval import X`, in any function) exists there."""
    path = REPO / script
    monkeypatch.setattr(sys, "path", [str(path.parent), str(REPO)] + sys.path)
    name = "layout_" + script.replace("/", "_").removesuffix(".py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    before = set(sys.modules)
    try:
        spec.loader.exec_module(module)
    finally:  # the sibling modules it imported (experiments/sudoku.py as `sudoku`, ...) go with it
        for other in set(sys.modules) - before:
            file = Path(getattr(sys.modules[other], "__file__", None) or "/").resolve()
            if file.is_relative_to(REPO / "bench") or file.is_relative_to(REPO / "experiments"):
                del sys.modules[other]
    assert capsys.readouterr().out == "", f"importing {script} printed: work ran outside `if __name__ == '__main__'`"
    tree = ast.parse(path.read_text())
    named = [(m, n, f"line {line}") for m, n, line in project_names(tree, PROJECT)]
    named += [(m, n, f"line {at + line - 1}, in the code of the string at line {at}")
              for code, at in code_in_strings(tree) for m, n, line in project_names(code, PROJECT)]
    missing = list(dict.fromkeys(f"{m}.{n} ({where})" for m, n, where in named
                                 if not hasattr(importlib.import_module(m), n)))
    assert not missing, f"{script} names what the top-level files do not define: {', '.join(missing)}"

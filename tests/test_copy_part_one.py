"""gift.py's Part I is copyable: its text, cut between its banners into a module outside the repository, uses only
math and torch and computes the repository's loss bit for bit, with this repo's LLaDA, with a plain torch model that
is not this repo's, and through the Hugging Face interface of the official LLaDA (`output_hidden_states=True`,
`.logits`, the `ff_out` head). And so is sample.py's exact sampler: its bannered section, copied beside a copy of
model.py, gives sample.generate's tokens on LLaDA and Dream, and its own uniforms draw what gift.py's do."""

import ast
import importlib
import importlib.util
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from conftest import REPO, assert_float32_close, model_depth, tiny_model

import gift
import sample

pytestmark = pytest.mark.numerics  # float32 against goldens and other code paths (conftest.py)


PART_ONE, PART_TWO = "# Part I. GIFT, the paper", "# Part II. Training"


@pytest.fixture(scope="module")
def copied(tmp_path_factory):
    """Part I's text (from its banner to Part II's), written to a fresh file and imported as the module `copied`."""
    text = (REPO / "gift.py").read_text()
    start, end = text.index(PART_ONE), text.index(PART_TWO)
    start, end = text.rindex("\n# ===", 0, start), text.rindex("\n# ===", 0, end)  # the banners' rule lines
    path = tmp_path_factory.mktemp("elsewhere") / "copied_gift_core.py"
    path.write_text(text[start:end])
    spec = importlib.util.spec_from_file_location("copied_gift_core", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, text[start:end]


def test_part_one_imports_only_math_and_torch(copied):
    module, text = copied
    imported = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module.split(".")[0])
    assert imported and imported <= {"math", "torch"}
    assert "../" not in text and "shared/" not in text  # cites the paper, not a path beside the repo
    for name in ("objective_batch", "diffusion_loss", "answer_entropy_and_nll", "entropy_betas", "OBJECTIVES"):
        assert hasattr(module, name), name
    assert not hasattr(module, "train_step") and not hasattr(module, "LLaDA")


class PlainLM(nn.Module):
    """Not this repo's model: an embedding, one bidirectional mixing layer (each position sees the sequence mean),
    and an LM head. It gives final hidden states (B, L, D) and a head, which is all Part I needs."""

    def __init__(self, vocab=40, d=16, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb, self.mix, self.lm_head = nn.Embedding(vocab, d), nn.Linear(2 * d, d), nn.Linear(d, vocab, bias=False)
        for p in self.parameters():
            nn.init.normal_(p, std=0.5, generator=g)

    def forward(self, ids):
        e = self.emb(ids)  # (B, L, D)
        return torch.tanh(self.mix(torch.cat([e, e.mean(1, keepdim=True).expand_as(e)], -1)))  # (B, L, D)


def batch(seed=3, B=3, L=14, vocab=38):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, L), generator=g)
    answer_mask = torch.arange(L)[None] >= torch.tensor([3, 6, 9])[:, None]  # (B, L)
    return ids, answer_mask


def loss_and_grads(core, model, hidden_of, head, ids, answer_mask, name, mask_id, seed=5, chunk_size=4):
    """Part I end to end with `core` (gift or the copy): the entropy pass when the objective needs betas, the noise,
    the loss (its default normalisation) and its gradients, the logits `chunk_size` positions at a time."""
    objective, betas_from, norm = core.OBJECTIVES[name]
    beta = None
    if betas_from is not None:
        with torch.no_grad():
            hidden = hidden_of(core.mask_answer(ids, answer_mask, mask_id))
        H, nll = core.answer_entropy_and_nll(hidden, head, ids, answer_mask, chunk_size)
        beta = nll if betas_from == "nll" else core.entropy_betas(H, answer_mask)
    noisy, weight = core.objective_batch(name, ids, answer_mask, torch.Generator().manual_seed(seed), mask_id, beta)
    loss = core.diffusion_loss(hidden_of(noisy), head, ids, noisy, weight, answer_mask, mask_id, norm,
                               chunk_size=chunk_size)
    grads = torch.autograd.grad(loss, [p for p in model.parameters()])
    return loss, grads


@pytest.mark.parametrize("name", gift.LOSSES)
def test_the_copy_equals_the_repo_on_a_model_that_is_not_ours(copied, name):
    module, _ = copied
    model, mask_id = PlainLM(), 39
    ids, answer_mask = batch()
    ours = loss_and_grads(gift, model, model, model.lm_head, ids, answer_mask, name, mask_id)
    theirs = loss_and_grads(module, model, model, model.lm_head, ids, answer_mask, name, mask_id)
    assert ours[0].item() > 0 and torch.equal(theirs[0], ours[0])
    assert all(torch.equal(a, b) for a, b in zip(theirs[1], ours[1]))


@pytest.mark.parametrize("name", ["sft", "gift", "nll"])
def test_the_copy_computes_train_steps_loss_bit_for_bit(copied, name):
    """gift.train_step on this repo's LLaDA (one micro-batch, one process) and the copied Part I on the same model's
    hidden states and head: the same loss, the same gradient norm, bit for bit. The copy runs train_step's own chunks
    (CE_CHUNK), so both sides are the same graph of the same kernels, equal on any CPU; with other chunks the head's
    gradient would add up in another order and could differ in the last bits (it did on an AMD EPYC)."""
    module, _ = copied
    model = tiny_model(7, std=0.2)
    ids, answer_mask = batch(vocab=46)
    step = gift.train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), [gift.MicroBatch(
        ids, answer_mask, torch.Generator().manual_seed(5))], name, grad_clip=0)

    def hidden_of(x):
        model.eval()  # train_step's first pass runs in eval mode (no dropout; this model has none)
        try:
            return model(x, return_hidden=True)
        finally:
            model.train()

    loss, grads = loss_and_grads(module, model, hidden_of, model.head, ids, answer_mask, name,
                                 model.config.mask_token_id, chunk_size=gift.CE_CHUNK)
    assert step["loss"] == loss.item()
    assert step["grad_norm"] == torch.nn.utils.get_total_norm(grads).item()


class HFStyleLLaDA(nn.Module):
    """The official Hugging Face LLaDA's interface around our LLaDA: model(ids, output_hidden_states=True) returns
    .logits and .hidden_states (the last one after ln_f), and the head is model.model.transformer.ff_out."""

    def __init__(self, llada):
        super().__init__()
        self.model = llada.model  # .transformer.{wte, blocks, ln_f, ff_out}, the official key names
        self.llada = llada

    def forward(self, input_ids, output_hidden_states=False):
        h = self.llada(input_ids, return_hidden=True)  # (B, L, D), after ln_f
        return SimpleNamespace(logits=self.model.transformer.ff_out(h), hidden_states=(None, h))


@pytest.mark.parametrize("name", ["sft", "gift", "gift-elbo"])
def test_the_copy_through_the_hugging_face_interface(copied, name):
    module, _ = copied
    llada = tiny_model(9, std=0.2)
    hf, mask_id = HFStyleLLaDA(llada), llada.config.mask_token_id
    ids, answer_mask = batch(vocab=46)
    head = hf.model.transformer.ff_out
    assert head is llada.head
    ours = loss_and_grads(gift, llada, lambda x: llada(x, return_hidden=True), llada.head, ids, answer_mask, name,
                          mask_id)
    by_hidden = loss_and_grads(module, hf, lambda x: hf(x, output_hidden_states=True).hidden_states[-1], head, ids,
                               answer_mask, name, mask_id)
    assert torch.equal(by_hidden[0], ours[0])
    # or the logits themselves (head=None): the head over every position instead of the selected ones
    by_logits = loss_and_grads(module, hf, lambda x: hf(x).logits, None, ids, answer_mask, name, mask_id)
    # the head over every position is another matrix product, summed in another order: float32 rounding apart
    # (conftest.float32_atol; twice the depth for the gradients, which go forward and back)
    depth = model_depth(llada.config)
    assert_float32_close(by_logits[0], ours[0], depth)
    for a, b in zip(by_logits[1], ours[1]):
        assert_float32_close(a, b, 2 * depth)


# -----------------------------------------------------------------------------
# sample.py's exact sampler, copied: its bannered section beside a copy of model.py

SAMPLER = "# The exact sampler"
SAMPLER_IMPORTS = {"math", "numbers", "torch", "model", "dataclasses"}  # the standard library, torch, model.py


def banner_section(path, title):
    """The section of the file `path` under the '# ===' banner whose first title line starts with `title`: from the
    banner's rule line to the next banner's rule line (the section's own closing rule, right under its title, kept)."""
    lines = path.read_text().splitlines(keepends=True)
    start = next((i - 1 for i, line in enumerate(lines)
                  if i and line.startswith(title) and lines[i - 1].startswith("# ===")), None)
    if start is None:
        pytest.fail(f"{path.name}: no '# ===' banner line followed by a line starting {title!r}", pytrace=False)
    body = start + 1
    while body < len(lines) and lines[body].startswith("#") and not lines[body].startswith("# ==="):
        body += 1  # the title's lines
    body += body < len(lines) and lines[body].startswith("# ===")  # and its closing rule
    end = next((i for i in range(body, len(lines)) if lines[i].startswith("# ===")), None)
    if end is None:
        pytest.fail(f"{path.name}: the section {title!r} ends at no '# ===' banner line", pytrace=False)
    return "".join(lines[start:end])


def imported_modules(text):
    imported = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or ".").split(".")[0])
    return imported


@pytest.fixture(scope="module")
def copied_sampler(tmp_path_factory):
    """sample.py's exact-sampler section, written to a fresh folder beside a copy of model.py and imported from
    there as `copied_sampler`, the repository's folder off sys.path: its `import model` reads the copy (sys.path and
    sys.modules["model"] are restored afterwards). Returns (the module, its text, the model.py copy it imported)."""
    text = banner_section(REPO / "sample.py", SAMPLER)
    folder = tmp_path_factory.mktemp("elsewhere_sampler")
    (folder / "copied_sampler.py").write_text(text)
    shutil.copy(REPO / "model.py", folder / "model.py")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "path", [str(folder)] + [p for p in sys.path if Path(p or ".").resolve() != REPO])
        mp.delitem(sys.modules, "model", raising=False)
        importlib.invalidate_caches()
        spec = importlib.util.spec_from_file_location("copied_sampler", folder / "copied_sampler.py")
        module = importlib.util.module_from_spec(spec)
        mp.setitem(sys.modules, "copied_sampler", module)
        spec.loader.exec_module(module)
        copied_model = sys.modules.get("model")
    return module, text, copied_model


def test_the_sampler_section_imports_only_math_torch_dataclasses_and_model(copied_sampler):
    """The section is the exact sampler alone, copyable with model.py: no data.py, gift.py or longjob.py, its own
    uniforms (not gift.py's), and what it takes from model.py taken from the copy beside it."""
    module, text, copied_model = copied_sampler
    imported = imported_modules(text)
    assert imported and imported <= SAMPLER_IMPORTS, f"the sampler section imports {sorted(imported - SAMPLER_IMPORTS)}"
    assert "generate" in vars(module) and module.generate.__module__ == "copied_sampler"
    assert "uniforms" in vars(module) and module.uniforms.__module__ == "copied_sampler"
    assert not hasattr(module, "generate_cached") and not hasattr(module, "main")  # the fast sampler, the CLI: not here
    from_model = {name for name, value in vars(module).items() if getattr(value, "__module__", None) == "model"}
    if from_model or "model" in imported:
        assert Path(copied_model.__file__).parent == Path(module.__file__).parent  # the copy, not the repository's
        assert all(getattr(module, name) is getattr(copied_model, name, None) for name in from_model), from_model


def llada_inputs():
    """tiny_model (weights std 0.2: a spread of choices, not near-uniform logits) and two prompts of 6 tokens."""
    model = tiny_model(3, std=0.2).eval()
    prompt = torch.randint(0, model.config.vocab_size - 2, (2, 6), generator=torch.Generator().manual_seed(1))
    return model, prompt


def dream_inputs():
    """tests/test_dream_cli.py's tiny Dream (float64, q/k/v biases, grouped-query heads) and two character prompts."""
    from test_dream_cli import random_text_ids, tiny_dream
    model, _ = tiny_dream(seed=2)
    return model, torch.stack([random_text_ids(6, s) for s in (1, 2)])


GENERATE_CASES = {
    "greedy": dict(steps=8, gen_length=8, block_length=8),
    "temperature": dict(steps=8, gen_length=8, block_length=8, temperature=1.0),
    "cfg": dict(steps=8, gen_length=8, block_length=8, cfg_scale=1.0),
    "random_remasking": dict(steps=8, gen_length=8, block_length=8, temperature=1.0, remasking="random"),
    "blocks": dict(steps=8, gen_length=16, block_length=4),
    "left_padded": dict(steps=8, gen_length=16, block_length=4, temperature=1.0, padded=True),
    "per_row_generators": dict(steps=8, gen_length=8, block_length=8, temperature=1.0, per_row=True),
}


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("case", list(GENERATE_CASES))
def test_the_copied_sampler_gives_sample_generates_tokens(copied_sampler, family, case, one_thread):
    """The copy's generate and sample.generate, on the same model, prompts and seeds, give the same tokens (greedy,
    Gumbel-max at temperature 1, CFG, random remasking, several blocks, a left-padded batch, per-row generators):
    a reader who copies the section samples what the repository samples, on LLaDA and on Dream (whose tokens are
    read one position to the left, through the copy's model.shift_right)."""
    module, _, _ = copied_sampler
    model, prompt = llada_inputs() if family == "llada" else dream_inputs()
    kw = dict(GENERATE_CASES[case])
    padded, per_row = kw.pop("padded", False), kw.pop("per_row", False)
    attention_mask = None
    if padded:  # row 0 left-padded by 3: pad ids and attention_mask 0 there
        attention_mask = torch.ones_like(prompt)
        attention_mask[0, :3] = 0
        prompt = prompt.masked_fill(attention_mask == 0, model.config.pad_token_id)

    def run(generate):
        generator = ([torch.Generator().manual_seed(7 + r) for r in range(len(prompt))] if per_row
                     else torch.Generator().manual_seed(7))
        return generate(model, prompt.clone(), attention_mask, generator=generator, **kw)

    ours = run(sample.generate)
    assert ours.shape == (len(prompt), prompt.shape[1] + kw["gen_length"])
    assert (ours[:, prompt.shape[1]:] != model.config.mask_token_id).any()  # it sampled something
    assert torch.equal(run(module.generate), ours)


def test_the_copied_sampler_refuses_blocks_that_do_not_divide_the_answer(copied_sampler):
    """gen_length 20 is no whole number of blocks of 8: the copy refuses it, as sample.generate does, before any
    forward pass, with a ValueError (not an assertion, which `python -O` strips)."""
    module, _, _ = copied_sampler
    model, prompt = llada_inputs()
    for generate in (module.generate, sample.generate):
        with pytest.raises(ValueError):
            generate(model, prompt, gen_length=20, block_length=8, steps=4)


@pytest.mark.parametrize("shape", [(3,), (2, 5), (2, 3, 7)])
@pytest.mark.parametrize("dtype", [None, torch.float32, torch.float64], ids=["default", "float32", "float64"])
def test_the_copied_uniforms_draw_what_gifts_draw(copied_sampler, shape, dtype):
    """One draw rule for training and sampling: the section's own uniforms (and sample.uniforms) give gift.py Part
    I's uniforms bit for bit, from one generator, from one generator per row, and from torch's global RNG."""
    module, _, _ = copied_sampler
    rules = dict(gift=gift.uniforms, copy=module.uniforms, sample=sample.uniforms)

    def draws(generators):
        out = {}
        for name, uniforms in rules.items():
            with torch.random.fork_rng():
                torch.manual_seed(11)  # the global RNG, for generators=None
                out[name] = uniforms(shape, generators(), torch.device("cpu"), dtype)
        return out

    for generators in (lambda: torch.Generator().manual_seed(5),
                       lambda: [torch.Generator().manual_seed(20 + r) for r in range(shape[0])],
                       lambda: None):
        out = draws(generators)
        assert out["gift"].shape == shape and out["gift"].dtype == (dtype or torch.get_default_dtype())
        assert torch.equal(out["copy"], out["gift"]) and torch.equal(out["sample"], out["gift"])

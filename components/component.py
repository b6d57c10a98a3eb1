"""`_component_` nodes: a config section that names a callable by its dotted import path, with its arguments.

    optimizer:
      _component_: torch.optim.AdamW
      lr: 2.0e-5

A SCHEMA declares one with `COMPONENT` (or `COMPONENT(allow=(prefixes), arg=spec)`); `validate_component` checks
the node before anything is built (the path is allowed and imports, the arguments bind to the signature) and
`instantiate` builds it. Errors name the config key; components/config.py adds where it was set.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from .errors import RecipeError
from .schema import spec_problem, value_desc

__all__ = ["COMPONENT", "COMPONENT_KEY", "ComponentSpec", "instantiate", "validate_component"]

Where = Callable[[str], str]  # a dotted key -> where it was set, e.g. `my.yaml:12` or `override 'k=v'`


class ComponentSpec:
    """Schema sentinel: the node is `{_component_: dotted.path, **kwargs}` bound to the target's signature.

    `COMPONENT(allow=("torch.optim.",), lr=Range(float, gt=0))` also restricts the dotted path to those prefixes
    (checked before anything is imported) and checks the values of the named arguments when they are given.
    """

    def __init__(self, allow: Sequence[str] | None = None, args: Mapping[str, Any] | None = None) -> None:
        self.allow = tuple(allow) if allow is not None else None
        self.args = dict(args or {})

    def __call__(self, allow: Sequence[str] | None = None, **args: Any) -> ComponentSpec:
        return ComponentSpec(allow, args)

    def __repr__(self) -> str:
        return f"COMPONENT(allow={self.allow}, {', '.join(self.args)})" if self.allow or self.args else "COMPONENT"


COMPONENT = ComponentSpec()
COMPONENT_KEY = "_component_"


# ----------------------------------------------------------------------------------------------- building


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


def _check_allowed(dotted: str, allow: tuple[str, ...] | None, key: str, where: Where) -> None:
    # Before any import: only paths under the recipe's prefixes, and no dunder attribute walks (`x.__init__...`).
    if allow is None:
        return
    if not dotted.startswith(allow) or any(p.startswith("__") for p in dotted.split(".")):
        raise RecipeError(f"{where(key)}: key '{key}': '{dotted}' is not allowed here: name a class under "
                          f"{' or '.join(allow)}")


def _default_type(sig: inspect.Signature, name: str) -> type | tuple[type, ...] | None:
    """The plain type an argument's default has (bool, int, float or str), or None to check nothing: an argument
    without a spec still refuses a value of another kind (`amsgrad: yes_please` was taken as true). null stays
    allowed (the callable decides), and an int is a fine float."""
    param = sig.parameters.get(name)
    if param is None or param.default is param.empty:
        return None
    if param.default is None:  # `fused: bool | None = None`: the annotation says the kind (a string under
        # `from __future__ import annotations`; torch's own optimizers annotate `Optional[bool]`)
        words = set(re.findall(r"[A-Za-z_]+", str(param.annotation)))
        plain = {"bool": bool, "int": int, "float": float, "str": str}
        kinds = words & set(plain)
        if len(kinds) == 1 and words <= kinds | {"None", "Optional", "NoneType", "typing"}:
            return (plain[kinds.pop()], type(None))
        return None
    kind = type(param.default)
    return (kind, type(None)) if kind in (bool, int, float, str) else None


def validate_component(node: Any, key: str, where: Where, spec: ComponentSpec | None = None) -> None:
    """Check a `{_component_: dotted.path, **kwargs}` node against `spec` before anything is built: the path is
    allowed and imports, the arguments bind to its signature and pass their specs; nested nodes likewise.
    `where(key)` says where a key was set (`file:line` or the override) for the error."""
    if node is None:  # "no such component" (e.g. lr_scheduler: null); the recipe decides
        return
    allow, arg_specs = (spec.allow, spec.args) if spec is not None else (None, {})
    if isinstance(node, DictConfig) and COMPONENT_KEY not in node:
        raise RecipeError(f"{where(key)}: key '{key}' has no '{COMPONENT_KEY}': name the class to build "
                          f"({{{COMPONENT_KEY}: dotted.path, ...}})")
    if not isinstance(node, DictConfig):
        raise RecipeError(
            f"{where(key)}: key '{key}' must be a mapping with '{COMPONENT_KEY}: dotted.path', got {value_desc(node)}"
        )
    ckey = f"{key}.{COMPONENT_KEY}"
    dotted = node[COMPONENT_KEY]
    if not isinstance(dotted, str):
        raise RecipeError(f"{where(ckey)}: key '{ckey}' must be a dotted import path string")
    _check_allowed(dotted, allow, ckey, where)
    try:
        target = _locate(dotted, ckey)
    except RecipeError as e:
        raise RecipeError(f"{where(ckey)}: {e}") from e
    sig = _signature(target)
    names = [k for k in node.keys() if k != COMPONENT_KEY]
    if sig is not None:
        has_var_kw = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
        for k in names:
            if k not in sig.parameters and not has_var_kw:
                raise RecipeError(
                    f"{where(f'{key}.{k}')}: key '{key}.{k}': {dotted} has no argument '{k}' "
                    f"(it takes: {_param_names(sig)})"
                )
        try:
            sig.bind_partial(**{k: None for k in names})
        except TypeError as e:  # e.g. a positional-only parameter given by name
            raise RecipeError(f"{where(key)}: key '{key}': cannot bind to {dotted}: {e}") from e
    for k in names:
        child = node[k]
        expected = arg_specs.get(k) if arg_specs else None
        if expected is None and sig is not None:
            expected = _default_type(sig, k)
        if expected is not None:
            problem = spec_problem(expected, child)
            if problem is not None:
                raise RecipeError(f"{where(f'{key}.{k}')}: key '{key}.{k}' {problem}")
        nested = ComponentSpec(allow) if allow is not None else None  # nested components obey the same allow-list
        if isinstance(child, DictConfig) and COMPONENT_KEY in child:
            validate_component(child, f"{key}.{k}", where, nested)
        elif isinstance(child, ListConfig):
            for i, item in enumerate(child):
                if isinstance(item, DictConfig) and COMPONENT_KEY in item:
                    validate_component(item, f"{key}.{k}.{i}", where, nested)

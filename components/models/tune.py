"""torchtune 0.6.1 on torchao 0.18: the one way this project imports torchtune, `import_torchtune()`.

torchtune 0.6.1 imports `torchao.dtypes.nf4tensor`, which torchao >= 0.16 moved to
`torchao.quantization.quantize_.workflows.nf4.nf4_tensor`. The stack keeps both pins, so before torchtune is
imported the old name has to resolve: `import_torchtune()` makes it an alias of the new module in sys.modules
(nothing else of torchao or torchtune is touched) and then imports torchtune.

That alias changes the interpreter's global state, so it must never happen because a module of ours was
imported (issue 21: nothing happens at import; tests/test_import_effects.py checks it). Hence:

- No module of ours imports torchtune at its top. A function that needs torchtune calls `import_torchtune()`
  and then imports what it uses; our subclasses of torchtune layers are defined on first use for the same
  reason (`builder.tune_layers()`, `rope.rotary_embedding()`).
- The alias appears only when torchtune is actually needed (building or loading a model, generating), in
  whatever program does that, and never for a program that only imports us or lists recipes.
- Code outside these functions that imports torchtune itself (a test, a bench script) calls
  `import_torchtune()` first.

torchao and torch log notes while torchtune imports them that users cannot act on: on builds without CUDA,
torchao's optional CUDA kernels failing to load; always, torch's pytree deprecation notes for torchao's enums.
Those two loggers are held at ERROR for the duration of that import only; their levels are restored after.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import sys
from collections.abc import Iterator
from types import ModuleType

__all__ = ["import_torchtune"]

_NF4_OLD = "torchao.dtypes.nf4tensor"
_NF4_NEW = "torchao.quantization.quantize_.workflows.nf4.nf4_tensor"


@functools.cache
def import_torchtune() -> ModuleType:
    """Import torchtune (once), aliasing torchao's moved NF4 module to its old name first when needed.

    Call it before any `from torchtune... import ...`. Returns the torchtune package."""
    with _quiet_import_notes():
        _alias_nf4()
        return importlib.import_module("torchtune")


def _alias_nf4() -> None:
    if _NF4_OLD in sys.modules:
        return
    try:
        importlib.import_module(_NF4_OLD)  # torchao < 0.16 still has it: no alias needed
    except ImportError:
        sys.modules[_NF4_OLD] = importlib.import_module(_NF4_NEW)


@contextlib.contextmanager
def _quiet_import_notes() -> Iterator[None]:
    import torch

    names = ["torch.utils._pytree"] + ([] if torch.cuda.is_available() else ["torchao"])
    loggers = [logging.getLogger(n) for n in names]
    saved = [g.level for g in loggers]
    for g in loggers:
        g.setLevel(max(g.getEffectiveLevel(), logging.ERROR))
    try:
        yield
    finally:
        for g, level in zip(loggers, saved):
            g.setLevel(level)

"""Giving a module new methods by swapping its class for a made-once subclass (QAT's LoRA forward, the traceable
activation quantizer, the fp8 LoRA base)."""

from __future__ import annotations


def swapped_class(cache: dict[type, type], cls: type, prefix: str, methods: dict, module: str) -> type:
    """`cls` with `methods` (and attributes) replaced, named `prefix + cls.__name__` in `module`, made once per class
    (kept in `cache`), for `obj.__class__ = ...`: a subclass, not a wrapper, keeps isinstance checks, parameter
    names, state and helpers working; FSDP2's fully_shard swaps module classes the same way."""
    if cls not in cache:
        cache[cls] = type(f"{prefix}{cls.__name__}", (cls,), {**methods, "__module__": module})
    return cache[cls]

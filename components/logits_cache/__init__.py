"""The offline teacher: a sharded cache of the teacher's top-k log-probabilities, or of a sample of its tokens, over
a transfer set (written by `recipe run kd_logits`, read by `kd` with `teacher.logits_dir`). Format and checks:
manifest.py."""

from .manifest import (
           bytes_per_token,
           encode_sampled,
           encode_topk,
           run_fields,
           teacher_fingerprint,
           tokenizer_fingerprint,
)
from .reader import CachedDataset, LogitsCache
from .writer import CacheWriter, item_uniforms, teacher_rows

__all__ = ["CacheWriter", "CachedDataset", "LogitsCache", "bytes_per_token", "encode_sampled", "encode_topk",
           "item_uniforms", "run_fields", "teacher_fingerprint", "teacher_rows", "tokenizer_fingerprint"]

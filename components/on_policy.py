"""On-policy distillation (`kd.on_policy`): the student samples a completion of each row's prompt, the teacher
scores prompt + completion, and the student trains on the completion tokens only, with a divergence between the
two models' full next-token distributions at every sampled position (GKD, Agarwal et al. 2024, with its fraction
`lmbda` of on-policy batches; per-token reverse KL as in "on-policy distillation", Thinking Machines 2025). No
gradient flows through the sampling itself, and no CE is taken on sampled tokens.

The blocks recipes/kd.py calls from its loop:
- `OnPolicySettings` (the config section: each key's type, default, range and doc, checked at config load);
  `check_on_policy` checks it against the rest of the config, once at load.
- `HeldOut`: keeps the dataset's last `held_out` rows out of training (on the tokenized data, before any weights).
- `OnPolicy`: `sample_window` (the chosen micro-batches become prompt + completion batches), `score` / `sums` /
  `metrics` (the step's metrics), `held_out_eval` (the end-of-run metric).
- which micro-batches go on-policy and which prompts they sample (`is_on_policy`, `row_prompts`, `load_prompt_set`
  for `kd.on_policy.prompts` and its stateless dealing): components/on_policy_prompts.py.
- plain functions, tested on their own: `sample_completions`, `completion_batch`, `packed_completion_batch` and
  `training_batches` (components/on_policy_sampling.py), `decode_path`, `score_samples` / `per_prompt_summary`
  (the held-out metric per prompt, also what bench/kd_study2_onp.py scores every student of the KD study with:
  components/on_policy_score.py), `sampling_groups`; the sampling twin of several processes:
  components/sampling_twin.py.

Where prompts come from: by default each on-policy micro-batch takes the prompts of its own training rows (below).
With `kd.on_policy.prompts` (a dataset section: source, format, split, ...) they come from that set instead, so the
student samples on the prompts of the task it is meant for (GKD's setting) while the off-policy micro-batches still
read the training data; the on-policy micro-batch's training rows go unused (the loader's position moves as
before). The set is tokenized unpacked, each row gives one prompt (instruct/chat: the tokens before the response,
or all of a prompt-only row, the last max_seq_len - max_new_tokens of them; text: the first `prompt_tokens`), its
last `held_out` rows are held out, and the m-th on-policy micro-batch of the run (m = `on_policy_index`) on rank r
of W takes the r-th rows = batch_size x prompts_per_row of a seeded pass over the N others, cut into whole
micro-batches of W x rows (`deal_prompts`). No state, so resume is bit-identical, ranks never overlap and no
micro-batch repeats a prompt (given N >= W x rows).

Prompts per micro-batch: a packed row holds many documents, and each of them (up to `prompts_per_row`, while
the row's prompts and their completions fit in max_seq_len) gives a prompt, so one micro-batch samples up to
batch_size x prompts_per_row prompts at once (a batch that keeps a GPU busy, where one prompt per row did not).
Where every data micro-batch has one shape (packed data, compiled layers), a step's samples train first fit into
passes of that shape or half its rows, compiled static (`loader_shaped_batches`, `static_shapes`: else the layers
recompile for dynamic sizes, which data micro-batches then run too). Elsewhere they train one per row, padded to the
longest, or packed back into their rows (`packed_completion_batch`), whichever holds fewer tokens, and consecutive
ones of one sample per row join while they fit a data micro-batch's positions (`training_batches`: the same gradient
in fewer passes). The on-policy micro-batches of one optimizer step are sampled together (`sampling_groups`: while
their decode batch spans no more tokens than one micro-batch's prompts may at max_seq_len): a decode step costs
about as much for 64 prompts as for 16. Each prompt keeps the noise of its own micro-batch and slot.

Sampling speed (`decode_path`): on one CUDA process with `compile: true` the one-token decode step is compiled over
the whole model and replayed as a CUDA graph per prompt-width bucket (`StaticDecode`, KV caches kept between steps;
the prompt forward runs eagerly, so the compiled training layers never see a KV cache), a LoRA student's through a
copy with its adapters merged (components/merged_sampler.py); on N processes on each rank's unsharded twin of the
student (components/sampling_twin.py). Elsewhere (CPU, no room for a twin, `decode: eager`) sampling is eager,
under `no_grad` (not inference mode: FSDP2's gathered weights must stay normal tensors).

Determinism without saved state: whether a micro-batch goes on-policy is a function of (seed, step, micro-batch
index), and so is its sampling noise (a torch.Generator seeded from them), so a resumed run samples exactly what
the uninterrupted run sampled. The noise is drawn for the global batch (every rank draws the same uniforms) and
prompt j of a row takes the uniform of slot g * prompts_per_row + j, g being the row's global index (the loader
deals rows to ranks round-robin: rank k's row r is global row r * world_size + k), so N processes sample what one
process with N times the batch samples.
"""

from __future__ import annotations

import inspect
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from tqdm import tqdm

from .checkpoint.atomic import atomic_write_bytes
from .data.dataset import DatasetConfig, TokenizedDataset
from .errors import RecipeError
from .losses import KD_LOSSES, KDLoss, LiveTeacher, build_kd_loss, kd_and_ce
from .memory import sampling_kv_positions
from .merged_sampler import make_merged
from .models.generation import StaticDecode
from .on_policy_prompts import (
    PROMPT_SET_KEYS,
    PROMPTS_KEY,
    PromptSet,
    _key,
    deal_prompts,
    is_on_policy,
    load_prompt_set,
    on_policy_index,
    prompts_in_documents,
    prompts_of,
    reads_training_rows,
    row_prompts,
    sampling_groups,
)
from .on_policy_sampling import in_window, loader_shaped_batches, sample_completions, training_batches
from .on_policy_score import per_prompt_summary, score_samples
from .runs import ON_POLICY_EVAL_FILE
from .runtime import Runtime
from .sampling_twin import TwinPlan, make_twin, step_gathered_bytes, twin_structure
from .schema import Choice, Range
from .settings import section, setting

EVAL_FILE = ON_POLICY_EVAL_FILE  # held_out_eval's result, in output_dir (an output overwrite=true replaces)
KD_OPTIONS, DECODE_PATHS = ("beta", "alpha", "ratio"), ("auto", "compiled", "eager")


@dataclass(frozen=True, kw_only=True)
class OnPolicySettings:
    """`kd.on_policy`: null (the default) is off, today's off-policy KD on every micro-batch."""

    # 0.02: in docs/kd_study.md (equal GPU time) 0.02, 0.05 and 0.1 gave the prompts' metric the same gain, and the
    # smaller share lost less LAMBADA in two leases (0.02: none); 0.1 beat 0.25 and 0.5 on both
    fraction: float = setting(0.02, Range(float, ge=0, le=1), "share of micro-batches that go on-policy, spread "
                              "evenly (1.0: all; 0: none, only the held-out score, the off-policy baseline)")
    max_new_tokens: int = setting(64, Range(int, ge=1), "tokens the student samples per prompt (fewer after a stop "
                                  "token); below dataset.max_seq_len")
    temperature: float = setting(1.0, Range(float, gt=0), "sampling temperature (1.0: the student's own "
                                 "distribution)")
    prompt_tokens: int = setting(32, Range(int, ge=1), "text rows (of the dataset, or of a text prompts set): the "
                                 "first N tokens of a document are its prompt (N <= dataset.max_seq_len - max_new_tokens)")
    loss: str = setting("reverse_kl", Choice(*KD_LOSSES), "the divergence on sampled tokens: any kd.loss kind "
                        "(kd.temperature/beta/... apply)")
    held_out: int = setting(16, Range(int, ge=0), "the dataset's (with prompts set: the prompt set's) last N rows "
                            "never train; at the end their prompts score the student (0: none)")
    prompts_per_row: int = setting(8, Range(int, ge=1), "a prompt from each document of a row, up to N, while they "
                                   "and their completions fit in max_seq_len (with prompts: batch_size x N of the "
                                   "set per on-policy micro-batch)")
    decode: str = setting("auto", Choice(*DECODE_PATHS), "auto: compiled (CUDA graphs) on CUDA with compile: true "
                          "(several processes: on an unsharded copy of the student each, where it fits), else "
                          "eager | compiled | eager")
    prompts: DatasetConfig | None = section(DatasetConfig, "where on-policy prompts come from: null, each training "
                                            "row's own; or a dataset section (source, format, split, name, "
                                            "data_files, column_map, limit, use_chat_template) whose rows' prompts "
                                            "are dealt to the on-policy micro-batches (held_out: its last rows)",
                                            optional=True, only=PROMPT_SET_KEYS)


def check_on_policy(s: OnPolicySettings | None, logits_dir: str | None, dataset: Any) -> None:
    """`kd.on_policy` checked against the keys it depends on (`teacher.logits_dir`, the `dataset:` section), once
    at load; nothing to check when it is off (None)."""
    if s is None:
        return
    if logits_dir is not None:
        raise RecipeError("kd.on_policy needs a live teacher to score the student's samples; teacher.logits_dir "
                          "(a cache of fixed data) cannot: set one of them to null")
    if s.max_new_tokens >= dataset.max_seq_len:
        raise RecipeError(f"kd.on_policy.max_new_tokens={s.max_new_tokens} must be below dataset.max_seq_len="
                          f"{dataset.max_seq_len}: prompt and completion share one row")
    rows = s.prompts if s.prompts is not None else dataset  # the rows held_out takes its rows from
    room = dataset.max_seq_len - s.max_new_tokens
    if rows.format == "text" and s.prompt_tokens > room:  # text prompts were cut to the room in silence
        raise RecipeError(f"kd.on_policy.prompt_tokens={s.prompt_tokens} does not fit: a prompt and its "
                          f"kd.on_policy.max_new_tokens={s.max_new_tokens} completion share one row of "
                          f"dataset.max_seq_len={dataset.max_seq_len}, so a prompt takes at most {room} tokens "
                          "(lower prompt_tokens or max_new_tokens, or raise dataset.max_seq_len)")
    if rows.limit is not None and s.held_out >= rows.limit:  # rows (packed or not) <= limit: none would train
        key = f"{PROMPTS_KEY}.limit" if s.prompts is not None else "dataset.limit"
        raise RecipeError(f"kd.on_policy.held_out={s.held_out} leaves no training rows: {key}={rows.limit} keeps "
                          f"at most {rows.limit} (lower held_out below {rows.limit}, or raise {key})")
    if s.prompts is None and dataset.format != "text" and dataset.train_on_input:
        raise RecipeError("kd.on_policy takes the prompt of instruct/chat rows from their labels, which "
                          "dataset.train_on_input=true puts on the prompt too: set it to false (or take prompts "
                          "from kd.on_policy.prompts)")


def decode_path(s: OnPolicySettings, compile: bool, device: torch.device) -> str:
    """"compiled" or "eager": how the student samples (`kd.on_policy.decode`; module docstring). On several
    processes "compiled" runs on an unsharded twin of the student, where it fits (`OnPolicy`)."""
    if s.decode == "eager":
        return "eager"
    return "compiled" if s.decode == "compiled" or (device.type == "cuda" and compile) else "eager"


def twin_structure_for(s: OnPolicySettings | None, compile: bool, rt: Runtime,
                       student: nn.Module) -> TwinPlan | None:
    """On several processes, when the student will sample with the compiled step: its structure for the sampling
    twin (components/sampling_twin.py), which must be copied before `Runtime.prepare_model` compiles and shards it;
    else None. None with `fraction: 0` too: only the held-out score samples, once, at the end, which is not worth a
    copy of the student held through the whole run (it samples eagerly)."""
    if s is None or s.fraction == 0 or rt.world_size == 1 or decode_path(s, compile, rt.device) != "compiled":
        return None
    return twin_structure(student)


def on_policy_kd_loss(s: OnPolicySettings, kd: Any) -> KDLoss:
    """The divergence on sampled tokens: `s.loss` at kd.temperature with the kd.beta / alpha / ratio it takes
    (`kd`: the `kd:` section, components/kd_settings.py)."""
    takes = inspect.signature(KD_LOSSES[s.loss]).parameters
    options = {o: getattr(kd, o) for o in KD_OPTIONS if o in takes and getattr(kd, o) is not None}
    return build_kd_loss(s.loss, kd.temperature, **options)


class HeldOut:
    """`kd.on_policy.held_out`: the training dataset's last rows (after packing), kept out of training; at the end
    their prompts score the student (`OnPolicy.held_out_eval`). Called on the tokenized dataset (build_train_loader's
    `wrap_dataset`), before any weights load, so too few rows fail in seconds. The same rows on every rank and every
    resume (the dataset is tokenized deterministically). Nothing is held out when on-policy is off (`s` None), or
    with kd.on_policy.prompts (the prompt set holds its own rows out: every training row trains; `trained_on` counts
    its held-out prompts that begin a training document all the same)."""

    def __init__(self, s: OnPolicySettings | None, prompt_set: PromptSet | None = None) -> None:
        self.k = 0 if s is None or prompt_set is not None or s.prompts is not None else s.held_out
        self.prompt_set = prompt_set
        self.rows: list[dict] = []
        self.collate: Callable[[list[dict]], dict] | None = None
        self.trained_on = 0  # the prompt set's held-out prompts the training rows hold (their score is not unseen)

    def __call__(self, dataset: Any) -> Any:
        """`dataset` without its last `k` rows (which this keeps); a one-line error when none would be left."""
        k = self.k
        if self.prompt_set is not None:
            self.trained_on = prompts_in_documents(self.prompt_set.held_whole, dataset)
        if k == 0:
            return dataset
        if k >= len(dataset):
            packed = " after packing" if getattr(dataset, "packed", False) else ""
            raise RecipeError(f"kd.on_policy.held_out={k} leaves no training rows: the dataset has {len(dataset)}"
                              f"{packed} (lower held_out below {len(dataset)}, or add rows to the dataset)")
        n = len(dataset) - k
        self.rows, self.collate = [dataset[i] for i in range(n, len(dataset))], dataset.collate
        return TokenizedDataset([dataset[i] for i in range(n)], dataset.pad_id, dataset.max_seq_len, dataset.packed,
                                dataset.shuffle, dataset.bucket, dataset.origin)


class OnPolicy:
    """The on-policy part of a KD run: which micro-batches, their samples, and their metrics (module docstring).

    `vocab_size`: the loss's shared vocabulary (None: whole heads), which sampling keeps to; `num_chunks`: the
    loss's chunks. Metrics use the per-token reverse KL(student || teacher) at temperature 1 on sampled tokens.
    `static`: the compiled decode step's fixed shapes and KV caches when sampling is compiled (`decode_path`).
    `prompt_set`: `kd.on_policy.prompts` already loaded (`load_prompt_set`; loaded here when None and it is set).
    `held`: the dataset's held-out rows, already split off (`HeldOut`; else `hold_out` splits them).
    `student` (prepared) and `train_tokens` (its largest micro-batch): a sampling group's KV caches may span a step's
    prompts where memory allows (`sampling_kv_positions`). `twin`: on several processes, the student's structure
    for the sampling twin (`twin_structure_for`; none: eager sampling). `loader_shape`: every data micro-batch is
    batch_size x max_seq_len (packed and compiled), so the samples train in that shape (`loader_shaped_batches`)."""

    def __init__(self, s: OnPolicySettings, cfg: Any, rt: Runtime, tokenizer: Any,
                 vocab_size: int | None, num_chunks: int, prompt_set: PromptSet | None = None,
                 held: HeldOut | None = None, student: nn.Module | None = None, train_tokens: int = 0,
                 twin: TwinPlan | None = None, loader_shape: bool = False) -> None:
        self.s, self.rt, self.tokenizer = s, rt, tokenizer  # cfg: the run's typed config (recipes/kd.py: KDConfig)
        self.loader_shape = loader_shape
        self.kd_loss = on_policy_kd_loss(s, cfg.kd)
        self.metric = build_kd_loss("reverse_kl", 1.0)
        self.seed, self.accum = cfg.seed, cfg.gradient_accumulation_steps
        self.batch_size, self.num_chunks, self.vocab = cfg.batch_size, num_chunks, vocab_size
        prompt_format = (s.prompts or cfg.dataset).format  # the rows the prompts come from
        self.prompt_tokens = s.prompt_tokens if prompt_format == "text" else None
        self.budget = cfg.dataset.max_seq_len - s.max_new_tokens
        if prompt_set is None and s.prompts is not None:
            prompt_set = load_prompt_set(s, cfg.dataset.max_seq_len, tokenizer)
        self.prompt_set = prompt_set
        self.per_row, self.rows = s.prompts_per_row, self.batch_size * s.prompts_per_row  # prompts per row, per batch
        # a step's on-policy micro-batches, sampled together (module docstring): at most ceil(accum x fraction), as
        # is_on_policy spreads them evenly
        self.per_window = max(1, math.ceil(self.accum * s.fraction))
        self.max_seq_len = cfg.dataset.max_seq_len
        # the KV positions one sampling group (one decode loop) may span: a micro-batch's prompts at most, or, where
        # memory allows, the step's (chat prompts: fewer, larger groups; memory.py says what it measured)
        self.max_tokens, kv_why = self.rows * self.max_seq_len, None
        self.path = decode_path(s, cfg.compile, rt.device)
        # several processes: the compiled step samples with an unsharded twin of the sharded student where it fits
        # (components/sampling_twin.py), else sampling is eager through the sharded student
        self.twin, twin_why = None, None
        if self.path == "compiled" and rt.world_size > 1:
            if twin is not None and student is not None:
                self.twin, twin_why = make_twin(twin, student, self.max_tokens, train_tokens, rt,
                                                required=s.decode == "compiled")
            self.path = "compiled" if self.twin is not None else "eager"
        elif self.path == "compiled" and student is not None and s.fraction > 0:  # one GPU: adapters merged, if room
            self.twin, twin_why = make_merged(student, self.max_tokens, train_tokens, rt.device)
        if student is not None and (rt.world_size == 1 or self.twin is not None):
            gathered = step_gathered_bytes(twin, student) if rt.world_size > 1 and self.twin is not None else 0
            self.max_tokens, kv_why = sampling_kv_positions(student, self.max_tokens, self.max_tokens * self.per_window,
                                                            train_tokens, rt.device, gathered, rt.world_size)
            self.max_tokens = rt.broadcast_object(self.max_tokens)  # rank 0's free memory decides for every rank
        self.static = (StaticDecode(self.rows * self.per_window,
                                    "reduce-overhead" if rt.device.type == "cuda" else "default",
                                    max_width=min(self.budget, self.prompt_tokens or self.budget),
                                    max_tokens=self.max_tokens, max_new_tokens=s.max_new_tokens)
                       if self.path == "compiled" else None)
        self._held = held if held is not None else HeldOut(s, prompt_set)  # kd.py: the data already went through it
        self._same_rows = s.prompts is not None and reads_training_rows(s.prompts, cfg.dataset)
        if rt.is_main:
            if twin_why is not None:
                where = f" on {rt.world_size} processes" if rt.world_size > 1 else ""
                print(f"on-policy sampling{where}: {twin_why}", flush=True)
            if kv_why is not None:
                print(f"on-policy decode KV caches: {kv_why}", flush=True)
            how = ("one compiled decode step (CUDA graphs)" if self.static is not None and rt.device.type == "cuda"
                   else "one compiled decode step" if self.static is not None else "eager decode steps")
            trains = "trained in passes of a data micro-batch's shape, " if loader_shape else ""
            if prompt_set is None:
                print(f"on-policy sampling: up to {self.rows} prompts per micro-batch ({self.per_row} per row), a "
                      f"step's on-policy micro-batches together (up to {self.rows * self.per_window}), {trains}{how}",
                      flush=True)
            else:
                tokens = prompt_set.micro_batch_tokens(self.rows, s.max_new_tokens)
                trains = trains or (f"one per row or packed where that holds fewer tokens: up to {tokens} tokens "
                                    f"({tokens / (self.batch_size * self.max_seq_len):.1f}x a data micro-batch; "
                                    "prompts_per_row=1 keeps it at most 1x), ")
                print(f"on-policy sampling: {self.rows} prompts of {PROMPTS_KEY} per micro-batch (batch_size x "
                      f"prompts_per_row), {trains}{how}", flush=True)
                print(f"on-policy prompts: {len(prompt_set.train)} rows of {PROMPTS_KEY} ({prompt_set.origin}), "
                      f"{len(prompt_set.held)} more held out; {prompt_set.cut} longer than {self.budget} tokens "
                      "(max_seq_len - max_new_tokens) are cut", flush=True)
                trained = self.prompts_trained_on
                if trained:
                    print(f"note: {trained} of the {len(prompt_set.held)} held-out prompts of {PROMPTS_KEY} are "
                          "training rows (dataset: the same rows), so they are trained on off-policy and their "
                          "end-of-run score is not of unseen prompts; for that, give the prompts rows of their own, "
                          "or slice them off with the two splits (e.g. dataset.split='train[:-100]', "
                          f"{PROMPTS_KEY}.split='train[-100:]')", flush=True)
        self._batches_logged, self.step_seconds = 0, 0.0
        self._first_step: int | None = None  # this process's first step, and whether it has sampled yet
        self._sampled_once = False
        self._reset()

    # ------------------------------------------------------------------ data
    @property
    def prompts_trained_on(self) -> int:
        """Held-out prompts of kd.on_policy.prompts that training rows hold: all of them when the two sections name
        the same rows (`reads_training_rows`, however each renders them), else those found token for token at the
        start of a training document (`HeldOut.trained_on`)."""
        if self.prompt_set is None:
            return 0
        return len(self.prompt_set.held) if self._same_rows else self._held.trained_on

    def hold_out(self, dataset: Any) -> Any:
        """The training dataset without its last `held_out` rows (`HeldOut`), which `held_out_eval` prompts with."""
        return self._held(dataset)

    @property
    def held(self) -> list[dict]:
        """The dataset's held-out rows (none with kd.on_policy.prompts, or before `hold_out`)."""
        return self._held.rows

    # ------------------------------------------------------------------ sampling
    def _all_done(self, done: Tensor) -> bool:
        """Every row of every rank stopped (the ranks' forward passes, FSDP's collectives, stay in step)."""
        return int(self.rt.all_reduce_sum((~done).sum())) == 0

    def _sample(self, model: nn.Module, prompts: list[list[int]], seed: int | Sequence[int], rows: Sequence[int],
                width: int) -> list[list[int]]:
        # the twin (refreshed by the caller) needs no collective inside the loop: each rank stops when its rows do
        model, all_done = (self.twin.model, None) if self.twin is not None else (model, self._all_done)
        return sample_completions(model, prompts, self.s.max_new_tokens, self.s.temperature, self.tokenizer.pad_id,
                                  self.tokenizer.stop_ids, seed, rows, width, self.vocab, all_done, self.static)

    def _prompts_of_rows(self, batch: dict) -> tuple[list[list[int]], list[int], list[int]]:
        """The prompts of a training micro-batch's rows, each one's noise slot in the global batch (prompt j of
        global row g takes uniform g * per_row + j: the loader deals global row r * world + rank here) and how many
        each row gave (their samples are packed back into that row: `packed_completion_batch`)."""
        world, rank = self.rt.world_size, self.rt.rank
        prompts, slots, per_row = [], [], []
        for r, row in enumerate(row_prompts(batch, self.prompt_tokens, self.budget, self.per_row,
                                            self.s.max_new_tokens)):
            prompts += row
            slots += [(r * world + rank) * self.per_row + j for j in range(len(row))]
            per_row.append(len(row))
        return prompts, slots, per_row

    def _dealt(self, step: int, micro: int) -> tuple[list[list[int]], list[int], None]:
        """The prompt set's prompts this rank samples in on-policy micro-batch `micro` of step `step`
        (`deal_prompts`) and their noise slots: rank r's j-th takes uniform r * rows + j of the global batch."""
        m = on_policy_index(self.seed, step * self.accum + micro, self.s.fraction)
        train, rank = self.prompt_set.train, self.rt.rank
        rows = deal_prompts(self.seed, len(train), m, rank, self.rt.world_size, self.rows)
        return [train[i] for i in rows], [rank * self.rows + j for j in range(self.rows)], None

    def sample_window(self, model: nn.Module, window: list[dict], step: int) -> list[dict]:
        """The window with its on-policy micro-batches (`is_on_policy`) replaced by batches of prompt + the
        student's sample (host tensors, like the loader's), laid out by `loader_shaped_batches` or
        `training_batches` (the window may come back shorter or longer); `step` counts finished optimizer steps.
        Their prompts are sampled in `sampling_groups`, each with the noise of its own micro-batch and slot."""
        chosen = [m for m in range(len(window)) if is_on_policy(self.seed, step, m, self.accum, self.s.fraction)]
        self._first_step = step if self._first_step is None else self._first_step
        if not chosen:
            return window
        start, width = time.perf_counter(), self.rows * self.rt.world_size
        if self.static is not None and not self._sampled_once and step > self._first_step and self.rt.is_main:
            # a small share samples first after this process's first step (whose compiles setup's log explains):
            # say why this step stalls
            tqdm.write(f"on-policy: step {step + 1} is this process's first to sample: compiling the decode step "
                       "and the layers for the samples' passes (once)")
        self._sampled_once = True
        if self.twin is not None:  # the step's starting weights, gathered into the twin or merged into the copy
            self.twin.refresh(model, _key(self.seed, step, "merge"))
        dealt = [self._dealt(step, m) if self.prompt_set is not None else self._prompts_of_rows(window[m])
                 for m in chosen]
        samples = []  # (prompts, completions, prompts per training row) of each chosen micro-batch
        for group in self._groups([prompts for prompts, *_ in dealt]):
            prompts = [p for g in group for p in dealt[g][0]]
            slots = [i * width + slot for i, g in enumerate(group) for slot in dealt[g][1]]
            completions = self._sample(model, prompts, [_key(self.seed, step, chosen[g]) for g in group], slots, width)
            for g in group:
                mine, completions = completions[:len(dealt[g][0])], completions[len(dealt[g][0]):]
                samples.append((dealt[g][0], mine, dealt[g][2]))
                self._sampled += sum(map(len, mine))
            self._batches += len(group)
            self._prompts += len(prompts)
        if self.loader_shape:  # every pass in the data micro-batches' one shape (loader_shaped_batches says why)
            out = in_window(window, chosen, loader_shaped_batches(samples, self.tokenizer.pad_id, self.max_seq_len,
                                                                  self.batch_size, self.rt.all_reduce_max))
        else:  # each batch at its first micro-batch's place; the others it holds go
            out, joined = list(window), set()
            for run, batch in training_batches(samples, self.tokenizer.pad_id, self.max_seq_len,
                                               self.batch_size * self.max_seq_len, self.rt.all_reduce_max):
                out[chosen[run[0]]] = batch
                joined.update(chosen[g] for g in run[1:])
            out = [b for m, b in enumerate(out) if m not in joined]
        self._seconds += time.perf_counter() - start
        return out

    def _groups(self, prompts: list[list[list[int]]]) -> list[list[int]]:
        """`sampling_groups` of these micro-batches' prompts, the same on every rank (their sizes reduced to the
        largest over ranks: each group is one sampling loop, whose steps run collectives under FSDP)."""
        pad = self.static.width if self.static is not None else (lambda w: w)
        sizes = torch.tensor([[len(p), pad(max(map(len, p), default=1)) + self.s.max_new_tokens] for p in prompts])
        return sampling_groups(self.rt.all_reduce_max(sizes).tolist(), self.rows * self.per_window, self.max_tokens)

    # ------------------------------------------------------------------ metrics
    def _reset(self) -> None:
        zero = torch.zeros((), device=self.rt.device)
        self._loss, self._rkl, self._batches, self._prompts, self._sampled, self._seconds = zero, zero, 0, 0, 0, 0.0

    def _reverse_kl(self, parts: dict[str, Tensor], hidden: Tensor, head: Any, labels: Tensor,
                    target: LiveTeacher) -> Tensor:
        """Summed per-token reverse KL(student || teacher) at T = 1 on the sampled tokens: the loss's own sum when
        the loss is that divergence, else one more pass of the head over the hidden states (no grad)."""
        if self.kd_loss == self.metric:
            return parts["kd"]
        with torch.no_grad():
            return kd_and_ce(hidden.detach(), head, labels, target, self.metric, 1.0, num_chunks=self.num_chunks,
                             vocab_size=self.vocab)["kd"]

    def score(self, parts: dict[str, Tensor], n: Tensor, hidden: Tensor, head: Any, labels: Tensor,
              target: LiveTeacher) -> None:
        """Add an on-policy micro-batch's loss (`kd_and_ce`'s parts, normalised by the window's `n`) and its
        teacher-scored reverse KL to the step's metrics."""
        self._loss = self._loss + parts["loss"].detach() / n
        self._rkl = self._rkl + self._reverse_kl(parts, hidden, head, labels, target)

    def sums(self) -> dict[str, Tensor]:
        """The step's on-policy sums, to reduce over ranks with the step's other values (`step_values`)."""
        self.step_seconds = self._seconds  # this rank's sampling time in the step (the setup log's first step)
        out = {"on_policy_loss": self._loss, "on_policy_rkl_sum": self._rkl,
               "on_policy_prompts": torch.tensor(float(self._prompts), device=self.rt.device),
               "on_policy_sampled": torch.tensor(float(self._sampled), device=self.rt.device),
               "on_policy_seconds": torch.tensor(self._seconds, device=self.rt.device)}
        self._batches_logged = self._batches
        self._reset()
        return out

    def metrics(self, values: dict[str, float], step_seconds: float) -> dict[str, float | int | None]:
        """The logged on-policy metrics of a step from its reduced `values`: the loss term, the teacher-scored
        per-token reverse KL on the samples, the prompts sampled and sampled tokens/s (all ranks) and the share of
        the step spent sampling (None, or 0 for the share, on a step without on-policy micro-batches)."""
        sampled, seconds = values.pop("on_policy_sampled"), values.pop("on_policy_seconds") / self.rt.world_size
        rkl, loss = values.pop("on_policy_rkl_sum"), values.pop("on_policy_loss")
        return {"on_policy_loss": loss if sampled else None, "on_policy_batches": self._batches_logged,
                "on_policy_prompts": int(values.pop("on_policy_prompts")),
                "on_policy_rkl": rkl / sampled if sampled else None,
                "sampled_tokens_per_s": sampled / seconds if seconds > 0 else None,
                "sampling_share": seconds / step_seconds if step_seconds > 0 else 0.0}

    # ------------------------------------------------------------------ held-out prompts
    def held_out_eval(self, student: nn.Module, teacher: nn.Module) -> dict[str, Any] | None:
        """The teacher-scored per-token reverse KL of the student's samples on the held-out rows' prompts (the
        same sampling as training, seeded from the seed alone; on N processes each samples and scores a share of
        them and every rank gets all the numbers), overall and per prompt: prompt i's noise depends on (seed, i)
        only, so two runs with the same seed and held_out sample their held-out prompts with the same noise and
        compare prompt by prompt."""
        if self.prompt_set is not None:
            prompts = self.prompt_set.held
            trained = self.prompts_trained_on
            chosen = (f"the last kd.on_policy.held_out rows of {PROMPTS_KEY} ({self.prompt_set.origin}), never "
                      + (f"sampled in training, but {trained} of them are training rows (trained on "
                         "off-policy)" if trained else "sampled in training"))
        elif self.held:
            prompts = prompts_of(self._held.collate(self.held), self.prompt_tokens, self.budget, self.per_row,
                                 self.s.max_new_tokens)
            chosen = "the dataset's last kd.on_policy.held_out rows (after packing), never trained on"
        else:
            return None
        if not prompts:  # a prompt set with held_out: 0
            return None
        seed = _key(self.seed, "held_out")
        if self.twin is not None:
            self.twin.refresh(student, _key(self.seed, "held_out", "merge"))
        scores = score_samples(student, teacher, prompts, lambda chunk, rows: self._sample(
            student, chunk, seed, rows, len(prompts)), self.rows, self.tokenizer.pad_id, self.num_chunks, self.vocab,
            rank=self.rt.rank, world=self.rt.world_size, gather=self.rt.all_gather_object)
        return {"held_out_rows": len(prompts), "sampled_tokens": sum(scores["tokens"]),
                "reverse_kl_per_token": sum(scores["reverse_kl_sum"]) / max(sum(scores["tokens"]), 1),
                "chosen_as": chosen,
                **per_prompt_summary(scores)}

    def report_held_out(self, student: nn.Module, teacher: nn.Module, output_dir: str | Path) -> dict[str, Any] | None:
        """`held_out_eval`, printed and written to output_dir/on_policy_eval.json by rank 0. The run's last sampling:
        the twin's copy of the student and the decode KV caches go (model/ and a QAT conversion come next)."""
        result = self.held_out_eval(student, teacher)
        self.twin = self.static = None
        if result is not None and self.rt.is_main:
            atomic_write_bytes(Path(output_dir) / EVAL_FILE, (json.dumps(result, indent=2) + "\n").encode())
            print(f"on-policy held-out: teacher-scored reverse KL {result['reverse_kl_per_token']:.4f} per sampled "
                  f"token ({result['sampled_tokens']} tokens, {result['held_out_rows']} prompts: "
                  f"{result['chosen_as']}): {Path(output_dir) / EVAL_FILE}", flush=True)
        return result

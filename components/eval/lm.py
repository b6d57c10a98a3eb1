"""lm-eval model backed by our torchtune-module decoder: `--model recipe --model_args checkpoint=DIR`.

lm-eval's model registry is global, so importing this module registers nothing: `recipe lm_eval`
(cli/lmeval.py) registers `RecipeLM` under the name `recipe` just before it runs lm-eval's CLI, and `evaluate()`
(run.py) hands lm-eval an instance, which needs no name.

Built on lm-eval's `TemplateLM`, so context/continuation splitting (trailing whitespace moves to the
continuation), empty-context handling and request caching are lm-eval's own. Scoring, rolling windows and
generation follow `lm_eval.models.huggingface.HFLM` step for step (same Collator ordering, same left
truncation, same stop-sequence post-processing) so numbers agree with `--model hf` on the same folder.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.nn.functional as F
from jinja2.exceptions import TemplateError
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import (
    Collator,
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from tqdm import tqdm

from ..errors import RecipeError
from ..models.generation import last_logits

log = logging.getLogger(__name__)

# Keys lm-eval itself may add to the constructor call (CLI defaults), which do not apply to us.
_IGNORED_LM_EVAL_ARGS = {"max_batch_size", "trust_remote_code", "parallelize", "revision"}


def _resolve_device(device: str | torch.device | None) -> torch.device:
    # lm-eval's CLI passes device="cuda:0" by default; fall back to CPU on machines without CUDA,
    # like `--model hf` does through accelerate.
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        log.warning("device %s requested but CUDA is not available; using cpu", device)
        return torch.device("cpu")
    return dev


class RecipeLM(TemplateLM):
    """lm-eval LM over our decoder: loglikelihood, loglikelihood_rolling and KV-cached generate_until.

    Under torchrun (WORLD_SIZE > 1) each rank is one data-parallel replica: lm-eval 0.4.13's evaluator gives
    rank r every world_size-th request (by `lm.rank` / `lm.world_size`), pads ranks to equal counts with
    `lm.all_gather`, and collects per-rank metrics on rank 0 with `lm.gather_object`; the methods below are
    those collectives over torch.distributed (gloo on CPU, NCCL on GPU, each rank on its LOCAL_RANK GPU).
    """

    def _join_ranks(self) -> None:
        import torch.distributed as dist

        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size == 1:
            return
        if self._device.type == "cuda":
            self._device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(self._device)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if self._device.type == "cuda" else "gloo")
        self._rank, self._world_size = dist.get_rank(), dist.get_world_size()

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor`, concatenated along dim 0 (0-d tensors become one entry per rank)."""
        if self._world_size == 1:
            return tensor
        import torch.distributed as dist

        t = tensor.reshape(1) if tensor.dim() == 0 else tensor
        parts = [torch.empty_like(t) for _ in range(self._world_size)]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts)

    def gather_object(self, obj: Any, dst: int = 0) -> list | None:
        """Every rank's `obj` as a list on `dst`, None elsewhere."""
        if self._world_size == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self._world_size if self._rank == dst else None
        dist.gather_object(obj, out, dst=dst)
        return out

    def barrier(self) -> None:
        if self._world_size > 1:
            import torch.distributed as dist

            dist.barrier()

    def __init__(
        self,
        checkpoint: str | None = None,
        model: torch.nn.Module | None = None,
        tokenizer: Any = None,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device | None = None,
        batch_size: int | str = 8,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        use_kv_cache: bool = True,
        name: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        unknown = sorted(set(kwargs) - _IGNORED_LM_EVAL_ARGS)
        if unknown:
            raise RecipeError(
                f"--model_args: unknown key(s) {unknown} for model 'recipe'; known: checkpoint, dtype, device, "
                "batch_size, max_length, max_gen_toks, use_kv_cache"
            )
        self._device = _resolve_device(device)
        self._join_ranks()
        if model is None:
            if checkpoint is None:
                raise RecipeError("--model_args: model 'recipe' needs checkpoint=DIR (a Hugging Face model folder)")
            from ..models import read_model_args
            from ..quantization.load import load_checkpoint

            # the whole context the model was trained for, as HFLM takes it from config.json (max_length: null)
            positions = read_model_args(checkpoint).max_position_embeddings
            if max_length is not None and int(max_length) > positions:
                raise RecipeError(f"max_length={max_length} exceeds {checkpoint}/config.json's "
                                  f"max_position_embeddings ({positions})")
            model, tokenizer = load_checkpoint(checkpoint, dtype=dtype, device=self._device,
                                               max_seq_len=int(max_length) if max_length is not None else positions)
        elif tokenizer is None:
            raise RecipeError("RecipeLM(model=...) also needs tokenizer= (a llm_recipe.components.models.Tokenizer)")
        self.model = model
        self.tokenizer = tokenizer
        self._name = name or (str(checkpoint) if checkpoint is not None else type(model).__name__)
        if isinstance(batch_size, str):
            if batch_size.startswith("auto"):
                log.warning("batch_size=%s: automatic batch sizing is not supported; using 8", batch_size)
                batch_size = 8
            else:
                batch_size = int(batch_size)
        self._batch_size = int(batch_size)
        model_max = int(getattr(model, "max_seq_len", 2048))
        self._max_length = int(max_length) if max_length is not None else model_max
        if self._max_length > model_max:
            raise RecipeError(f"max_length={self._max_length} exceeds the model's max_seq_len {model_max}")
        self._max_gen_toks = int(max_gen_toks)
        self.use_kv_cache = str(use_kv_cache).lower() not in ("false", "0", "no")
        param = next(model.parameters())
        self._dtype = param.dtype if param.is_floating_point() else torch.float32

    # ------------------------------------------------------------------ properties lm-eval reads
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        # Same as HFLM: BOS when the tokenizer has one, else EOS.
        bos = self.tokenizer.bos_id
        return bos if bos is not None else self.tokenizer.eos_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return self._name.replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The checkpoint's chat template source (used by lm-eval to fingerprint request caches)."""
        if chat_template is False or chat_template is None:
            return None
        return getattr(self.tokenizer, "_chat_template_src", None) or None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render few-shot chat turns with the checkpoint's template; like HFLM, continue the final message
        when no generation prompt is added, and retry without the system turn if the template rejects it."""
        try:
            text = self.tokenizer.apply_chat_template(chat_history, add_generation_prompt=add_generation_prompt)
        except TemplateError:
            log.warning("Failed to apply chat template. removing the system role in chat history.")
            chat_history = [m for m in chat_history if m["role"] != "system"]
            text = self.tokenizer.apply_chat_template(chat_history, add_generation_prompt=add_generation_prompt)
        if not add_generation_prompt and chat_history:
            # transformers' continue_final_message: cut the render right after the final message's content.
            final = chat_history[-1]["content"].strip()
            if final and final in text:
                text = text[: text.rindex(final) + len(final)]
        return text

    # ------------------------------------------------------------------ tokenization
    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs: Any) -> list[int]:
        # None = the tokenizer's own BOS policy (HF's default add_special_tokens); encode() never doubles a BOS
        # already in the text, matching HFLM's has_bos_prefix check.
        ids = self.tokenizer.encode(string, add_bos=add_special_tokens is not False)
        if left_truncate_len:
            ids = ids[-left_truncate_len:]
        return ids

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ scoring
    def _continuation_logprobs(self, inps: list[list[int]], spans: list[tuple[int, int]]) -> list[torch.Tensor]:
        """Right-pad `inps`, run the model once, and return log-softmax rows [start:end) of each sequence.

        Only the needed positions are projected to the vocabulary (the decoder's `skip_output` hidden-state
        mode), so a batch never materialises full [b, s, vocab] logits.
        """
        width = max(len(x) for x in inps)
        batch = torch.full((len(inps), width), self.tokenizer.pad_id, dtype=torch.long)
        for i, x in enumerate(inps):
            batch[i, : len(x)] = torch.tensor(x, dtype=torch.long)
        batch = batch.to(self.device)
        chunked = hasattr(self.model, "skip_output") and callable(getattr(self.model, "output", None))
        with torch.inference_mode():
            if chunked:
                prev = self.model.skip_output
                self.model.skip_output = True
                try:
                    hidden = self.model(batch)
                finally:
                    self.model.skip_output = prev
                rows = [self.model.output(hidden[i, a:b]) for i, (a, b) in enumerate(spans)]
            else:
                logits = self.model(batch)
                rows = [logits[i, a:b] for i, (a, b) in enumerate(spans)]
            return [F.log_softmax(r.float(), dim=-1) for r in rows]

    def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str] | None, list[int], list[int]]],
                              disable_tqdm: bool = False, override_bs: int | None = None) -> list[tuple[float, bool]]:
        res: list[tuple[float, bool]] = []

        def _collate(req: tuple) -> tuple:
            toks = req[1] + req[2]
            return -len(toks), tuple(toks)

        def _lookup_one_token_cont(req: tuple) -> list[int]:
            return req[-2] + req[-1][:-1]

        re_ord = Collator(requests, sort_fn=_collate, group_by="contexts", group_fn=_lookup_one_token_cont)
        chunks = re_ord.get_batched(n=override_bs or self.batch_size)
        pbar = tqdm(total=len(requests), disable=disable_tqdm, desc="Running loglikelihood requests")
        for chunk in chunks:
            inps, spans = [], []
            for _, context_enc, continuation_enc in chunk:
                if not context_enc or not continuation_enc:
                    raise RecipeError("loglikelihood request with an empty context or continuation after tokenization")
                # Same left truncation as HFLM: keep the last max_length+1 tokens, drop the final one.
                inp = (context_enc + continuation_enc)[-(self.max_length + 1):][:-1]
                contlen = len(continuation_enc)
                inps.append(inp)
                spans.append((len(inp) - contlen, len(inp)))
            logprobs = self._continuation_logprobs(inps, spans)
            for (request_str, ctx_tokens, _), cont_toks, lp in zip(
                chunk, [c[2] for c in chunk], logprobs
            ):
                lp = lp.unsqueeze(0)  # [1, contlen, vocab]
                greedy_tokens = lp.argmax(dim=-1)
                for req_str, cont, logits in re_ord.get_cache(
                    req_str=request_str, cxt_toks=ctx_tokens, cont_toks=cont_toks, logits=lp
                ):
                    cont_t = torch.tensor(cont, dtype=torch.long, device=logits.device).unsqueeze(0)
                    is_greedy = bool((greedy_tokens[:, -cont_t.shape[1]:] == cont_t).all())
                    picked = torch.gather(logits, 2, cont_t.unsqueeze(-1)).squeeze(-1)
                    answer = (float(picked.sum()), is_greedy)
                    res.append(answer)
                    if req_str is not None:
                        self.cache_hook.add_partial("loglikelihood", req_str, answer)
                    pbar.update(1)
        pbar.close()
        return re_ord.get_original(res)

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """Total log-likelihood of each document, scored in disjoint max_length windows (lm-eval's scheme)."""
        all_windows: list[tuple[int, tuple]] = []
        counts = []
        for idx, (string,) in enumerate(tqdm([r.args for r in requests], disable=disable_tqdm)):
            windows = [
                (None, *lm_utils.make_disjoint_window(w))
                for w in lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            all_windows.extend((idx, w) for w in windows)
            counts.append(len(windows))
        scores = []
        for i in range(0, len(all_windows), self.batch_size):
            batch = all_windows[i: i + self.batch_size]
            scores += self._loglikelihood_tokens([w for _, w in batch], disable_tqdm=True, override_bs=len(batch))
        out, pos = [], 0
        for req, n in zip(requests, counts):
            total = sum(s for s, _ in scores[pos: pos + n])
            pos += n
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return out

    # ------------------------------------------------------------------ generation
    def _sample(self, logits: torch.Tensor, do_sample: bool, temperature: float, top_k: int | None,
                top_p: float | None) -> torch.Tensor:
        if not do_sample or temperature == 0.0:
            return logits.argmax(dim=-1)
        logits = logits.float() / max(temperature, 1e-5)
        if top_k is not None and 0 < top_k < logits.shape[-1]:
            kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if top_p is not None and 0.0 < top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
            probs = sorted_logits.softmax(-1)
            # Drop tokens once the mass *before* them already reaches top_p (always keeps the top token).
            drop = probs.cumsum(-1) - probs >= top_p
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
        return torch.multinomial(logits.softmax(-1), 1).squeeze(-1)


    def generate_tokens(self, contexts: list[list[int]], max_new_tokens: int, stop: list[str] | None = None,
                        do_sample: bool = False, temperature: float = 0.0, top_k: int | None = None,
                        top_p: float | None = None, use_kv_cache: bool | None = None) -> list[list[int]]:
        """Decode a batch of token prompts (left-padded) until every row hit a stop id, a stop string, or
        `max_new_tokens`. KV-cached by default; `use_kv_cache=False` recomputes the full sequence each step."""
        use_cache = self.use_kv_cache if use_kv_cache is None else use_kv_cache
        stop = [s for s in (stop or []) if s]
        stop_ids = torch.tensor(sorted(set(getattr(self.tokenizer, "stop_ids", [self.eot_token_id]))),
                                device=self.device)
        b, plen = len(contexts), max(len(c) for c in contexts)
        total = plen + max_new_tokens
        if total > self.model.max_seq_len:
            raise RecipeError(f"prompt ({plen} tokens) + max_gen_toks ({max_new_tokens}) exceeds the model's "
                              f"max_seq_len {self.model.max_seq_len}; lower max_gen_toks or max_length")
        tokens = torch.full((b, total), self.tokenizer.pad_id, dtype=torch.long, device=self.device)
        valid = torch.ones((b, total), dtype=torch.bool, device=self.device)
        for i, c in enumerate(contexts):
            tokens[i, plen - len(c): plen] = torch.tensor(c, dtype=torch.long)
            valid[i, : plen - len(c)] = False
        # Causal mask that also hides left padding; each row's positions start at 0 on its first real token.
        causal = torch.tril(torch.ones(total, total, dtype=torch.bool, device=self.device))
        mask = causal[None] & valid[:, None, :]
        mask.diagonal(dim1=1, dim2=2)[:] = True  # padded queries attend to themselves (no all -inf rows)
        positions = (valid.long().cumsum(-1) - 1).clamp(min=0)

        done = torch.zeros(b, dtype=torch.bool, device=self.device)
        finished_at = [max_new_tokens] * b
        with torch.inference_mode():
            if use_cache:
                with self.device:  # torchtune allocates the cache buffers on the default device
                    self.model.setup_caches(batch_size=b, dtype=self._dtype, decoder_max_seq_len=total)
            try:
                for t in range(max_new_tokens):
                    cur = plen + t
                    if use_cache:
                        start = 0 if t == 0 else cur - 1
                        logits = last_logits(self.model, tokens[:, start:cur], positions[:, start:cur],
                                             mask[:, start:cur, :])
                    else:
                        logits = last_logits(self.model, tokens[:, :cur], positions[:, :cur], mask[:, :cur, :cur])
                    nxt = self._sample(logits, do_sample, temperature, top_k, top_p)
                    nxt = torch.where(done, torch.full_like(nxt, self.tokenizer.pad_id), nxt)
                    tokens[:, cur] = nxt
                    hit = torch.isin(nxt, stop_ids) & ~done
                    for i in hit.nonzero().flatten().tolist():
                        finished_at[i] = t  # stop token itself is not part of the output
                    done |= hit
                    if stop:
                        for i in (~done).nonzero().flatten().tolist():
                            text = self.tok_decode(tokens[i, plen: cur + 1].tolist())
                            if any(s in text for s in stop):
                                done[i] = True
                                finished_at[i] = t + 1
                    if bool(done.all()):
                        break
            finally:
                if use_cache:
                    from ..models.generation import delete_kv_caches

                    delete_kv_caches(self.model)
        return [tokens[i, plen: plen + finished_at[i]].tolist() for i in range(b)]

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Generate for each (context, gen_kwargs) request; cut at the first `until` string (EOS included)."""
        res = []

        def _collate(req: tuple) -> tuple:
            return -len(self.tok_encode(req[0])), req[0]

        re_ords = Collator([r.args for r in requests], sort_fn=_collate, group_by="gen_kwargs",
                           group_fn=lambda x: x[1])
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        pbar = tqdm(total=len(requests), disable=disable_tqdm, desc="Running generate_until requests")
        for chunk in re_ords.get_batched(n=self.batch_size):
            contexts, all_gen_kwargs = zip(*chunk)
            gen_kwargs = all_gen_kwargs[0]
            if not isinstance(gen_kwargs, dict):
                raise RecipeError(f"generation_kwargs must be a dict, got {gen_kwargs!r}")
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen_toks = int(kwargs.pop("max_gen_toks"))
            max_ctx_len = self.max_length - max_gen_toks
            if max_ctx_len <= 0:
                raise RecipeError(f"max_gen_toks ({max_gen_toks}) must be below max_length ({self.max_length})")
            encoded = [self.tok_encode(c, left_truncate_len=max_ctx_len) for c in contexts]
            outs = self.generate_tokens(
                encoded, max_gen_toks, stop=[s for s in until if s != eos],
                do_sample=bool(kwargs.get("do_sample", False)), temperature=float(kwargs.get("temperature", 0.0)),
                top_k=kwargs.get("top_k"), top_p=kwargs.get("top_p"),
            )
            for out, context in zip(outs, contexts):
                s = postprocess_generated_text(self.tok_decode(out), stop=until, think_end_token=None)
                res.append(s)
                self.cache_hook.add_partial("generate_until", (context, gen_kwargs), s)
                pbar.update(1)
        pbar.close()
        return re_ords.get_original(res)

    def get_model_info(self) -> dict:
        """Extra fields for results.json's config block."""
        return {
            "model_num_parameters": sum(p.numel() for p in self.model.parameters()),
            "model_dtype": str(self._dtype),
            "model_name": self._name,
        }

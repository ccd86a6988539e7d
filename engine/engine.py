"""The engine: continuous batching over one causal LM. No threads and no I/O of its own.

The caller (the gateway's engine thread, the CLI, a benchmark) adds requests and calls `step()`
in a loop; each step runs one forward pass over every scheduled sequence and returns the new
tokens of each request that advanced, finished or was aborted.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import ContextLengthExceededError, DuplicateRequestError, RequestError
from engine.model_runner import ForwardItem, ModelRunner
from engine.outputs import RequestOutput, RequestStats
from engine.sampler import SamplingRow, process_logits, sample, token_logprobs
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSequence, Scheduler
from engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class EngineStats:
    num_waiting: int
    num_running: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_cache_bytes: int

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runner = ModelRunner(config)
        self.tokenizer = self.runner.tokenizer
        self.model_name = self.runner.source.name
        self.max_model_len = self.runner.max_model_len
        self.block_manager = BlockManager(self.runner.kv_cache.num_blocks, config.block_size)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self._seqs: dict[str, Sequence] = {}
        self._aborted: list[Sequence] = []
        self._rng = torch.Generator().manual_seed(config.seed)
        self.eos_token_ids = self._eos_ids()

    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        gen_eos = getattr(getattr(self.runner.model, "generation_config", None), "eos_token_id", None)
        for value in (gen_eos, getattr(self.tokenizer, "eos_token_id", None)):
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        return frozenset(ids)

    # ---- public API -------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams) -> None:
        if request_id in self._seqs:
            raise DuplicateRequestError(f"request id {request_id!r} is already in the engine")
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise RequestError("the prompt is empty")
        if min(prompt) < 0 or max(prompt) >= self.runner.vocab_size:
            raise RequestError(f"prompt token ids must be in [0, {self.runner.vocab_size})")
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise ContextLengthExceededError(
                f"this model's maximum context length is {self.max_model_len} tokens; the request asks for "
                f"{len(prompt)} prompt + {params.max_tokens} completion tokens"
            )
        device = self.runner.device
        generator = torch.Generator(device=device)
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._rng))
        generator.manual_seed(seed)
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, prompt, params.stop, params.include_stop_str_in_output)
        seq = Sequence(
            request_id=request_id,
            token_ids=prompt,
            num_prompt_tokens=len(prompt),
            params=params,
            generator=generator,
            stats=RequestStats(arrival_time=time.monotonic(), num_prompt_tokens=len(prompt)),
            detokenizer=detok,
        )
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks; its final output comes with the next step."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.remove(seq)
        seq.finish_reason = "abort"
        self._aborted.append(seq)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted)

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_waiting=len(self.scheduler.waiting),
            num_running=len(self.scheduler.running),
            kv_blocks_total=bm.num_blocks,
            kv_blocks_used=bm.num_used_blocks,
            kv_cache_bytes=self.runner.kv_cache.nbytes,
        )

    def step(self) -> list[RequestOutput]:
        outputs = [self._output(seq) for seq in self._aborted]
        self._aborted.clear()
        batch = self.scheduler.schedule()
        if not batch:
            return outputs
        now = time.monotonic()
        items = [self._forward_item(s) for s in batch]
        logits = self.runner.execute(items)  # [num_sampling, vocab]
        sampling = [s for s in batch if s.samples]
        rows = [self._sampling_row(s.seq) for s in sampling]
        tokens: list[int] = []
        logprobs: list = []
        if rows:
            tokens = sample(process_logits(logits, rows), rows)
            logprobs = token_logprobs(logits, tokens, rows)
        done = time.monotonic()
        for s in batch:
            seq = s.seq
            seq.num_computed_tokens += s.num_tokens
            seq.stats.num_steps += 1
            if seq.stats.first_scheduled_time is None:
                seq.stats.first_scheduled_time = now
            if seq.num_computed_tokens <= seq.num_prompt_tokens:
                seq.stats.num_prefill_chunks += 1
        for s, token, lp in zip(sampling, tokens, logprobs, strict=True):
            self._append_token(s.seq, token, lp, done)
        for s in batch:
            seq = s.seq
            if seq.pending_token_ids or seq.is_finished:
                outputs.append(self._output(seq))
        return outputs

    # ---- internals ---------------------------------------------------------------------------

    def _forward_item(self, s: ScheduledSequence) -> ForwardItem:
        seq = s.seq
        start = seq.num_computed_tokens
        return ForwardItem(seq.token_ids[start : start + s.num_tokens], start, seq.block_table, int(s.samples))

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        p = seq.params
        suppress: tuple[int, ...] = ()
        if seq.num_output_tokens < p.min_tokens:
            suppress = tuple(p.stop_token_ids) + (() if p.ignore_eos else tuple(self.eos_token_ids))
        return SamplingRow(p, seq.token_ids, seq.num_prompt_tokens, seq.generator, suppress)

    def _append_token(self, seq: Sequence, token: int, lp: object, now: float) -> None:
        seq.token_ids.append(token)
        seq.pending_token_ids.append(token)
        if lp is not None:
            seq.pending_logprobs.append(lp)  # type: ignore[arg-type]
        stats = seq.stats
        stats.num_output_tokens = seq.num_output_tokens
        if stats.first_token_time is None:
            stats.first_token_time = now
        stats.last_token_time = now
        p = seq.params
        stop_string = seq.detokenizer.append(token) if seq.detokenizer is not None else None
        if seq.num_output_tokens >= p.min_tokens:
            if token in p.stop_token_ids:
                self._finish(seq, "stop", token)
                return
            if token in self.eos_token_ids and not p.ignore_eos:
                self._finish(seq, "stop", None)
                return
            if stop_string is not None:
                self._finish(seq, "stop", stop_string)
                return
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            self._finish(seq, "length", None)

    def _finish(self, seq: Sequence, reason: str, stop_reason: str | int | None) -> None:
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        self.scheduler.remove(seq)
        self._seqs.pop(seq.request_id, None)

    def _output(self, seq: Sequence) -> RequestOutput:
        finished = seq.status is SequenceStatus.FINISHED
        if finished and seq.stats.finished_time is None:
            seq.stats.finished_time = time.monotonic()
        text = seq.detokenizer.take(finished) if seq.detokenizer is not None else ""
        out = RequestOutput(
            request_id=seq.request_id,
            new_token_ids=seq.pending_token_ids,
            new_text=text,
            finished=finished,
            finish_reason=seq.finish_reason,
            stats=dataclasses.replace(seq.stats),  # a snapshot: the caller may read it on another thread
            stop_reason=seq.stop_reason,
            logprobs=seq.pending_logprobs if seq.params.logprobs is not None else None,
        )
        seq.pending_token_ids, seq.pending_logprobs = [], []
        return out

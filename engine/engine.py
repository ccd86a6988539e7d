"""The engine: continuous batching over one causal LM, with per-request speculation.

No threads and no I/O of its own. The caller (the gateway's engine thread, the CLI, a benchmark)
adds requests and calls `step()` in a loop. A step is schedule -> run -> process outputs:

- schedule (scheduler.py): which sequences compute how many tokens this step;
- run: drafts for the speculating sequences (spec_decode/), one target forward pass over every
  scheduled sequence (prefill chunks, plain decodes, and decodes that verify k drafted tokens, a
  different k per sequence, all share the batch), then sampling, or verification of the drafts:
  per sequence that emits, its accepted tokens and their logprobs (spec_decode/verified.py);
  speculation then settles what was verified (KV rewound, its controller taught);
- process outputs (output_processor.py): tokens appended, stop rules and grammars applied, counters
  recorded, one `RequestOutput` per sequence that moved.

One request's failure is its own: an exception while drafting, processing logits, sampling,
verifying, settling speculation or processing its tokens for one sequence (or logits with no finite
value in its rows) ends that request with finish_reason "error" and the rest of the batch goes on.
A failed forward pass fails the sequences in it; `consecutive_forward_failures` tells a supervisor
when the engine itself is broken.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from specgate.engine.admission import checked_prompt, new_sequence, request_generator
from specgate.engine.batch_layout import ForwardItem
from specgate.engine.block_manager import BlockManager, blocks_for
from specgate.engine.config import EngineConfig
from specgate.engine.errors import DuplicateRequestError, RequestError
from specgate.engine.model_runner import ModelRunner
from specgate.engine.output_processor import OutputProcessor
from specgate.engine.outputs import RequestOutput
from specgate.engine.sampler import SamplingRow, process_logits, sample, token_logprobs
from specgate.engine.sampling_params import SamplingParams
from specgate.engine.scheduler import ScheduledSequence, Scheduler
from specgate.engine.sequence import Sequence, SequenceGroup
from specgate.engine.spec_decode import tree_proposal
from specgate.engine.spec_decode.cost_model import CostModel
from specgate.engine.spec_decode.drafting import mean_context
from specgate.engine.spec_decode.proposer import Proposal, Proposer
from specgate.engine.spec_decode.rejection_sampler import verify_draft
from specgate.engine.spec_decode.speculation import ForwardPass, Speculation
from specgate.engine.spec_decode.verified import Verified
from specgate.engine.step_cost import MIN_BUCKET_STEPS
from specgate.engine.stop_rules import sampling_row
from specgate.engine.structured_output.manager import StructuredOutputManager
from specgate.engine.vocab import LoadSnapshot, SpecParams

logger = logging.getLogger("specgate.engine")
# Forward-pass sizes a fresh engine times (Engine.warm_up): chains and trees of one request, and a
# full batch's decode steps with their drafts; past the last, the curve grows along its last segment.
WARM_UP_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
T = TypeVar("T")


@dataclass(slots=True)
class _Step:
    """One step's run, handed from phase to phase."""

    batch: list[ScheduledSequence]
    drafts: list[Proposal]  # per sequence (empty for most)
    samples: list[bool]  # per sequence: whether it emits a token this step
    items: list[ForwardItem]
    feeds: list[Proposer | None]  # per sequence: its proposer if it drafts from hidden states
    scheduled_at: float  # time.monotonic()
    started: float = 0.0  # time.perf_counter() at the forward pass
    logits: torch.Tensor | None = None  # [sum of num_logits, vocab]
    hidden: list[torch.Tensor] | None = None  # per item [len(token_ids), hidden_size]
    # Keys each new token of the pass attends to, on average (the cost model's context).
    context: float = field(init=False)
    forward: ForwardPass | None = None  # the pass as its drafts are priced, once it ran
    emitted_at: float = 0.0  # time.monotonic() when its tokens were sampled: their emit time
    verified: list[Verified] = field(default_factory=list)  # per sequence that emits, batch order

    def __post_init__(self) -> None:
        self.context = mean_context((it.start, len(it.token_ids)) for it in self.items)

    @property
    def num_tokens(self) -> int:
        return sum(len(it.token_ids) for it in self.items)


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runner = ModelRunner(config)
        self.tokenizer = self.runner.tokenizer
        self.model_name = self.runner.source.name
        self.max_model_len = self.runner.max_model_len
        self.block_manager = BlockManager(
            self.runner.kv_cache.num_blocks,
            config.block_size,
            caching=config.prefix_caching,
            max_cached_blocks=self._max_cached_blocks(),
        )
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self._seqs: dict[str, Sequence] = {}  # by seq_id
        self._requests: dict[str, list[Sequence]] = {}  # a request's sequences not yet finished
        self._aborted: list[Sequence] = []
        self._rng = torch.Generator().manual_seed(config.seed)
        self.eos_token_ids = self._eos_ids()
        self.consecutive_forward_failures = 0  # reset by every forward pass that succeeds
        self._num_steps = 0
        self._last_step = (0, 0.0)  # the last step's emitted tokens and wall seconds
        self.speculation = Speculation(
            self.runner, self.block_manager, config, self.eos_token_ids, self._fail
        )
        self.structured_output = StructuredOutputManager(
            self.tokenizer, self.runner.vocab_size, self.eos_token_ids
        )
        self.output_processor = OutputProcessor(
            self.max_model_len, self.eos_token_ids, self._finish, self._fail, self.speculation.commit
        )
        if config.warm_up:
            self.warm_up()

    @property
    def cost_model(self) -> CostModel:
        """Measured step costs (forward passes, drafting) behind every controller's choices."""
        return self.speculation.cost_model

    @cost_model.setter
    def cost_model(self, model: CostModel) -> None:
        self.speculation.cost_model = model

    def _max_cached_blocks(self) -> int | None:
        limit = self.config.prefix_cache_bytes
        if limit is None:
            return None
        cache = self.runner.kv_cache
        return limit // max(1, cache.nbytes // cache.num_blocks)

    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        gen_eos = getattr(getattr(self.runner.model, "generation_config", None), "eos_token_id", None)
        for value in (gen_eos, getattr(self.tokenizer, "eos_token_id", None)):
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        return frozenset(ids)

    def proposer(self, method: str) -> Proposer:
        """The engine's proposer for `method`, built from the registry on first use."""
        return self.speculation.proposer(method)

    def warm_up(self, sizes: Seq[int] = WARM_UP_SIZES, reps: int = MIN_BUCKET_STEPS) -> None:
        """Time forward passes of `sizes` new tokens (each `reps` times, one sequence at the start of
        scratch KV blocks) into the cost model, before any request. A fresh engine's controllers
        would otherwise price drafts on whatever passes its first requests happen to run: its first
        full batch, priced by one measured prefill chunk, drafted k_max for every request. The
        passes also make the allocations a first batch of these sizes would pay."""
        if self._requests:
            raise RuntimeError("warm_up runs before any request")
        limit = min(self.config.max_num_batched_tokens, self.max_model_len)
        room = self.block_manager.num_free_blocks * self.config.block_size
        sizes = [n for n in sizes if 0 < n <= min(limit, room)]
        if not sizes:
            return
        table = list(range(blocks_for(max(sizes), self.config.block_size)))  # every block is free
        ids = [(7919 * i) % self.runner.vocab_size for i in range(max(sizes))]  # any tokens will do
        began = time.perf_counter()
        for _ in range(reps):
            for n in sizes:
                started = time.perf_counter()
                logits = self.runner.execute([ForwardItem(ids[:n], 0, table, n)])  # [n, vocab]
                logits.argmax(dim=-1).tolist()  # as a pass's picks would (and waits for a GPU)
                seconds = time.perf_counter() - started
                self.cost_model.observe_forward(n, seconds, mean_context([(0, n)]))
        took = time.perf_counter() - began
        logger.info("warm-up: %d timed passes of %s tokens in %.2f s", reps * len(sizes), sizes, took)

    # ---- public API -------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Seq[int],
        params: SamplingParams,
        spec: SpecParams | None = None,
        cache_scope: str | None = "",
        prefix_salt: str | None = "",
        tenant: str = "",
    ) -> None:
        """`cache_scope`: requests share a proposer's cross-request state (the suffix cache) only
        within one scope; None shares nothing. `prefix_salt`: requests reuse each other's cached KV
        blocks (the prefix cache) only under the same salt; None shares nothing. `tenant`: whom
        the request is for; batch slots are shared fairly between tenants.

        `params.n` > 1 samples n sequences from the prompt, which is prefilled once
        (sequence.SequenceGroup); each has its own outputs (`RequestOutput.index`), random stream
        (seed + i with a seed), grammar state and speculation, and ends on its own; `abort` ends
        them all."""
        if request_id in self._requests:
            raise DuplicateRequestError(f"request id {request_id!r} is already in the engine")
        prompt = checked_prompt(prompt_token_ids, params, self.runner.vocab_size, self.max_model_len)
        proposer = None
        if spec is not None and spec.enabled:
            try:
                proposer = self.proposer(spec.method)
            except ValueError as exc:
                raise RequestError(str(exc)) from exc
        group = self._group(request_id, prompt, params, proposer)
        seqs = []
        for index in range(params.n):
            # vLLM's per-sequence seeds: sequence i is reproducible, and differs from its siblings.
            seed = None if params.seed is None else params.seed + index
            seq = new_sequence(
                request_id,
                prompt,
                params,
                spec if proposer is not None else None,
                request_generator(seed, self.runner.device, self._rng),
                self.tokenizer,
                prefix_salt,
                tenant,
                index,
            )
            if seq.seq_id in self._seqs:
                raise DuplicateRequestError(f"request id {request_id!r} collides with {seq.seq_id!r}")
            seq.constraint = self.structured_output.constraint(params.grammar)
            seq.group = group
            seqs.append(seq)
        self.speculation.start(seqs, prompt, cache_scope)
        if group is not None:
            group.members.extend(seqs)
        self._requests[request_id] = list(seqs)
        for seq in seqs:
            self._seqs[seq.seq_id] = seq
            self.scheduler.add(seq)

    def _group(
        self, request_id: str, prompt: list[int], params: SamplingParams, proposer: Proposer | None
    ) -> SequenceGroup | None:
        """The sequence group of an n > 1 request, once its n sequences can fit the KV pool together."""
        if params.n == 1:
            return None
        bs = self.block_manager.block_size
        # The prompt's full blocks, its last token excluded: that one is computed by each sequence.
        fork_point = (len(prompt) - 1) // bs * bs
        if proposer is not None and proposer.needs_hidden and self.runner.features is None:
            # Without the feature pool (prefix caching off) a sibling could not hand a feature-level
            # drafter the shared prompt's features: each sequence prefills its own.
            fork_point = 0
        shared = fork_point // bs
        need = shared + params.n * (blocks_for(len(prompt) + params.max_tokens, bs) - shared)
        if need > self.block_manager.num_blocks:
            raise RequestError(
                f"n={params.n} sequences of up to {len(prompt) + params.max_tokens} tokens need {need} KV "
                f"blocks together; this engine holds {self.block_manager.num_blocks}: lower n or max_tokens"
            )
        return SequenceGroup(request_id, fork_point)

    def abort(self, request_id: str) -> bool:
        """Stop a request (all of its sequences) now and free its KV blocks; the final outputs come
        with the next step."""
        seqs = self._requests.get(request_id)
        if seqs is None:
            return False
        for seq in list(seqs):
            self._finish(seq, "abort", None)
            self._aborted.append(seq)
        return True

    def request_ids(self) -> list[str]:
        """Requests in the engine now: waiting, running or preempted."""
        return list(self._requests)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted)

    def load(self) -> LoadSnapshot:
        """The engine's load as of its last step: what its clients route on."""
        bm = self.block_manager
        return LoadSnapshot(
            num_running=len(self.scheduler.running),
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=min(1.0, bm.num_used_blocks / bm.num_blocks),
            num_batched_tokens=self._last_step[0],
            step_time=self._last_step[1],
            num_steps=self._num_steps,
            kv_blocks_used=bm.num_used_blocks,
        )

    def step(self) -> list[RequestOutput]:
        """One engine step: schedule -> run (drafts, the forward pass, sampling and verification;
        speculation settles what was verified) -> the output processor."""
        started = time.perf_counter()
        outputs = self._step()
        self._num_steps += 1
        self._last_step = (sum(len(o.new_token_ids) for o in outputs), time.perf_counter() - started)
        return outputs

    def _step(self) -> list[RequestOutput]:
        aborted, self._aborted = self._aborted, []
        batch = self.scheduler.schedule()
        seqs = [*aborted, *(s.seq for s in batch)]  # whose news this step may carry
        step = self._run(batch) if batch else None
        if step is None or step.forward is None:  # no pass ran: its sequences failed, if it had any
            return self.output_processor.process([], seqs, time.monotonic())
        for v in step.verified:
            self._guard(v.seq, "settling its speculation", self.speculation.settle, v, step.forward)
        outputs = self.output_processor.process(step.verified, seqs, step.emitted_at)
        self.speculation.observe_forward(step.forward, time.perf_counter() - step.started)
        for s in step.batch:
            if not s.seq.is_finished:
                self.block_manager.publish(s.seq)  # its newly committed full blocks
        return outputs

    # ---- run: drafts, the forward pass, sampling and verification ----------------------------

    def _run(self, batch: list[ScheduledSequence]) -> _Step | None:
        """The scheduled sequences' step up to their verified tokens (`_Step.verified`); None if no
        sequence got as far as the forward pass."""
        for seq in self.scheduler.hits:
            self._guard(seq, "restoring cached target features", self.speculation.restore_features, seq)
        drafts = self.speculation.propose(batch)  # KV room reserved
        kept = [i for i, s in enumerate(batch) if not s.seq.is_finished]  # not failed while drafting
        if not kept:
            return None
        step = _Step(
            batch=[batch[i] for i in kept],
            drafts=[drafts[i] for i in kept],
            samples=[batch[i].samples for i in kept],  # decided before the step advances any sequence
            items=[self._forward_item(batch[i], drafts[i]) for i in kept],
            feeds=[self.speculation.feature_proposer(batch[i].seq) for i in kept],
            scheduled_at=time.monotonic(),
        )
        if self._forward(step):
            self._sample(step)
        return step

    def _forward(self, step: _Step) -> bool:
        """One target pass over every item; False (its sequences failed) if the pass raised."""
        step.started = time.perf_counter()
        try:
            step.logits, step.hidden = self.runner.execute_with_hidden(step.items, any(step.feeds))
        except Exception as exc:
            # Nothing of this pass can be trusted: its sequences fail, the waiting ones go on.
            self.consecutive_forward_failures += 1
            logger.exception("forward pass over %d sequences failed", len(step.batch))
            for s in step.batch:
                self._fail(s.seq, f"the forward pass failed ({type(exc).__name__})")
            return False
        self.consecutive_forward_failures = 0
        if step.hidden is not None:
            for s, it, feed, h, sampled in zip(
                step.batch, step.items, step.feeds, step.hidden, step.samples, strict=True
            ):
                if feed is not None and not sampled:  # a prefill chunk: every position is the prompt's
                    self._guard(
                        s.seq, "reading target features", feed.observe_hidden, s.seq.seq_id, it.start, h
                    )
        return True

    def _sample(self, step: _Step) -> None:
        """Sample, or verify the drafts of, every sequence that emits this step."""
        assert step.logits is not None
        rows: list[SamplingRow] = []
        blocks: list[tuple[int, slice]] = []  # per emitting sequence: its rows
        for i, (s, d, sampled) in enumerate(zip(step.batch, step.drafts, step.samples, strict=True)):
            if sampled:
                try:  # a grammar's masks are computed here: its failure is its request's alone
                    own = [
                        sampling_row(s.seq, extra, self.eos_token_ids) for extra in tree_proposal.histories(d)
                    ]
                except Exception as exc:
                    logger.exception("request %s failed while its sampling rows were built", s.seq.seq_id)
                    self._fail(
                        s.seq, f"the engine failed while masking by its grammar ({type(exc).__name__})"
                    )
                    continue
                first = len(rows)
                rows.extend(own)
                blocks.append((i, slice(first, len(rows))))
        processed, usable = self._process(step.batch, step.logits, rows, blocks)
        for s in step.batch:
            seq = s.seq
            seq.num_computed_tokens += s.num_tokens
            seq.stats.num_steps += 1
            if seq.stats.scheduled_ts is None:
                seq.stats.scheduled_ts = step.scheduled_at
            if seq.num_computed_tokens <= seq.num_prompt_tokens:
                seq.stats.num_prefill_chunks += 1
        step.emitted_at = time.monotonic()
        step.forward = ForwardPass(
            num_tokens=step.num_tokens,
            ms=(time.perf_counter() - step.started) * 1e3,  # for telemetry and the drafts' price
            context=step.context,
            num_drafted=sum(len(d.token_ids) for d in step.drafts),
        )
        for i, block in blocks:
            seq = step.batch[i].seq
            if seq.is_finished:
                continue  # failed while its logits were processed
            if not all(usable[block]):
                self._fail(seq, "the model produced no finite logits for this request")
                continue
            args = (step.drafts[i], step.logits[block], processed[block], rows[block], step.items[i].start)
            hidden = step.hidden[i] if step.hidden is not None and step.feeds[i] is not None else None
            verified = self._guard(seq, "sampling", self._verify, seq, *args, hidden)
            if verified is not None:
                step.verified.append(verified)

    def _verify(
        self,
        seq: Sequence,
        proposal: Proposal,
        raw: torch.Tensor,  # [k + 1, vocab]
        processed: torch.Tensor,  # [k + 1, vocab]
        rows: list[SamplingRow],
        position: int,  # the step's first token's
        hidden: torch.Tensor | None,  # [k + 1, hidden], for a feature-level proposer
    ) -> Verified:
        """One sequence's tokens: its draft verified (the accepted drafts, then one recovered or
        bonus token), or one token sampled; and their logprobs."""
        draft, parents = proposal.token_ids, proposal.parents
        path: list[int] = []  # accepted nodes
        if draft:
            verified = verify_draft(
                processed, draft, parents, proposal.probs, seq.params.greedy, seq.generator
            )
            tokens, path = verified.token_ids, verified.path
        else:
            tokens = sample(processed, rows)
        emitted = [0, *(n + 1 for n in path)]  # logit rows behind the emitted tokens
        emitted_rows = [rows[r] for r in emitted]
        scored = raw[emitted]  # [len(emitted), vocab]
        if seq.constraint is not None and seq.params.logprobs is not None:
            # A constrained request reports the masked law's logprobs (as vLLM does).
            allowed = torch.stack([r.allowed for r in emitted_rows if r.allowed is not None])  # [n, vocab]
            scored = scored.masked_fill(~allowed[:, : scored.shape[-1]], float("-inf"))
        logprobs = token_logprobs(scored, tokens, emitted_rows)
        return Verified(seq, proposal, path, tokens, logprobs, position, hidden)

    def _process(
        self,
        batch: list[ScheduledSequence],
        logits: torch.Tensor,  # [num_rows, vocab]
        rows: list[SamplingRow],
        blocks: list[tuple[int, slice]],
    ) -> tuple[torch.Tensor, list[bool]]:
        """Processed logits [num_rows, vocab] and, per row, whether it has a finite value to sample.

        One batched call; if it raises, each sequence's rows are processed on their own so that the
        request whose rows are at fault fails alone."""
        if not rows:
            return logits, []
        try:
            processed = process_logits(logits, rows)
        except Exception:
            processed = torch.full(logits.shape, float("-inf"), dtype=torch.float32, device=logits.device)
            for i, block in blocks:
                seq = batch[i].seq
                try:
                    processed[block] = process_logits(logits[block], rows[block])
                except Exception as exc:
                    logger.exception("request %s failed while its logits were processed", seq.seq_id)
                    self._fail(seq, f"the engine failed while processing logits ({type(exc).__name__})")
        # A row is usable if some token has a finite logit and none is NaN.
        usable = (processed.isfinite().any(dim=-1) & ~processed.isnan().any(dim=-1)).tolist()  # [num_rows]
        return processed, usable

    def _forward_item(self, s: ScheduledSequence, draft: Proposal) -> ForwardItem:
        seq = s.seq
        start = seq.num_computed_tokens
        tokens = seq.token_ids[start : start + s.num_tokens] + draft.token_ids
        num_logits = (1 + len(draft.token_ids)) if s.samples else 0
        # A tree's root is the one real token (a speculating sequence decodes one at a time).
        return ForwardItem(tokens, start, seq.block_table, num_logits, draft.parents)

    # ---- fault isolation and a sequence's end ------------------------------------------------

    def _fail(self, seq: Sequence, message: str) -> None:
        """End one request with an error; its blocks are freed and the rest of the batch goes on."""
        if seq.is_finished:
            return
        seq.error = message
        self._finish(seq, "error", None)

    def _guard(self, seq: Sequence, what: str, fn: Callable[..., T], *args: object) -> T | None:
        """Run one request's part of the step; an exception fails that request alone (None then)."""
        try:
            return fn(*args)
        except Exception as exc:
            logger.exception("request %s failed while %s", seq.seq_id, what)
            self._fail(seq, f"the engine failed while {what} ({type(exc).__name__})")
            return None

    def _finish(self, seq: Sequence, reason: str, stop_reason: str | int | None) -> None:
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        self.scheduler.remove(seq)
        self._seqs.pop(seq.seq_id, None)
        live = self._requests.get(seq.request_id)
        if live is not None and seq in live:
            live.remove(seq)
            if not live:
                del self._requests[seq.request_id]
        self.speculation.finish(seq)

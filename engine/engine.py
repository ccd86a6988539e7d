"""The engine: continuous batching over one causal LM, with per-request speculation.

No threads and no I/O of its own. The caller (the gateway's engine thread, the CLI, a benchmark)
adds requests and calls `step()` in a loop. Each step runs one target forward pass over every
scheduled sequence: prefill chunks, plain decodes, and decodes that verify k drafted tokens
(a different k per sequence, chosen by its controller) all share the batch.

One request's failure is its own: an exception while drafting, processing logits, sampling,
verifying or checking stops for one sequence (or logits with no finite value in its rows) ends that
request with finish_reason "error" and the rest of the batch goes on. A failed forward pass fails
the sequences in it; `consecutive_forward_failures` tells a supervisor when the engine itself is
broken.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from specgate.engine import draft_tree
from specgate.engine.admission import checked_prompt, new_sequence, request_generator
from specgate.engine.batch_layout import ForwardItem
from specgate.engine.block_manager import BlockManager, blocks_for
from specgate.engine.config import EngineConfig
from specgate.engine.constraint import Constraint, ConstraintError
from specgate.engine.drafting import Drafter, mean_context
from specgate.engine.errors import DuplicateRequestError, RequestError
from specgate.engine.grammar import GrammarCompiler, GrammarError
from specgate.engine.model_runner import ModelRunner
from specgate.engine.outputs import RequestOutput, TokenLogprob
from specgate.engine.sampler import SamplingRow, process_logits, sample, token_logprobs
from specgate.engine.sampling_params import SamplingParams
from specgate.engine.scheduler import ScheduledSequence, Scheduler
from specgate.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from specgate.engine.spec_decode import tree_proposal
from specgate.engine.spec_decode.cost_model import CostModel
from specgate.engine.spec_decode.params import SpecParams
from specgate.engine.spec_decode.proposer import Proposal, Proposer, ProposerContext
from specgate.engine.spec_decode.proposers import proposer_factory
from specgate.engine.spec_decode.rejection_sampler import verify_draft
from specgate.engine.stop_rules import may_stop, sampling_row, stop_after

logger = logging.getLogger("specgate.engine")


@dataclass(slots=True)
class _Step:
    """One step's working set, handed from phase to phase."""

    batch: list[ScheduledSequence]
    drafts: list[Proposal]  # per sequence (empty for most)
    samples: list[bool]  # per sequence: whether it emits a token this step
    items: list[ForwardItem]
    feeds: list[Proposer | None]  # per sequence: its proposer if it drafts from hidden states
    scheduled_at: float  # time.monotonic()
    started: float = 0.0  # time.perf_counter() at the forward pass
    logits: torch.Tensor | None = None  # [sum of num_logits, vocab]
    hidden: list[torch.Tensor] | None = None  # per item [len(token_ids), hidden_size]
    # Keys each new token of the pass attends to, on average (the cost model's context); read by
    # the ledger while the pass is verified and by the cost model after it.
    context: float = field(init=False)

    def __post_init__(self) -> None:
        self.context = mean_context((it.start, len(it.token_ids)) for it in self.items)

    @property
    def num_tokens(self) -> int:
        return sum(len(it.token_ids) for it in self.items)


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
        self._proposers: dict[str, Proposer] = {}
        self.drafter = Drafter(
            self.block_manager,
            self.proposer,
            self._fail,
            vocab_size=self.runner.vocab_size,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=config.max_num_batched_tokens,
            deterministic=config.deterministic,
            eos_token_ids=self.eos_token_ids,
            forced_drafts=config.forced_drafts,
        )
        for method in config.proposer_options:
            self.proposer(method)
        # Grammars of constrained requests, compiled for this tokenizer and kept by their text.
        self.grammars = (
            GrammarCompiler(self.tokenizer, self.runner.vocab_size, sorted(self.eos_token_ids))
            if self.tokenizer is not None
            else None
        )

    @property
    def cost_model(self) -> CostModel:
        """Measured step costs (forward passes, drafting) behind every controller's choices."""
        return self.drafter.cost_model

    @cost_model.setter
    def cost_model(self, model: CostModel) -> None:
        self.drafter.cost_model = model

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
        proposer = self._proposers.get(method)
        if proposer is None:
            ctx = ProposerContext(
                vocab_size=self.runner.vocab_size,
                device=self.runner.device,
                dtype=self.config.dtype,
                tokenizer=self.tokenizer,
                options=dict(self.config.proposer_options.get(method, {})),
                runner=self.runner,
                model_name=self.model_name,
            )
            proposer = self._proposers[method] = proposer_factory(method)(ctx)
        return proposer

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
            seq.constraint = self._constraint(params)
            seq.group = group
            seqs.append(seq)
        if proposer is not None:
            started: list[Sequence] = []
            try:
                for seq in seqs:
                    started.append(seq)
                    proposer.start(seq.seq_id, prompt, cache_scope)
            except Exception:
                for seq in started:
                    self._quietly(proposer.finish, seq.seq_id, prompt)
                raise
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

    def _constraint(self, params: SamplingParams) -> Constraint | None:
        """The request's grammar state at its start, compiled (or taken from the cache)."""
        if params.grammar is None:
            return None
        if self.grammars is None:
            raise RequestError("this engine has no tokenizer, so it cannot follow a grammar")
        try:
            constraint = Constraint(
                self.grammars.matcher(params.grammar), self.runner.vocab_size, sorted(self.eos_token_ids)
            )
            constraint.allowed_after([])  # a grammar that admits no output fails here, not mid-stream
            return constraint
        except (GrammarError, ConstraintError) as exc:
            raise RequestError(f"the grammar cannot be compiled: {exc}") from exc

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

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_waiting=self.scheduler.num_waiting,
            num_running=len(self.scheduler.running),
            kv_blocks_total=bm.num_blocks,
            kv_blocks_used=bm.num_used_blocks,
            kv_cache_bytes=self.runner.kv_cache.nbytes,
        )

    def step(self) -> list[RequestOutput]:
        """One engine step: schedule -> propose -> forward -> verify -> postprocess."""
        outputs = [self._output(seq) for seq in self._aborted]
        self._aborted.clear()
        batch = self.scheduler.schedule()
        if not batch:
            return outputs
        for seq in self.scheduler.hits:
            self._restore_features(seq)
        step = self._plan(batch, outputs)
        if step is None or not self._forward(step, outputs):
            return outputs
        self._verify(step)
        return self._postprocess(step, outputs)

    # ---- the phases of a step ----------------------------------------------------------------

    def _plan(self, batch: list[ScheduledSequence], outputs: list[RequestOutput]) -> _Step | None:
        """Drafts for the speculating sequences (KV room reserved), and the forward items."""
        drafts = self.drafter.propose(batch)
        batch, drafts = self._drop_failed(batch, drafts, outputs)
        if not batch:
            return None
        return _Step(
            batch=batch,
            drafts=drafts,
            samples=[s.samples for s in batch],  # decided before the step advances any sequence
            items=[self._forward_item(s, d) for s, d in zip(batch, drafts, strict=True)],
            feeds=[self._feature_proposer(s.seq) for s in batch],
            scheduled_at=time.monotonic(),
        )

    def _forward(self, step: _Step, outputs: list[RequestOutput]) -> bool:
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
            outputs.extend(self._output(s.seq) for s in step.batch)
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

    def _verify(self, step: _Step) -> None:
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
            if seq.stats.first_scheduled_time is None:
                seq.stats.first_scheduled_time = step.scheduled_at
            if seq.num_computed_tokens <= seq.num_prompt_tokens:
                seq.stats.num_prefill_chunks += 1
        done = time.monotonic()
        timing = (step.num_tokens, (time.perf_counter() - step.started) * 1e3)  # for telemetry
        pass_cost = (step.context, sum(len(d.token_ids) for d in step.drafts))
        for i, block in blocks:
            seq = step.batch[i].seq
            if seq.is_finished:
                continue  # failed while its logits were processed
            if not all(usable[block]):
                self._fail(seq, "the model produced no finite logits for this request")
                continue
            handoff = None
            proposer = step.feeds[i]
            if step.hidden is not None and proposer is not None:
                handoff = (proposer, step.items[i].start, step.hidden[i])
            args = (
                step.drafts[i],
                step.logits[block],
                processed[block],
                rows[block],
                done,
                timing,
                pass_cost,
            )
            self._guard(seq, "sampling", self._emit, seq, *args, handoff)

    def _postprocess(self, step: _Step, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """The step's cost for the controllers, and the outputs of sequences that moved."""
        # Sampling and verification scale with the verified tokens too, so they count as step cost.
        self.cost_model.observe_forward(step.num_tokens, time.perf_counter() - step.started, step.context)
        for s in step.batch:
            seq = s.seq
            if not seq.is_finished:
                self.block_manager.publish(seq)  # its newly committed full blocks
            if seq.pending_token_ids or seq.is_finished:
                outputs.append(self._output(seq))
        return outputs

    # ---- fault isolation ---------------------------------------------------------------------

    def _fail(self, seq: Sequence, message: str) -> None:
        """End one request with an error; its blocks are freed and the rest of the batch goes on."""
        if seq.is_finished:
            return
        seq.error = message
        self._finish(seq, "error", None)

    def _guard(self, seq: Sequence, what: str, fn: Callable[..., object], *args: object) -> None:
        """Run one request's part of the step; an exception fails that request alone."""
        try:
            fn(*args)
        except Exception as exc:
            logger.exception("request %s failed while %s", seq.seq_id, what)
            self._fail(seq, f"the engine failed while {what} ({type(exc).__name__})")

    @staticmethod
    def _quietly(fn: Callable[..., object], *args: object) -> None:
        try:
            fn(*args)
        except Exception:
            logger.exception("proposer cleanup failed")

    def _drop_failed(
        self, batch: list[ScheduledSequence], drafts: list[Proposal], outputs: list[RequestOutput]
    ) -> tuple[list[ScheduledSequence], list[Proposal]]:
        """Sequences that failed while drafting leave the batch before the forward pass."""
        if all(not s.seq.is_finished for s in batch):
            return batch, drafts
        outputs.extend(self._output(s.seq) for s in batch if s.seq.is_finished)
        keep = [i for i, s in enumerate(batch) if not s.seq.is_finished]
        return [batch[i] for i in keep], [drafts[i] for i in keep]

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

    # ---- a verified step's tokens ------------------------------------------------------------

    def _emit(
        self,
        seq: Sequence,
        proposal: Proposal,
        raw: torch.Tensor,  # [k + 1, vocab]
        processed: torch.Tensor,  # [k + 1, vocab]
        rows: list[SamplingRow],
        now: float,
        step: tuple[int, float],  # the pass's tokens and milliseconds
        pass_cost: tuple[float, int],  # the pass's mean keys per new token, and its drafted tokens
        feed: tuple[Proposer, int, torch.Tensor] | None = None,  # proposer, first position, [n, hidden]
    ) -> None:
        draft, parents = proposal.token_ids, proposal.parents
        path: list[int] = []  # accepted nodes
        if draft:
            greedy = seq.params.greedy
            verified = verify_draft(processed, draft, parents, proposal.probs, greedy, seq.generator)
            tokens, path = verified.token_ids, verified.path
            if parents is not None:
                self._keep_path(seq, path)
        else:
            tokens = sample(processed, rows)
        accepted = len(path)
        if draft:
            # The accepted path's keys/values are valid; the rest is rewound by truncation.
            seq.num_computed_tokens += accepted
            self.block_manager.truncate(seq, seq.num_computed_tokens)
        emitted = [0, *(n + 1 for n in path)]  # logit rows (= feature rows) behind the emitted tokens
        if feed is not None:
            proposer, start, hidden = feed
            # Features of the positions whose tokens stand: the step's real tokens and accepted drafts.
            real = hidden.shape[0] - len(draft)
            proposer.observe_hidden(
                seq.seq_id, start, hidden[[*range(real - 1), *(real - 1 + r for r in emitted)]]
            )
        emitted_rows = [rows[r] for r in emitted]
        scored = raw[emitted]  # [len(emitted), vocab]
        if seq.constraint is not None and seq.params.logprobs is not None:
            # A constrained request reports the masked law's logprobs (as vLLM does).
            allowed = torch.stack([r.allowed for r in emitted_rows if r.allowed is not None])  # [n, vocab]
            scored = scored.masked_fill(~allowed[:, : scored.shape[-1]], float("-inf"))
        lps = token_logprobs(scored, tokens, emitted_rows)
        forced = proposal.num_forced
        seq.stats.num_forced_draft_tokens += forced
        if seq.spec is not None and seq.stats.spec is not None and draft:
            cost = self._draft_cost(seq.stats.spec.method, len(draft), parents, step, pass_cost)
            seq.spec.settle(accepted, cost)
            # The controller learns from the proposer's own tokens, past the grammar's forced ones.
            if parents is None:
                if len(draft) > forced and accepted >= forced:
                    seq.spec.observe(len(draft) - forced, accepted - forced)
                seq.stats.spec.record(len(draft), accepted, *step)
            else:
                if not forced:
                    seq.spec.observe_walk(tree_proposal.walk(parents, path, proposal.scores))
                depth = max(draft_tree.depths(parents))
                seq.stats.spec.record(len(draft), accepted, *step, depth=depth)
        elif seq.spec is not None and seq.stats.spec is not None:
            seq.spec.credit()
        num_before = seq.num_tokens
        for token, lp in zip(tokens, lps, strict=True):
            self._append_token(seq, token, lp, now)
            if seq.is_finished:
                return
            if seq.constraint is not None:
                seq.constraint.advance([token])
                # The grammar is complete: nothing but EOS could follow, so the request ends here,
                # as plain decoding would have ended it (a bonus token past it is not emitted).
                if seq.constraint.stopped:
                    self._finish(seq, "stop", None)
                    return
        if seq.spec is not None and seq.stats.spec is not None:
            self.proposer(seq.stats.spec.method).commit(
                seq.seq_id, seq.token_ids, seq.num_tokens - num_before
            )

    def _draft_cost(
        self,
        method: str,
        drafted: int,
        parents: list[int] | None,
        step: tuple[int, float],
        pass_cost: tuple[float, int],
    ) -> float:
        """What a request's `drafted` tokens cost it, in passes of the size without any drafts (the
        steps it waited for its drafts): the pass's measured time over the curve's price of the pass
        without its drafts, its share of that by drafted tokens, and its drafting time."""
        context, pass_drafted = pass_cost
        num_tokens, ms = step
        cost = self.cost_model
        base = cost.forward_time(max(1, num_tokens - pass_drafted), context)
        share = drafted / max(drafted, pass_drafted)
        steps = 1
        if self.proposer(method).autoregressive:
            steps = max(draft_tree.depths(parents)) if parents is not None else drafted
        extra = max(0.0, ms / 1e3 - base) * share + steps * cost.draft_time(method)
        return extra / base

    def _keep_path(self, seq: Sequence, path: list[int]) -> None:
        """A verified tree's accepted nodes hold the positions after the root: where a node was verified
        at another slot (off the tree's first path), its keys and values move into place."""
        base = seq.num_computed_tokens  # the root's position + 1: node j was verified at base + j
        moves = [(base + node, base + depth) for depth, node in enumerate(path) if node != depth]
        if moves:
            src, dst = zip(*moves, strict=True)
            self.runner.keep_path(seq.block_table, src, dst)

    # ---- internals ---------------------------------------------------------------------------

    def _restore_features(self, seq: Sequence) -> None:
        """A prefix-cache hit skipped the prefill of its leading blocks: a proposer drafting from
        target features gets theirs from the runner's feature pool instead."""
        proposer = self._feature_proposer(seq)
        if proposer is None or self.runner.features is None:
            return
        n = seq.num_computed_tokens
        self._guard(
            seq,
            "restoring cached target features",
            proposer.observe_hidden,
            seq.seq_id,
            0,
            self.runner.cached_features(seq.block_table, n),
        )

    def _feature_proposer(self, seq: Sequence) -> Proposer | None:
        """The sequence's proposer if it drafts from the target's hidden states, else None."""
        if seq.spec is None or seq.stats.spec is None:
            return None
        proposer = self.proposer(seq.stats.spec.method)
        return proposer if proposer.needs_hidden else None

    def _forward_item(self, s: ScheduledSequence, draft: Proposal) -> ForwardItem:
        seq = s.seq
        start = seq.num_computed_tokens
        tokens = seq.token_ids[start : start + s.num_tokens] + draft.token_ids
        num_logits = (1 + len(draft.token_ids)) if s.samples else 0
        # A tree's root is the one real token (a speculating sequence decodes one at a time).
        return ForwardItem(tokens, start, seq.block_table, num_logits, draft.parents)

    def _append_token(self, seq: Sequence, token: int, lp: TokenLogprob | None, now: float) -> None:
        seq.token_ids.append(token)
        seq.pending_token_ids.append(token)
        if lp is not None:
            seq.pending_logprobs.append(lp)
        stats = seq.stats
        stats.num_output_tokens = seq.num_output_tokens
        stats.token_times.append(now)
        if stats.first_token_time is None:
            stats.first_token_time = now
        stats.last_token_time = now
        detok = seq.detokenizer
        stop_string = detok.append(token, may_stop(seq)) if detok is not None else None
        ended = stop_after(seq, token, stop_string, self.max_model_len, self.eos_token_ids)
        if ended is not None:
            self._finish(seq, *ended)

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
        if seq.stats.spec is not None:
            self._quietly(self.proposer(seq.stats.spec.method).finish, seq.seq_id, seq.token_ids)

    def _output(self, seq: Sequence) -> RequestOutput:
        finished = seq.status is SequenceStatus.FINISHED
        if finished and seq.stats.finished_time is None:
            seq.stats.finished_time = time.monotonic()
        try:
            text = seq.detokenizer.take(finished) if seq.detokenizer is not None else ""
        except Exception as exc:
            logger.exception("request %s failed while its text was decoded", seq.seq_id)
            text = ""
            if not finished:
                self._fail(seq, f"the engine failed while decoding text ({type(exc).__name__})")
                finished = True
                seq.stats.finished_time = time.monotonic()
        out = RequestOutput(
            request_id=seq.request_id,
            new_token_ids=seq.pending_token_ids,
            new_text=text,
            finished=finished,
            finish_reason=seq.finish_reason,
            stats=seq.stats.snapshot(),  # the caller may read it on another thread
            stop_reason=seq.stop_reason,
            logprobs=seq.pending_logprobs if seq.params.logprobs is not None else None,
            error=seq.error,
            index=seq.index,
        )
        seq.pending_token_ids, seq.pending_logprobs = [], []
        return out

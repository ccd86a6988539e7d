"""The engine's speculative decoding, sequence by sequence and step by step.

A sequence that speculates gets its controller state and its proposer's attention at admission
(`start`) and gives them back when it ends, however it ends (`finish`). Each step, `propose` drafts
for the batch (drafting.py). Once the target pass has verified the drafts, `settle` does what a
verification leaves to speculation:

- the keys and values of the rejected positions are rewound (the block table truncated), and an
  accepted path off a tree's first branch moves into place;
- a proposer that drafts from the target's features gets those of the positions that stand;
- the controller learns what was accepted, and its ledger is charged what the drafts cost the pass
  (or credited a step decoded without drafts);

and, once the output processor has appended the tokens, `commit` tells the proposer what was
committed. A sequence's failure in any of these is its own: the engine runs each under its guard.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from specgate.engine.block_manager import BlockManager
from specgate.engine.config import EngineConfig
from specgate.engine.model_runner import ModelRunner
from specgate.engine.scheduler import ScheduledSequence
from specgate.engine.sequence import Sequence as Seq
from specgate.engine.spec_decode import tree_proposal
from specgate.engine.spec_decode.controller import SpecState
from specgate.engine.spec_decode.cost_model import CostModel
from specgate.engine.spec_decode.draft_tree import depths
from specgate.engine.spec_decode.drafting import Drafter
from specgate.engine.spec_decode.proposer import Proposal, Proposer, ProposerContext
from specgate.engine.spec_decode.proposers import proposer_factory
from specgate.engine.spec_decode.verified import Verified
from specgate.engine.vocab import SpecStep

logger = logging.getLogger("specgate.engine")


@dataclass(frozen=True, slots=True)
class ForwardPass:
    """One step's target pass, as its drafts are priced: measured once its logits were processed,
    before any sequence's tokens were sampled."""

    num_tokens: int  # tokens in the pass, every sequence's, drafts included
    ms: float  # its time, logits processing included
    context: float  # keys each new token attended to, on average (the cost model's context)
    num_drafted: int  # drafted tokens in the pass, every sequence's

    def __post_init__(self) -> None:
        if min(self.num_tokens, self.num_drafted) < 0 or self.num_drafted > self.num_tokens:
            raise ValueError(f"need 0 <= num_drafted <= num_tokens, got {self}")
        if not (0.0 <= self.ms < math.inf and 0.0 <= self.context < math.inf):
            raise ValueError("ms and context must be non-negative and finite")


class Speculation:
    def __init__(
        self,
        runner: ModelRunner,
        block_manager: BlockManager,
        config: EngineConfig,
        eos_token_ids: frozenset[int],
        fail: Callable[[Seq, str], None],  # ends one request with an error
    ) -> None:
        self.runner = runner
        self.block_manager = block_manager
        self.config = config
        self.proposers: dict[str, Proposer] = {}  # by method, built on first use
        self.states: dict[str, SpecState] = {}  # by seq_id: each speculating sequence's controller
        self.drafter = Drafter(
            block_manager,
            self.proposer,
            fail,
            vocab_size=runner.vocab_size,
            max_model_len=runner.max_model_len,
            max_num_batched_tokens=config.max_num_batched_tokens,
            deterministic=config.deterministic,
            eos_token_ids=eos_token_ids,
            forced_drafts=config.forced_drafts,
            states=self.states,
        )
        for method in config.proposer_options:
            self.proposer(method)

    @property
    def cost_model(self) -> CostModel:
        """Measured step costs (forward passes, drafting) behind every controller's choices."""
        return self.drafter.cost_model

    @cost_model.setter
    def cost_model(self, model: CostModel) -> None:
        self.drafter.cost_model = model

    def proposer(self, method: str) -> Proposer:
        """The proposer for `method`, built from the registry on first use (ValueError if unknown)."""
        proposer = self.proposers.get(method)
        if proposer is None:
            ctx = ProposerContext(
                vocab_size=self.runner.vocab_size,
                device=self.runner.device,
                dtype=self.config.dtype,
                tokenizer=self.runner.tokenizer,
                options=dict(self.config.proposer_options.get(method, {})),
                runner=self.runner,
                model_name=self.runner.source.name,
            )
            proposer = self.proposers[method] = proposer_factory(method)(ctx)
        return proposer

    def feature_proposer(self, seq: Seq) -> Proposer | None:
        """The sequence's proposer if it drafts from the target's hidden states, else None."""
        if seq.spec is None:
            return None
        proposer = self.proposer(seq.spec.method)
        return proposer if proposer.needs_hidden else None

    # ---- a sequence's life -------------------------------------------------------------------

    def start(self, seqs: Sequence[Seq], prompt: list[int], scope: str | None) -> None:
        """Admitted sequences that speculate: their proposer starts on the prompt, their controller
        at its prior. If the proposer fails for one of them, none of them is started."""
        speculating = [seq for seq in seqs if seq.spec is not None]
        started: list[tuple[Proposer, Seq]] = []
        try:
            for seq in speculating:
                assert seq.spec is not None
                proposer = self.proposer(seq.spec.method)
                started.append((proposer, seq))
                proposer.start(seq.seq_id, prompt, scope)
        except Exception:
            for proposer, seq in started:
                _quietly(proposer.finish, seq.seq_id, prompt)
            raise
        for seq in speculating:
            assert seq.spec is not None
            self.states[seq.seq_id] = SpecState(seq.spec)

    def restore_features(self, seq: Seq) -> None:
        """A prefix-cache hit skipped the prefill of the sequence's leading blocks: a proposer drafting
        from target features gets theirs from the runner's feature pool instead."""
        proposer = self.feature_proposer(seq)
        if proposer is None or self.runner.features is None:
            return
        n = seq.num_computed_tokens
        proposer.observe_hidden(seq.seq_id, 0, self.runner.cached_features(seq.block_table, n))

    def finish(self, seq: Seq) -> None:
        """The sequence ended (finished, aborted or failed): its proposer lets it go."""
        self.states.pop(seq.seq_id, None)
        if seq.spec is not None:
            _quietly(self.proposer(seq.spec.method).finish, seq.seq_id, seq.token_ids)

    # ---- a step ------------------------------------------------------------------------------

    def propose(self, batch: list[ScheduledSequence]) -> list[Proposal]:
        """Drafts per scheduled sequence (empty for most); KV room is reserved for them."""
        return self.drafter.propose(batch)

    def settle(self, verified: Verified, forward: ForwardPass) -> None:
        """What the sequence's verified step leaves to speculation (see the module docstring); the
        step it measured goes on `verified.spec_step` for the request's counters."""
        seq, proposal = verified.seq, verified.proposal
        draft, parents = proposal.token_ids, proposal.parents
        accepted = verified.num_accepted
        if draft:
            if parents is not None:
                self._keep_path(seq, verified.path)
            # The accepted path's keys / values are valid; the rest is rewound by truncation.
            seq.num_computed_tokens += accepted
            self.block_manager.truncate(seq, seq.num_computed_tokens)
        proposer = self.feature_proposer(seq)
        if verified.hidden is not None and proposer is not None:
            # Features of the positions whose tokens stand: the step's real tokens and accepted drafts.
            real = verified.hidden.shape[0] - len(draft)
            emitted = [0, *(n + 1 for n in verified.path)]  # logit rows behind the emitted tokens
            rows = [*range(real - 1), *(real - 1 + r for r in emitted)]
            proposer.observe_hidden(seq.seq_id, verified.position, verified.hidden[rows])
        state = self.states.get(seq.seq_id)
        if state is None or seq.spec is None:
            return  # it does not speculate (a constrained request's forced drafts need no controller)
        if not draft:
            state.credit()
            return
        forced = proposal.num_forced
        state.settle(accepted, self._draft_cost(seq.spec.method, len(draft), parents, forward))
        # The controller learns from the proposer's own tokens, past the grammar's forced ones.
        if parents is None:
            if len(draft) > forced and accepted >= forced:
                state.observe(len(draft) - forced, accepted - forced)
            depth = len(draft)
        else:
            if not forced:
                state.observe_walk(tree_proposal.walk(parents, verified.path, proposal.scores))
            depth = max(depths(parents))
        verified.spec_step = SpecStep(len(draft), accepted, forward.num_tokens, forward.ms, depth)

    def commit(self, seq: Seq, num_new: int) -> None:
        """The sequence's last `num_new` tokens were appended and it goes on: its proposer learns them."""
        if seq.spec is not None:
            self.proposer(seq.spec.method).commit(seq.seq_id, seq.token_ids, num_new)

    def observe_forward(self, forward: ForwardPass, seconds: float) -> None:
        """The pass's whole cost, its sampling, verification and outputs included (they scale with the
        verified tokens too), for the controllers' curve."""
        self.cost_model.observe_forward(forward.num_tokens, seconds, forward.context)

    # ---- internals ---------------------------------------------------------------------------

    def _draft_cost(
        self, method: str, drafted: int, parents: list[int] | None, forward: ForwardPass
    ) -> float:
        """What a request's `drafted` tokens cost it, in passes of the size without any drafts (the
        steps it waited for its drafts): the pass's measured time over the curve's price of the pass
        without its drafts, its share of that by drafted tokens, and its drafting time."""
        cost = self.cost_model
        base = cost.forward_time(max(1, forward.num_tokens - forward.num_drafted), forward.context)
        share = drafted / max(drafted, forward.num_drafted)
        steps = 1
        if self.proposer(method).autoregressive:
            steps = max(depths(parents)) if parents is not None else drafted
        extra = max(0.0, forward.ms / 1e3 - base) * share + steps * cost.draft_time(method)
        return extra / base

    def _keep_path(self, seq: Seq, path: list[int]) -> None:
        """A verified tree's accepted nodes hold the positions after the root: where a node was verified
        at another slot (off the tree's first path), its keys and values move into place."""
        base = seq.num_computed_tokens  # the root's position + 1: node j was verified at base + j
        moves = [(base + node, base + depth) for depth, node in enumerate(path) if node != depth]
        if moves:
            src, dst = zip(*moves, strict=True)
            self.runner.keep_path(seq.block_table, src, dst)


def _quietly(fn: Callable[..., object], *args: object) -> None:
    try:
        fn(*args)
    except Exception:
        logger.exception("proposer cleanup failed")

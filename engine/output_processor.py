"""The step's last phase: verified tokens become the requests' outputs.

Per sequence that emitted this step (in batch order): its counters record the step (forced drafts,
the verification step speculation measured), then token by token it appends the token (with its
logprob and emit time), applies the stop rules (stop_rules.py: stop tokens, EOS, stop strings,
max_tokens, the context) and advances its grammar, which may end it too; a sequence that goes on has
its proposer told what it committed. Then each sequence that moved gets one `RequestOutput`: its new
tokens, text and logprobs, and, once it has finished, its counters.

One sequence's exception here ends that request alone (finish_reason "error"), as everywhere in the
step; the others' outputs are made all the same.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Set

from specgate.engine.outputs import RequestOutput, TokenLogprob
from specgate.engine.sequence import Sequence, SequenceStatus
from specgate.engine.spec_decode.verified import Verified
from specgate.engine.stop_rules import may_stop, stop_after

logger = logging.getLogger("specgate.engine")


class OutputProcessor:
    def __init__(
        self,
        max_model_len: int,
        eos_token_ids: Set[int],
        finish: Callable[[Sequence, str, str | int | None], None],  # ends a sequence (a stop rule)
        fail: Callable[[Sequence, str], None],  # ends a sequence with an error
        committed: Callable[[Sequence, int], None],  # its last n tokens were committed; it goes on
    ) -> None:
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self._finish = finish
        self._fail = fail
        self._committed = committed

    def process(self, verified: list[Verified], seqs: Iterable[Sequence], now: float) -> list[RequestOutput]:
        """Append each verified sequence's tokens (emitted at `now`), then the outputs of `seqs` that
        have news: new tokens, or their end."""
        for v in verified:
            if v.seq.is_finished:
                continue  # failed after verification (while its speculation settled)
            try:
                self._emit(v, now)
            except Exception as exc:
                logger.exception("request %s failed while its tokens were processed", v.seq.seq_id)
                self._fail(v.seq, f"the engine failed while processing its tokens ({type(exc).__name__})")
        return [self.output(seq) for seq in seqs if seq.pending_token_ids or seq.is_finished]

    def _emit(self, v: Verified, now: float) -> None:
        seq = v.seq
        self.record_step(v)
        for token, lp in zip(v.token_ids, v.logprobs, strict=True):
            self.append_token(seq, token, lp, now)
            if self.check_stop(seq, token) or self.advance_grammar(seq, token):
                return
        self._committed(seq, len(v.token_ids))

    # ---- one concern each --------------------------------------------------------------------

    def record_step(self, v: Verified) -> None:
        """The step in the request's counters: the grammar's forced drafts, the verification step."""
        stats = v.seq.stats
        stats.num_forced_draft_tokens += v.proposal.num_forced
        if v.spec_step is not None and stats.spec is not None:
            stats.spec.record(v.spec_step)

    def append_token(self, seq: Sequence, token: int, lp: TokenLogprob | None, now: float) -> None:
        seq.token_ids.append(token)
        seq.pending_token_ids.append(token)
        if lp is not None:
            seq.pending_logprobs.append(lp)
        stats = seq.stats
        stats.num_output_tokens = seq.num_output_tokens
        if stats.first_token_ts is None:
            stats.first_token_ts = now
        stats.last_token_ts = now

    def check_stop(self, seq: Sequence, token: int) -> bool:
        """Whether `token`, the sequence's newest, ends it (it is finished then)."""
        detok = seq.detokenizer
        stop_string = detok.append(token, may_stop(seq)) if detok is not None else None
        ended = stop_after(seq, token, stop_string, self.max_model_len, self.eos_token_ids)
        if ended is not None:
            self._finish(seq, *ended)
        return ended is not None

    def advance_grammar(self, seq: Sequence, token: int) -> bool:
        """The grammar takes the token; True if it is then complete (the sequence is finished)."""
        if seq.constraint is None:
            return False
        seq.constraint.advance([token])
        if not seq.constraint.stopped:
            return False
        # Nothing but EOS could follow, so the request ends here, as plain decoding would have ended
        # it (a bonus token past it is not emitted).
        self._finish(seq, "stop", None)
        return True

    def output(self, seq: Sequence) -> RequestOutput:
        """The sequence's news since its last output; its counters once it has finished."""
        finished = seq.status is SequenceStatus.FINISHED
        if finished and seq.stats.finished_ts is None:
            seq.stats.finished_ts = time.monotonic()
        try:
            text = seq.detokenizer.take(finished) if seq.detokenizer is not None else ""
        except Exception as exc:
            logger.exception("request %s failed while its text was decoded", seq.seq_id)
            text = ""
            if not finished:
                self._fail(seq, f"the engine failed while decoding text ({type(exc).__name__})")
                finished = True
                seq.stats.finished_ts = time.monotonic()
        out = RequestOutput(
            request_id=seq.request_id,
            new_token_ids=seq.pending_token_ids,
            new_text=text,
            finished=finished,
            finish_reason=seq.finish_reason,
            # The engine no longer touches a finished sequence's counters: they go as they are.
            stats=seq.stats if finished else None,
            stop_reason=seq.stop_reason,
            logprobs=seq.pending_logprobs if seq.params.logprobs is not None else None,
            error=seq.error,
            index=seq.index,
            num_cached_tokens=seq.stats.num_cached_tokens,
        )
        seq.pending_token_ids, seq.pending_logprobs = [], []
        return out

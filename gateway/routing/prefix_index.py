"""Prefix-aware replica choice: which replica probably holds a prompt's leading blocks in its prefix
cache, and which replica serves a request at the lowest cost.

Session affinity (affinity.py) hashes a fixed key, so two conversations that share a long system
prompt land on different replicas and each computes it. This module finds shared prefixes instead:

- `prompt_blocks` cuts the prompt text into fixed-size blocks of characters and hashes each block
  chained on the previous block's hash, so one integer names a whole prefix (block i's hash covers
  blocks 0..i) and two prompts share block i's hash exactly when they share their first i+1 blocks.
  Characters, not tokens: the gateway does not tokenize prompts for upstream replicas; a token is
  roughly `chars_per_token` characters, good enough to estimate what a replica skips.
- `PrefixIndex` remembers which replica was sent which blocks (an LRU per replica, `capacity_blocks`
  each): a replica that prefilled a prompt keeps its KV blocks until its own cache evicts them.
  It is an approximation: it sees only this process's traffic, so `correct` trims it with what the
  replicas report (`cached_tokens`).
- `choose` weighs the prefill a replica would skip against its requests in flight, among the
  replicas within the same bounded-load cap that `affinity.bounded_pick` uses.

The ideas are those of the Gateway API Inference Extension's prefix scorer (chained block hashes,
an LRU index per server), SGLang's cache-aware router (a short match must not pin traffic; load
overrides cache beyond a bound) and NVIDIA Dynamo's KV router (cost = prefill still to compute +
active load, in one unit).
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

# The chain's seed and the hash's personalisation: fixed, so that the same prompt gives the same
# blocks in every worker process and every run (reproducible tests and simulations, comparable
# logs). No per-process salt: a salt would only defend against crafted collisions, and the worst a
# collision does here is mislead one routing guess, still inside the load cap: the hashes steer
# routing only, they never let one request read another's cache (the replica keys its cache by
# its own token hashes). Nothing is persisted, so stability across restarts is simply not needed.
_SEED = b"\x00" * 8
MISS_TOLERANCE = 3  # reports of fewer cached tokens than matched before the index believes less
_PERSON = b"specgate-prefix"


def prompt_blocks(text: str, block_chars: int, max_blocks: int, scope: str = "") -> list[int]:
    """Chained 64-bit hashes of the leading full blocks of `text` (block i's hash covers blocks 0..i),
    at most max_blocks. `scope` seeds the chain: prompts match only within one scope (whose cached
    prompts a request may hit, as the prefix cache's scope and salt say)."""
    if block_chars < 1:
        raise ValueError("block_chars must be at least 1")
    # A partial last block is left out: its content is still growing (the next turn appends to it),
    # so its hash would never match anything. max_blocks bounds the hashing of very long prompts.
    n = min(len(text) // block_chars, max(max_blocks, 0))
    out: list[int] = []
    prev = (
        hashlib.blake2b(scope.encode("utf-8", "surrogatepass"), digest_size=8, person=_PERSON).digest()
        if scope
        else _SEED
    )
    for i in range(n):
        chunk = text[i * block_chars : (i + 1) * block_chars].encode("utf-8", "surrogatepass")
        # The previous hash is a fixed 8 bytes, so (previous, block) is encoded unambiguously.
        prev = hashlib.blake2b(prev + chunk, digest_size=8, person=_PERSON).digest()
        out.append(int.from_bytes(prev, "big"))
    return out


class PrefixIndex:
    """Which replica (probably) holds which prompt blocks in its prefix cache: an approximation
    learned from where this gateway sent prompts, bounded in memory (LRU per replica, capacity in
    blocks), corrected by what replicas report (cached_tokens)."""

    __slots__ = (
        "_bit_of",
        "_cap",
        "_free_bits",
        "_lru",
        "_misses",
        "_name_of",
        "_next_bit",
        "_owners",
        "capacity_blocks",
    )

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError("capacity_blocks must be at least 1")
        self.capacity_blocks = capacity_blocks
        # Per replica, its blocks from least to most recently used (values unused).
        self._lru: dict[str, OrderedDict[int, None]] = {}
        # Per block, the replicas holding it as a bit mask: `match` walks the blocks once, and-ing
        # masks, instead of asking every replica about every block (O(blocks + replicas), not
        # O(blocks x replicas)). Each known replica owns one bit; a forgotten replica's bit is reused.
        self._owners: dict[int, int] = {}
        self._bit_of: dict[str, int] = {}
        self._name_of: dict[int, str] = {}
        self._free_bits: list[int] = []
        self._next_bit = 1
        # Per replica, the blocks it is believed to keep: capacity_blocks until it reports fewer
        # cached tokens than the index promised (its real cache is smaller, or shared with traffic
        # this gateway does not see), then less; it grows back while reports agree.
        self._cap: dict[str, int] = {}
        self._misses: dict[str, int] = {}

    def capacity(self, replica: str) -> int:
        return self._cap.get(replica, self.capacity_blocks)

    def shrink(self, replica: str, floor: int = 1, factor: float = 0.75) -> None:
        """The replica had evicted blocks the index believed it held: believe it keeps fewer (a
        share of what the index holds for it now, at least `floor`: the prompt it just took),
        evicting its least recently used ones."""
        lru = self._lru.get(replica)
        if lru is None:
            return
        cap = max(1, floor, min(self.capacity(replica), int(len(lru) * factor)))
        self._cap[replica] = cap
        self._evict(replica, lru)

    def missed(self, replica: str, floor: int = 1, tolerance: int = MISS_TOLERANCE) -> None:
        """The replica reported fewer cached tokens than the index matched. One such report can be a
        burst of one family's requests that arrived before the first one's prefill was cached; only
        `tolerance` of them without a confirmation between shrink the belief, and never below a
        sixteenth of the configured capacity."""
        n = self._misses.get(replica, 0) + 1
        if n < tolerance:
            self._misses[replica] = n
            return
        self._misses.pop(replica, None)
        self.shrink(replica, max(floor, self.capacity_blocks // 16))

    def confirm(self, replica: str) -> None:
        """The replica had what the index promised: let its believed capacity grow back a little."""
        self._misses.pop(replica, None)
        cap = self._cap.get(replica)
        if cap is not None:
            cap += max(1, cap // 8)
            if cap >= self.capacity_blocks:
                del self._cap[replica]
            else:
                self._cap[replica] = cap

    def held(self, replica: str) -> int:
        """How many blocks the index believes `replica` holds (at most capacity_blocks)."""
        lru = self._lru.get(replica)
        return len(lru) if lru is not None else 0

    def match(self, blocks: Sequence[int], replicas: list[str]) -> dict[str, int]:
        """Per replica, how many leading blocks of `blocks` it holds (0..len(blocks))."""
        out = dict.fromkeys(replicas, 0)
        alive = 0
        for name in replicas:
            alive |= self._bit_of.get(name, 0)
        for i, h in enumerate(blocks):
            if not alive:
                return out
            # Replicas still matching that lack block i: their leading run ends at i. Only leading
            # blocks count: a cache can skip prefill only up to its first miss.
            dropped = alive & ~self._owners.get(h, 0)
            if dropped:
                alive ^= dropped
                self._assign(out, dropped, i)
        self._assign(out, alive, len(blocks))
        return out

    def record(self, replica: str, blocks: Sequence[int]) -> None:
        """The request with these blocks was sent to `replica`: it will hold them (refreshes LRU)."""
        if not blocks:
            return
        lru = self._lru.get(replica)
        if lru is None:
            lru = self._lru[replica] = OrderedDict()
            bit = self._free_bits.pop() if self._free_bits else self._take_bit()
            self._bit_of[replica] = bit
            self._name_of[bit] = replica
        bit = self._bit_of[replica]
        # Deepest block first, so the first block ends most recent: the LRU then evicts a prompt's
        # tail before its head, as the engines do (vLLM frees a request's blocks tail first, SGLang
        # evicts radix-tree leaves), and a head shared by many prompts outlives their tails.
        for h in reversed(blocks):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                self._owners[h] = self._owners.get(h, 0) | bit
        self._evict(replica, lru)

    def _evict(self, replica: str, lru: OrderedDict[int, None]) -> None:
        bit, cap = self._bit_of[replica], self.capacity(replica)
        while len(lru) > cap:
            old, _ = lru.popitem(last=False)
            self._drop(old, bit)

    def correct(self, replica: str, blocks: Sequence[int], cached_blocks: int) -> None:
        """The replica reported that only the first `cached_blocks` of them were served from its
        cache: forget the ones past that which the index believed it held (they were evicted),
        keep the rest."""
        lru = self._lru.get(replica)
        if lru is None:
            return  # nothing believed about it (never sent anything, or forgotten): nothing to correct
        c = min(max(cached_blocks, 0), len(blocks))
        bit = self._bit_of[replica]
        for h in blocks[c:]:
            if h in lru:
                del lru[h]
                self._drop(h, bit)
        if c:
            # The replica proved it holds these: refresh them (and restore any the index had lost).
            self.record(replica, blocks[:c])
        if not lru:
            self.forget(replica)  # frees its bit

    def forget(self, replica: str) -> None:
        """Drop everything believed about `replica` (removed, or restarted with an empty cache).
        O(blocks it held): rare, unlike the per-request operations."""
        lru = self._lru.pop(replica, None)
        if lru is None:
            return
        bit = self._bit_of.pop(replica)
        self._cap.pop(replica, None)
        self._misses.pop(replica, None)
        del self._name_of[bit]
        for h in lru:
            self._drop(h, bit)
        self._free_bits.append(bit)

    def _take_bit(self) -> int:
        bit = self._next_bit
        self._next_bit <<= 1
        return bit

    def _drop(self, h: int, bit: int) -> None:
        rest = self._owners.get(h, 0) & ~bit
        if rest:
            self._owners[h] = rest
        else:
            self._owners.pop(h, None)  # no replica holds it: the entry goes, memory stays bounded

    def _assign(self, out: dict[str, int], bits: int, value: int) -> None:
        while bits:
            low = bits & -bits
            out[self._name_of[low]] = value
            bits ^= low


@dataclass(frozen=True, slots=True)
class PrefixChoice:
    chosen: str
    matched_blocks: int  # of the chosen replica
    best_matched_blocks: int  # the best any candidate had
    reason: str  # "prefix" | "load" | "no match"


def choose(
    candidates: list[str],
    matched: dict[str, int],
    loads: dict[str, int],
    total_blocks: int,
    *,
    block_chars: int,
    min_match_blocks: int,
    load_factor: float,
    spill_after: int,
    chars_per_token: float,
    tokens_per_request: float,
) -> PrefixChoice:
    """Among the candidates (healthy replicas, in the fallback order the caller gives: the first is
    the session hash's home), pick the one with the lowest cost
        cost(r) = uncached_tokens(r) / tokens_per_request + loads[r]
    where uncached_tokens(r) = (total_blocks - m(r)) * block_chars / chars_per_token and m(r) is
    matched[r] if it is at least min_match_blocks, else 0 (a short common prefix, e.g. a shared
    system prompt, counts for nothing: it must not pin traffic to one replica). Only replicas within
    the bounded-load cap take part:
        loads[r] + 1 <= max(spill_after, ceil(load_factor * (sum(loads) + 1) / len(candidates)))
    (the same bound affinity.py's bounded_pick uses, so the busiest replica stays near load_factor x
    the mean). Ties go to the earlier candidate (the session hash's home first).

    Where no replica under the cap has a usable match, the least loaded under it takes the prompt
    (the session's home first among equals: at light load, when loads are level, a conversation
    keeps going home, as in session mode, even from another worker process whose index has not
    seen it); placing new prefixes by hash alone would pile families onto one replica by chance,
    and once placed they stick by their match. `reason` is "prefix" when the chosen replica has the
    longest usable match of all candidates, "load" when a longer usable match was elsewhere (over
    the cap, or not worth its load), "no match" when no candidate had a usable match.
    """
    if not candidates:
        raise ValueError("choose needs at least one candidate")
    if chars_per_token <= 0 or tokens_per_request <= 0:
        raise ValueError("chars_per_token and tokens_per_request must be positive")
    load = [loads.get(n, 0) for n in candidates]
    raw = [min(max(matched.get(n, 0), 0), max(total_blocks, 0)) for n in candidates]
    usable = [m if m >= min_match_blocks else 0 for m in raw]
    cap = max(spill_after, math.ceil(load_factor * (sum(load) + 1) / len(candidates)))
    under = [i for i in range(len(candidates)) if load[i] + 1 <= cap]
    if not under:  # impossible by pigeonhole (the least loaded is always under); defensive
        under = [min(range(len(candidates)), key=lambda i: (load[i], i))]
    best_usable = max(usable)
    if not any(usable[i] for i in under):
        pick = min(under, key=lambda i: (load[i], i))
    else:
        # Tokens a replica still has to prefill, in units of one request in flight: one unit for
        # "this many prefill tokens weigh as much as one more request in flight".
        per_block = block_chars / chars_per_token / tokens_per_request
        pick = min(under, key=lambda i: ((total_blocks - usable[i]) * per_block + load[i], i))
    if best_usable == 0:
        reason = "no match"
    elif usable[pick] == best_usable:
        reason = "prefix"
    else:
        reason = "load"
    return PrefixChoice(candidates[pick], raw[pick], max(raw), reason)

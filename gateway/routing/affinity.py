"""Session and prefix affinity across replicas: one conversation, one replica, its prefix cache warm.

Backends declared with the same `replica_group` serve the same model from different servers. A
route is still an ordered failover list; where its first backend belongs to a group, the group's
members in the list are reordered for the request:

- A request is known by its session key: the OpenAI `user` field if it sent one, else its leading
  messages (system / developer messages and the first user message, which every later turn of the
  conversation repeats), else a completion's leading prompt characters. Hashed at once; the key
  itself is never stored.
- Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam, 2018): each replica holds
  `ring_points` points on a ring; the key's replica is the first healthy one clockwise whose
  requests in flight, with this one, stay within `load_factor` times the group's mean (or within
  `spill_after`, so that light load never moves a conversation). Taking a
  replica out (down or removed) moves only the conversations it held.
- The rest of the group follows in ring order (healthy first): a failing replica hands over to the next.
- A request without a key goes to the least loaded healthy replica.

`Affinity.arrange` returns the new order and an `AffinityChoice`; the route carries it, the record
learns after dispatch whether the key's home replica (the first healthy one on the ring, load aside)
served it: the affinity hit rate of the telemetry columns.

With `mode = "prefix"` (the default) the prompt itself decides first: its chained block hashes
(routing/prefix_index.py) are matched against an index of where this gateway sent earlier prompts,
and the replica with the lowest cost (prompt tokens it would have to prefill, weighed against its
requests in flight, within the same bounded-load cap) takes it; a match shorter than
`min_match_blocks` counts for nothing, and without one the least-loaded replica under the cap takes
it (the session key's first among equals). Matches are made within the request's prefix-cache scope
and salt only. Two conversations sharing a long system prompt thus meet on one replica's cache, and
the index is checked against the `cached_tokens` each replica reports (`Affinity.observe`). The load is the
replica's own where its /metrics say (requests running and waiting), else this gateway's requests
in flight there, summed over its worker processes.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from specgate.gateway.backends.registry import BackendRegistry
from specgate.gateway.protocol.route import RouteDecision
from specgate.gateway.protocol.schemas import ChatCompletionRequest, CompletionRequest
from specgate.gateway.routing.prefix_index import PrefixChoice, PrefixIndex, choose, prompt_blocks
from specgate.gateway.settings import AffinitySettings, Settings
from specgate.policies.load import BackendLoad

LEADING_ROLES = frozenset({"system", "developer"})


@dataclass(slots=True)
class AffinityChoice:
    group: str
    # What keyed the request: "user", "prefix" (its leading messages) or "none" (least loaded); in
    # prefix mode "cached" where a replica holds enough of its prompt.
    source: str
    home: str | None  # the key's replica (or the one holding its prompt) were load no concern
    chosen: str  # the replica the request goes to first
    # Prefix mode: the prompt's blocks matched on the chosen replica and the best any replica had,
    # and why it was chosen ("prefix", "load" or "no match"); None in session mode.
    matched_blocks: int | None = None
    best_matched_blocks: int | None = None
    prefix_reason: str | None = None
    prompt_chars: int | None = None
    blocks: list[int] | None = None  # the prompt's block hashes (kept for `observe`, never recorded)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "group": self.group,
            "source": self.source,
            "home": self.home,
            "chosen": self.chosen,
        }
        if self.prefix_reason is not None:
            out.update(
                matched_blocks=self.matched_blocks,
                best_matched_blocks=self.best_matched_blocks,
                prefix_reason=self.prefix_reason,
                prompt_chars=self.prompt_chars,
            )
        return out


def _point(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class HashRing:
    """Replicas at `points` pseudo-random positions each; stable across processes and restarts."""

    def __init__(self, replicas: list[str], points: int) -> None:
        if not replicas or points < 1:
            raise ValueError("a ring needs replicas and at least one point each")
        ring = sorted((_point(f"{name}#{i}".encode()), name) for name in replicas for i in range(points))
        self._keys = [p for p, _ in ring]
        self._names = [n for _, n in ring]
        self.size = len(set(replicas))

    def walk(self, key: bytes) -> list[str]:
        """Every replica once, in ring order from the key's position."""
        start = bisect.bisect(self._keys, _point(key))
        out: list[str] = []
        seen: set[str] = set()
        n = len(self._names)
        for i in range(n):
            name = self._names[(start + i) % n]
            if name not in seen:
                seen.add(name)
                out.append(name)
                if len(out) == self.size:
                    break
        return out


def session_key(
    request: ChatCompletionRequest | CompletionRequest, prompt_chars: int
) -> tuple[str, bytes] | None:
    """(source, hashed key) of a request's conversation, or None when nothing identifies it."""
    if request.user:
        return "user", hashlib.blake2b(b"user\x00" + request.user.encode("utf-8", "surrogatepass")).digest()
    h = hashlib.blake2b(b"prefix\x00")
    if isinstance(request, ChatCompletionRequest):
        lead = []
        for m in request.messages:
            if m.role in LEADING_ROLES or m.role == "user":
                lead.append(m)
            if m.role == "user" or m.role not in LEADING_ROLES:
                break
        if not lead or lead[-1].role != "user":
            return None  # no user turn before the conversation went on: nothing stable to key by
        for m in lead:
            h.update(m.role.encode() + b"\x00" + repr(m.content).encode("utf-8", "surrogatepass") + b"\x01")
        return "prefix", h.digest()
    prompt = request.prompt
    # A string, a batch of strings, token ids, or a batch of token id lists: the first prompt.
    first = prompt[0] if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list) else prompt
    if isinstance(first, str) and first:
        text = first[:prompt_chars]
    elif isinstance(first, list) and first:  # token ids
        text = repr(first[:prompt_chars])
    else:
        return None
    h.update(text.encode("utf-8", "surrogatepass"))
    return "prefix", h.digest()


def prompt_text(request: ChatCompletionRequest | CompletionRequest) -> str:
    """The prompt as a replica's prefix cache sees it, near enough: every message in order, role
    and text (a chat template adds its markers around the same text, the same way every time), or a
    completion's first prompt."""
    if isinstance(request, ChatCompletionRequest):
        parts = []
        for m in request.messages:
            content = m.content
            if isinstance(content, str):
                text = content
            elif isinstance(content, list):
                text = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
            else:
                text = "" if content is None else repr(content)
            parts.append(f"<{m.role}>\n{text}\n")
        return "".join(parts)
    prompt = request.prompt
    first = prompt[0] if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list) else prompt
    if isinstance(first, str):
        return first
    return " ".join(str(t) for t in first) if isinstance(first, list) else ""


def bounded_pick(order: list[str], loads: dict[str, int], load_factor: float, floor: int = 1) -> str:
    """The first replica in `order` whose load with one more request stays within `load_factor`
    times the mean (ceiled, so one request in flight is always allowed somewhere), or within
    `floor`: a lightly loaded replica keeps its conversations (a server takes many at once)."""
    cap = max(floor, math.ceil(load_factor * (sum(loads[n] for n in order) + 1) / len(order)))
    for name in order:
        if loads[name] + 1 <= cap:
            return name
    return min(order, key=lambda n: loads[n])  # unreachable by the pigeonhole principle; defensive


class Affinity:
    def __init__(self, settings: Settings, registry: BackendRegistry) -> None:
        self.settings: AffinitySettings = settings.affinity
        self.registry = registry
        groups: dict[str, list[str]] = {}
        for b in settings.backends:
            if b.replica_group is not None:
                groups.setdefault(b.replica_group, []).append(b.name)
        self.group_of = {name: g for g, names in groups.items() for name in names}
        self.rings = {g: HashRing(names, self.settings.ring_points) for g, names in groups.items()}
        self.index = {g: PrefixIndex(self.settings.index_blocks) for g in groups}

    def arrange(
        self,
        backends: list[str],
        request: ChatCompletionRequest | CompletionRequest,
        record: bool = True,
        scope: str | None = "",
        loads: Mapping[str, BackendLoad] | None = None,
    ) -> tuple[list[str], AffinityChoice | None]:
        """`backends` with the first one's replica group reordered for this request; `record`
        False only asks (an operator's explain): the prefix index is left as it was. `scope`: whose
        earlier prompts this one may be matched against (the request's prefix-cache scope and
        salt, as for the embedded engine's cache; "" everyone's, None nobody's): a match steers
        routing and shows in the route, so it must not tell one tenant what another's prompts
        begin with. `loads`: the load snapshot the router decided on (read again here if None)."""
        group = self.group_of.get(backends[0]) if backends and self.settings.enabled else None
        if group is None:
            return backends, None
        members = [n for n in backends if self.group_of.get(n) == group]
        if len(members) < 2:
            return backends, None
        healthy: dict[str, bool] = {}
        batch: dict[str, int] = {}
        for name in members:
            seen = loads.get(name) if loads is not None else None
            if seen is None:
                b = self.registry.get(name)
                seen = b.load() if b is not None else BackendLoad(healthy=False)
            healthy[name], batch[name] = seen.healthy, seen.batch
        keyed = session_key(request, self.settings.prompt_chars)
        if keyed is None:
            source, home = "none", None
            ring = sorted(members, key=lambda n: (not healthy[n], batch[n]))
        else:
            source = keyed[0]
            present = set(members)
            ring = [n for n in self.rings[group].walk(keyed[1]) if n in present]
            home = next((n for n in ring if healthy[n]), ring[0])
        up = [n for n in ring if healthy[n]]
        prefix: PrefixChoice | None = None
        blocks: list[int] | None = None
        text_chars: int | None = None
        if self.settings.mode == "prefix" and up:
            st = self.settings
            text = prompt_text(request)
            text_chars = len(text)
            blocks = prompt_blocks(text, st.block_chars, st.max_prompt_blocks, scope or "")
            matched = self.index[group].match(blocks, up) if scope is not None else {}
            prefix = choose(
                up,
                matched,
                batch,
                len(blocks),
                block_chars=st.block_chars,
                min_match_blocks=st.min_match_blocks,
                load_factor=st.load_factor,
                spill_after=st.spill_after,
                chars_per_token=st.chars_per_token,
                tokens_per_request=st.tokens_per_request,
            )
            chosen = prefix.chosen
            usable = {n: m for n, m in matched.items() if m >= st.min_match_blocks}
            if usable:
                # Where its prompt is cached: the replica it would go to were load no concern.
                source, home = "cached", max(up, key=lambda n: (usable.get(n, 0), -up.index(n)))
            if scope is None:
                blocks = None  # nobody's: nothing to learn from it either
            elif record:
                # Where it goes now is where its blocks will be: the next request of the family
                # sees them at once (checked when the replica reports what it had cached).
                self.index[group].record(chosen, blocks)
        else:
            chosen = (
                bounded_pick(up, batch, self.settings.load_factor, self.settings.spill_after)
                if up and keyed
                else (up or ring)[0]
            )
        ordered = [
            chosen,
            *(n for n in up if n != chosen),
            *(n for n in ring if not healthy[n] and n != chosen),
        ]
        slots = iter(ordered)  # the group's members take the positions they held in the route
        arranged = [next(slots) if self.group_of.get(n) == group else n for n in backends]
        choice = AffinityChoice(group, source, home, chosen)
        if prefix is not None:
            choice.matched_blocks = prefix.matched_blocks
            choice.best_matched_blocks = prefix.best_matched_blocks
            choice.prefix_reason = prefix.reason
            choice.prompt_chars = text_chars
            choice.blocks = blocks
        return arranged, choice

    def observe(
        self,
        route: RouteDecision,
        blocks: Sequence[int] | None,
        cached_tokens: int | None,
        prompt_tokens: int | None,
    ) -> None:
        """After the request. A failover moved its prompt from the chosen replica to the one that
        served: the index says so. Otherwise the cached tokens the replica reports check what the
        index matched for it: fewer (by more than a block of slack: block edges and the chat
        template blur the count) means it had evicted what the index believed it held, so the
        index believes it keeps fewer blocks from now on; as many lets that belief grow back.
        `blocks`: the prompt's block hashes as the route was planned (`Plan.prefix_blocks`)."""
        affinity, served = route.affinity, route.backend
        if affinity is None or not blocks:
            return
        group = str(affinity.get("group"))
        index = self.index.get(group)
        if index is None:
            return
        chosen = affinity.get("chosen")
        predicted = int(affinity.get("matched_blocks") or 0)
        if served != chosen:
            if isinstance(chosen, str):
                index.correct(chosen, blocks, predicted)  # it never got the blocks past its match
            if served is not None and self.group_of.get(served) == group:
                index.record(served, blocks)
            return
        chars = affinity.get("prompt_chars") or 0
        if served is None or cached_tokens is None or not prompt_tokens or not chars or not predicted:
            return
        cached_chars = cached_tokens * chars / prompt_tokens
        cached_blocks = min(len(blocks), int(cached_chars) // self.settings.block_chars)
        if cached_blocks + 1 < predicted:
            index.missed(served, floor=len(blocks))
            index.record(served, blocks)  # it holds this prompt now, having prefilled it
        else:
            index.confirm(served)

    def undo(self, route: RouteDecision, blocks: Sequence[int] | None) -> None:
        """The request was not served (refused, or every backend failed): the chosen replica never
        got the blocks the index recorded for it past what it held before."""
        affinity = route.affinity
        if affinity is None or not blocks:
            return
        index, chosen = self.index.get(str(affinity.get("group"))), affinity.get("chosen")
        if index is not None and isinstance(chosen, str):
            index.correct(chosen, blocks, int(affinity.get("matched_blocks") or 0))

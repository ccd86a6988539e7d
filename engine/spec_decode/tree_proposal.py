"""What the engine does with a proposal before and after verifying it, chain or tree: check it, cut
it to the nodes worth verifying, the token history behind each of its logit rows, and the walk down
it that the controller learns from. Pure functions on `Proposal`."""

from __future__ import annotations

from specgate.engine.spec_decode import draft_tree
from specgate.engine.spec_decode.proposer import Proposal, ProposalRequest


def checked(prop: Proposal, req: ProposalRequest, vocab_size: int) -> tuple[Proposal | None, str | None]:
    """The proposal cut to what the engine may verify: tokens in the vocabulary, a well-formed tree at
    most k deep and at most max_nodes large (a chain at most k long); None if nothing is left. The
    second value names what was wrong with a proposal dropped for it. Scores outside [0, 1] (NaN
    included) are dropped, the tree kept."""
    tokens = prop.token_ids
    if tokens and not all(isinstance(t, int) and 0 <= t < vocab_size for t in tokens):
        return None, "tokens outside the vocabulary"
    parents = prop.parents
    if parents is not None and (len(parents) != len(tokens) or not draft_tree.is_valid(parents)):
        return None, "a malformed tree"
    probs = prop.probs
    if probs is not None and (probs.dim() != 2 or probs.shape[0] < len(tokens)):
        return None, f"draft distributions of shape {tuple(probs.shape)}"
    if parents is None or draft_tree.is_chain(parents) or req.max_nodes <= req.k:
        keep = (
            draft_tree.first_path(parents)[: req.k]
            if parents is not None
            else list(range(min(len(tokens), req.k)))
        )
        out = Proposal([tokens[j] for j in keep], probs[keep] if probs is not None else None)
    else:
        depth = draft_tree.depths(parents)
        keep = [j for j in range(len(tokens)) if depth[j] <= req.k][: req.max_nodes]
        kept_probs = probs[keep] if probs is not None else None
        out = Proposal([tokens[j] for j in keep], kept_probs, draft_tree.subtree(parents, keep))
        scores = prop.scores
        if scores is not None and len(scores) == len(tokens) and all(0.0 <= s <= 1.0 for s in scores):
            out.scores = [float(scores[j]) for j in keep]
    return (out if out.token_ids else None), None


def cut(prop: Proposal, keep: list[int]) -> Proposal:
    """A proposal cut to nodes `keep` (ascending, closed under ancestors); a chain if it is one."""
    parents = draft_tree.subtree(prop.parents, keep) if prop.parents is not None else None
    probs = prop.probs[keep] if prop.probs is not None else None
    tokens = [prop.token_ids[j] for j in keep]
    # The forced nodes lead the first path, so the kept ones are a prefix of it.
    forced = sum(1 for j in keep if j < prop.num_forced)
    if parents is None or draft_tree.is_chain(parents):
        return Proposal(tokens, probs, num_forced=forced)
    scores = [prop.scores[j] for j in keep] if prop.scores is not None else None
    return Proposal(tokens, probs, parents, scores, forced)


def first_path(prop: Proposal) -> Proposal:
    """A tree's chain (a chain as it is)."""
    if prop.parents is None:
        return prop
    return cut(prop, draft_tree.first_path(prop.parents))


def histories(draft: Proposal) -> list[list[int]]:
    """Per logit row of a verified draft (the root's, then each node's): the drafted tokens before the
    position that row predicts."""
    tokens = draft.token_ids
    if draft.parents is None:
        return [tokens[:j] for j in range(len(tokens) + 1)]
    return [[], *([tokens[n] for n in draft_tree.path_to(draft.parents, i)] for i in range(len(tokens)))]


def walk(
    parents: list[int], path: list[int], scores: list[float] | None
) -> list[tuple[int, int | None, float | None]]:
    """A verification's walk down a tree for the controller: per node visited that has children, how
    many it has, the rank of the accepted one (None: none was) and their summed scores."""
    kids = draft_tree.children(parents)
    visits: list[tuple[int, int | None, float | None]] = []
    node = -1
    for depth in range(len(path) + 1):
        below = kids.get(node, [])
        if not below:
            break
        taken = below.index(path[depth]) if depth < len(path) else None
        visits.append((len(below), taken, None if scores is None else sum(scores[c] for c in below)))
        if taken is None:
            break
        node = path[depth]
    return visits

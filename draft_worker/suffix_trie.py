"""A trie of reversed contexts: which tokens followed a given suffix, how often, how recently.

The n-gram drafter asks one question: *the sequence ends with ... a b c; what came after "a b c"
before?* The trie answers it for the longest context that was seen: its root's children are the
token just before a position, their children the token before that, and so on down to `max_n`
tokens. Every node keeps the counts of the tokens that followed its context (the continuation
table). Looking up a suffix walks it backwards, O(max_n) dict lookups; adding a token updates at
most `max_n` nodes. `remove` undoes `add` exactly, so a bounded pool can evict its oldest text.

    trie = SuffixTrie(max_n=4)
    trie.extend(tokens)                      # index tokens[i] after each of its contexts
    depth, table = trie.longest_match(tokens)  # deepest context matched, {next_token: count}
"""

from __future__ import annotations

from collections.abc import Sequence


class _Node:
    __slots__ = ("children", "next")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        # token that followed this node's context -> [count, stamp of its latest sighting]
        self.next: dict[int, list[int]] = {}


class SuffixTrie:
    def __init__(self, max_n: int):
        if max_n < 1:
            raise ValueError(f"max_n={max_n}: contexts need at least one token")
        self.max_n = max_n
        self.root = _Node()
        self.n_indexed = 0  # positions added minus positions removed
        self._stamp = 0

    def add(self, tokens: Sequence[int], pos: int) -> None:
        """Indexes `tokens[pos]` as the continuation of each context ending at `pos - 1`."""
        token = tokens[pos]
        self._stamp += 1
        node = self.root
        for back in range(1, min(self.max_n, pos) + 1):
            node = node.children.setdefault(tokens[pos - back], _Node())
            entry = node.next.get(token)
            if entry is None:
                node.next[token] = [1, self._stamp]
            else:
                entry[0] += 1
                entry[1] = self._stamp
        self.n_indexed += 1

    def extend(self, tokens: Sequence[int], start: int = 0, end: int | None = None) -> None:
        """Indexes positions `start .. end-1` of `tokens`."""
        for pos in range(max(start, 1), len(tokens) if end is None else end):
            self.add(tokens, pos)

    def remove(self, tokens: Sequence[int], pos: int) -> None:
        """Undoes `add(tokens, pos)` (same tokens); prunes the nodes left empty."""
        token = tokens[pos]
        path = [self.root]
        for back in range(1, min(self.max_n, pos) + 1):
            node = path[-1].children.get(tokens[pos - back])
            if node is None:  # never added: nothing to undo below here
                break
            path.append(node)
        for depth in range(len(path) - 1, 0, -1):
            node = path[depth]
            entry = node.next.get(token)
            if entry is not None:
                entry[0] -= 1
                if entry[0] <= 0:
                    del node.next[token]
            if not node.next and not node.children:
                del path[depth - 1].children[tokens[pos - depth]]
        self.n_indexed -= 1

    def longest_match(self, context: Sequence[int], min_n: int = 1) -> tuple[int, dict[int, list[int]]]:
        """(depth, continuation table) of the deepest indexed suffix of `context`, at least `min_n`
        tokens deep; (0, {}) when none is."""
        node, best_depth, best = self.root, 0, {}
        for back in range(1, min(self.max_n, len(context)) + 1):
            node = node.children.get(context[-back])
            if node is None:
                break
            if back >= min_n and node.next:
                best_depth, best = back, node.next
        return best_depth, best


def most_frequent(table: dict[int, list[int]], *, by_recency: bool = True) -> int:
    """The continuation seen most often; ties go to the one seen most recently, or with
    `by_recency=False` to the lowest token id. `remove` restores counts exactly but not recency, so a
    proposal that must be a function of the text alone (sampled requests) breaks ties by id."""
    if by_recency:
        return max(table.items(), key=lambda item: (item[1][0], item[1][1]))[0]
    return max(table.items(), key=lambda item: (item[1][0], -item[0]))[0]

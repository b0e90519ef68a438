"""Prefix (prompt) cache: KV state of earlier sequences, reused by later prompts.

Why: chats re-send the whole conversation every turn (turn N+1's prompt extends turn
N's prompt + output) and many requests share a long system prompt, so most prefill work
is repeated. Entries are stored per token sequence in mlx-lm's PromptTrie; a lookup uses
the entry sharing the longest common prefix with the new prompt and trims it to that
prefix (KVCache trimming is free: a slice). Bounded by bytes, least recently used first
out. Owned by the scheduler thread: not thread-safe.
"""

from __future__ import annotations

from collections import OrderedDict

from mlx_lm.models.cache import KVCache, PromptTrie

_MODEL = 0  # PromptTrie namespaces by model; a worker serves one


def _nbytes(cache: list[KVCache]) -> int:
    return sum(c.nbytes for c in cache)


def _view(cache: list[KVCache], n: int) -> list[KVCache]:
    """Fresh KVCache objects over the first n positions of a stored entry.

    The slices are new arrays, so the caller's writes never reach the stored entry.
    """
    out = []
    for c in cache:
        v = KVCache()
        if n > 0:
            v.keys = c.keys[..., :n, :]
            v.values = c.values[..., :n, :]
            v.offset = n
        out.append(v)
    return out


class PrefixCache:
    """LRU, byte-bounded map from token sequences to their per-layer KV caches."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._trie = PromptTrie()
        self._lru: OrderedDict[tuple[int, ...], list[KVCache]] = OrderedDict()
        self.nbytes = 0
        self.lookups = 0
        self.hits = 0
        self.tokens_served = 0

    def __len__(self) -> int:
        return len(self._lru)

    def lookup(self, tokens: list[int]) -> tuple[list[KVCache] | None, int]:
        """KV for the longest cached prefix of tokens, and its length.

        At most len(tokens) - 1 positions are served: the last prompt token must still
        go through the model to produce the first output's logits.
        """
        self.lookups += 1
        limit = len(tokens) - 1
        if limit <= 0 or not self._lru:
            return None, 0
        found = self._trie.search(_MODEL, tokens)
        if found.exact is not None:
            entry, common = found.exact, len(tokens)
        elif found.longer is not None:
            entry, common = found.longer, found.common_prefix
        else:
            return None, 0
        n = min(common, limit)
        if n <= 0:
            return None, 0
        key = tuple(entry)
        self._lru.move_to_end(key)
        self.hits += 1
        self.tokens_served += n
        return _view(self._lru[key], n), n

    def insert(self, tokens: list[int], cache: list[KVCache]) -> None:
        """Remember the KV of tokens (cache must hold exactly those positions)."""
        size = _nbytes(cache)
        if not tokens or size > self.max_bytes:
            return
        key = tuple(tokens)
        found = self._trie.search(_MODEL, tokens)
        if found.exact is None and found.longer is not None and found.common_prefix >= len(tokens):
            # A longer entry already covers this sequence; just mark it used.
            self._lru.move_to_end(tuple(found.longer))
            return
        if key in self._lru:
            self._drop(key)
        self._trie.add(_MODEL, tokens, True)
        # Entries that are prefixes of this one are now redundant (trimming serves them).
        for n, _ in self._trie.pop_prefixes(_MODEL, tokens):
            self.nbytes -= _nbytes(self._lru.pop(key[:n]))
        self._lru[key] = cache
        self.nbytes += size
        while self.nbytes > self.max_bytes and self._lru:
            self._drop(next(iter(self._lru)))

    def _drop(self, key: tuple[int, ...]) -> None:
        self._trie.pop(_MODEL, list(key))
        self.nbytes -= _nbytes(self._lru.pop(key))

    def clear(self) -> None:
        self._trie = PromptTrie()
        self._lru.clear()
        self.nbytes = 0

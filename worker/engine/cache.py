"""Prefix (prompt) cache: KV state of earlier sequences, reused by later prompts.

Why: chats re-send the whole conversation every turn (turn N+1's prompt extends turn
N's prompt + output) and many requests share a long system prompt, so most prefill work
is repeated. Entries are stored per token sequence in mlx-lm's PromptTrie; a lookup uses
the entry sharing the longest common prefix with the new prompt and trims it to that
prefix (KVCache trimming is free: a slice). Bounded by bytes, least recently used first
out. Owned by the scheduler thread: not thread-safe.

Entries live in a **scope** (the gateway's opaque ``cache_scope``, one per organization in hosted
mode; None locally): a lookup only sees its own scope's entries. Otherwise how many tokens a
prompt gets from the cache (``cached_tokens``, and its speed) tells one tenant what another's
prompts begin with, a token at a time.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

from mlx_lm.models.cache import KVCache, PromptTrie

# PromptTrie namespaces its entries by a key it calls the model; a worker serves one model, so
# the namespace is the scope.
Scope = Hashable


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
            assert c.keys is not None and c.values is not None  # a stored entry holds its n tokens
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
        self._lru: OrderedDict[tuple[Scope, tuple[int, ...]], list[KVCache]] = OrderedDict()
        self._scopes: dict[Scope, int] = {}  # entries per scope, to drop an emptied scope's trie
        self.nbytes = 0
        self.lookups = 0
        self.hits = 0
        self.tokens_served = 0

    def __len__(self) -> int:
        return len(self._lru)

    def lookup(self, tokens: list[int], scope: Scope = None) -> tuple[list[KVCache] | None, int]:
        """KV for the longest prefix of tokens cached in ``scope``, and its length.

        At most len(tokens) - 1 positions are served: the last prompt token must still
        go through the model to produce the first output's logits.
        """
        self.lookups += 1
        limit = len(tokens) - 1
        if limit <= 0 or not self._lru:
            return None, 0
        found = self._trie.search(scope, tokens)
        if found.exact is not None:
            entry, common = found.exact, len(tokens)
        elif found.longer is not None:
            entry, common = found.longer, found.common_prefix
        else:
            return None, 0
        n = min(common, limit)
        if n <= 0:
            return None, 0
        key = (scope, tuple(entry))
        self._lru.move_to_end(key)
        self.hits += 1
        self.tokens_served += n
        return _view(self._lru[key], n), n

    def insert(self, tokens: list[int], cache: list[KVCache], scope: Scope = None) -> None:
        """Remember the KV of tokens in ``scope`` (cache must hold exactly those positions)."""
        size = _nbytes(cache)
        if not tokens or size > self.max_bytes:
            return
        key = (scope, tuple(tokens))
        found = self._trie.search(scope, tokens)
        if found.exact is None and found.longer is not None and found.common_prefix >= len(tokens):
            # A longer entry already covers this sequence; just mark it used.
            self._lru.move_to_end((scope, tuple(found.longer)))
            return
        if key in self._lru:
            self._drop(key)
        self._trie.add(scope, tokens, True)
        # Entries that are prefixes of this one are now redundant (trimming serves them).
        for n, _ in self._trie.pop_prefixes(scope, tokens):
            self.nbytes -= _nbytes(self._lru.pop((scope, key[1][:n])))
            self._scopes[scope] -= 1
        self._lru[key] = cache
        self._scopes[scope] = self._scopes.get(scope, 0) + 1
        self.nbytes += size
        while self.nbytes > self.max_bytes and self._lru:
            self._drop(next(iter(self._lru)))

    def _drop(self, key: tuple[Scope, tuple[int, ...]]) -> None:
        scope, tokens = key
        self._trie.pop(scope, list(tokens))
        self.nbytes -= _nbytes(self._lru.pop(key))
        self._scopes[scope] -= 1
        if not self._scopes[scope]:
            # The trie keeps an empty namespace per scope ever seen: drop it with its last entry.
            del self._scopes[scope]
            self._trie._trie.pop(scope, None)

    def clear(self) -> None:
        self._trie = PromptTrie()
        self._lru.clear()
        self._scopes.clear()
        self.nbytes = 0

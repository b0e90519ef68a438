"""The bounded LRU under the response and conversation stores: budgets, recency and TTL."""

from __future__ import annotations

from kiln.gateway.store.lru import BoundedLRU


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_entries_expire_after_their_ttl_and_a_re_put_renews_it():
    clock = Clock()
    lru: BoundedLRU[str] = BoundedLRU(100, 10_000, ttl_s=10, clock=clock)
    lru.put("a", "first", 5)
    lru.put("b", "b", 5)
    clock.now = 6
    lru.put("a", "second", 5)  # renewed: now expires at 16
    clock.now = 11
    lru.put("c", "c", 5)  # a put sweeps what has expired
    assert lru.get("b") is None
    assert lru.get("a") == "second"
    assert len(lru) == 2 and lru.bytes == 10
    clock.now = 16
    assert lru.get("a") is None


def test_per_entry_ttl_and_no_ttl():
    clock = Clock()
    lru: BoundedLRU[str] = BoundedLRU(100, 10_000, ttl_s=0, clock=clock)
    lru.put("forever", "x", 1)
    lru.put("short", "y", 1, ttl_s=2)
    clock.now = 5
    lru.put("other", "z", 1)
    assert lru.get("forever") == "x" and lru.get("short") is None


def test_least_recently_used_goes_first_by_entries_and_bytes():
    lru: BoundedLRU[str] = BoundedLRU(2, 100, ttl_s=0)
    lru.put("a", "a", 10)
    lru.put("b", "b", 10)
    lru.get("a")
    lru.put("c", "c", 10)
    assert lru.get("b") is None and lru.get("a") == "a"
    assert not lru.put("huge", "h", 101)
    lru.put("d", "d", 95)
    assert len(lru) == 1 and lru.bytes == 95


def test_expiry_bookkeeping_stays_bounded_under_churn():
    clock = Clock()
    lru: BoundedLRU[int] = BoundedLRU(10, 10_000, ttl_s=3600, clock=clock)
    for i in range(50_000):
        lru.put(f"k{i}", i, 1)
    assert len(lru) == 10
    assert len(lru._expiry) <= 2 * 10 + 1024 + 1


def test_one_tenant_filling_the_store_evicts_only_its_own_entries():
    """Issue 30 tenants 3: with a share per tenant, a tenant writing far past its share loses
    its own oldest entries; another tenant's entry stays."""
    owner = lambda key: key.split(":", 1)[0]  # noqa: E731
    lru: BoundedLRU[str] = BoundedLRU(100, 10_000, ttl_s=0, owner_of=owner, owner_share=0.25)
    assert lru.put("b:victim", "v", 1_000)
    for i in range(300):
        lru.put(f"a:{i}", "x", 300)
    assert lru.get("b:victim") == "v"
    assert lru.get("a:299") == "x" and lru.get("a:0") is None
    assert sum(1 for i in range(300) if lru.get(f"a:{i}") is not None) <= 25  # its quarter
    # When the store is full, the tenant holding the most bytes loses first.
    full: BoundedLRU[str] = BoundedLRU(4, 10_000, ttl_s=0, owner_of=owner, owner_share=1.0)
    full.put("b:1", "v", 10)
    for i in range(3):
        full.put(f"a:{i}", "x", 100)
    full.put("c:1", "v", 10)
    assert full.get("b:1") == "v" and full.get("a:0") is None and len(full) == 4

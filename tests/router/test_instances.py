"""Instance pools: dns+ expansion, rotation after failures, least-waiting P, staleness."""

from __future__ import annotations

from controller.clock import VirtualClock
from controller.router.instances import Pool, Role, expand_entry


def pool(entries: list[str], clock: VirtualClock, on_change=None) -> Pool:  # type: ignore[no-untyped-def]
    p = Pool(Role.PREFILL, entries, unhealthy_after=2, waiting_stale_after_s=5.0, clock=clock,
             on_change=on_change)
    p.resolve()
    return p


def test_dns_names_expand_to_one_url_per_address_and_static_urls_stay() -> None:
    assert "http://127.0.0.1:8123" in expand_entry("dns+localhost:8123")
    assert expand_entry("http://10.0.0.1:8000") == ["http://10.0.0.1:8000"]
    clock = VirtualClock()
    p = pool(["dns+localhost:8123", "dns+no-such-name.invalid:1"], clock)
    assert "http://127.0.0.1:8123" in p.healthy()  # the unresolvable name is skipped


def test_failures_take_an_instance_out_and_one_success_brings_it_back() -> None:
    clock = VirtualClock()
    changes: list[tuple[str, bool]] = []
    p = pool(["http://a:1", "http://b:1"], clock, lambda inst, ok: changes.append((inst.url, ok)))
    p.failed("http://a:1")
    assert p.healthy() == ["http://a:1", "http://b:1"]  # one failure is not enough
    p.failed("http://a:1")
    assert p.healthy() == ["http://b:1"]
    p.succeeded("http://a:1")
    assert p.healthy() == ["http://a:1", "http://b:1"]
    assert changes == [("http://a:1", False), ("http://a:1", True)]
    p.entries = ["http://b:1"]
    p.resolve()  # a and its state leave with the entry
    assert p.healthy() == ["http://b:1"] and "http://a:1" not in p.instances


def test_least_waiting_first_and_stale_counts_are_unknown() -> None:
    clock = VirtualClock()
    p = pool(["http://a:1", "http://b:1", "http://c:1"], clock)
    for url, waiting in (("http://a:1", 4.0), ("http://b:1", 1.0)):
        inst = p.instances[url]
        inst.waiting, inst.waiting_at = waiting, clock.monotonic()
    assert p.by_least_waiting() == ["http://b:1", "http://a:1", "http://c:1"]
    assert p.by_least_waiting(exclude=["http://b:1"])[0] == "http://a:1"
    assert p.min_waiting() == 1.0
    clock.advance(6.0)
    assert p.min_waiting() is None  # stale: the busy override must not fire on old news

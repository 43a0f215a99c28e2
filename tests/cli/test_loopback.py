"""The loopback store's decisions, without sockets, and its two front ends over loopback TCP.

The store (``asyncload.cli.loopback.store``) decides every reply; the front ends (aiohttp.web
for the tests and ``asyncload serve``, the hand-written one for benchmark children) only wait
and write. The decisions are checked directly here; the few socket tests check that both front
ends send what was decided, and that a child starts without the ``asyncload`` package.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import aiohttp
import pytest

from asyncload.cli.loopback import (
    S3_SLOWDOWN,
    Reply,
    ServerProcess,
    ServerThread,
    Store,
    Ticket,
    object_bytes,
    parse_range,
)

pytestmark = pytest.mark.timeout(30)


def _get(path: str, **headers: str) -> Ticket:
    return Ticket("GET", f"/{path}", {k.lower().replace("_", "-"): v for k, v in headers.items()})


# ── decisions ─────────────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize(
    ("header", "span"),
    [
        ("bytes=0-3", (0, 4)),
        ("bytes=5-", (5, 10)),
        ("bytes=-4", (6, 10)),
        ("bytes=-40", (0, 10)),
        ("bytes=8-100", (8, 10)),
        ("bytes=2-3, 6-7", (2, 4)),  # only the first range of a list
        ("bytes=10-12", None),  # past the end: unsatisfiable
        ("bytes=10-", None),
        ("bytes=-0", None),
    ],
)
def test_parse_range(header: str, span: tuple[int, int] | None) -> None:
    assert parse_range(header, 10) == span


@pytest.mark.parametrize("header", ["items=0-3", "bytes=4-2", "bytes=x-3", "bytes=-"])
def test_parse_range_refuses_malformed_headers(header: str) -> None:
    with pytest.raises(ValueError, match=r"items|bytes|invalid literal"):
        parse_range(header, 10)


def test_token_bucket_refills_at_its_rate_per_prefix() -> None:
    store = Store(throttle_rate=2.0, throttle_burst=2.0)
    assert [store.take_token("a", 0.0) for _ in range(3)] == [True, True, False]
    assert store.take_token("b", 0.0)  # another prefix has its own bucket
    assert not store.take_token("a", 0.25)  # half a token back
    assert store.take_token("a", 0.5)
    assert [store.take_token("a", 10.0) for _ in range(3)] == [True, True, False]  # burst cap


def test_each_request_takes_one_fault() -> None:
    store = Store()
    store.put("a.bin", b"0123456789")
    store.fail("a.bin", "503", "short", "retry-after:2")
    first, second, third, fourth = (store.respond(_get("a.bin")) for _ in range(4))
    assert (first.status, bytes(first.body), first.fault) == (503, b"injected 503", None)
    assert (second.status, bytes(second.body), second.fault) == (200, b"0123456789", "short")
    assert (third.status, third.headers) == (503, [("Retry-After", "2")])
    assert (fourth.status, fourth.fault) == (200, None)
    # A fault acted out on the body is consumed by HEAD, which has none to cut short.
    store.fail("a.bin", "reset")
    head = store.respond(Ticket("HEAD", "/a.bin", {}))
    assert (head.status, head.fault, len(head.body)) == (200, None, 10)
    assert not store.faults["a.bin"]


def test_ranges_and_conditionals() -> None:
    store = Store()
    store.put("dir/b", b"abcdefghij")
    whole = store.respond(_get("dir/b"))
    etag = dict(whole.headers)["ETag"]
    part = store.respond(_get("dir/b", range="bytes=2-4"))
    assert (part.status, bytes(part.body)) == (206, b"cde")
    assert ("Content-Range", "bytes 2-4/10") in part.headers
    assert store.respond(_get("dir/b", range="bytes=20-")).headers == [
        ("Content-Range", "bytes */10")
    ]
    assert store.respond(_get("dir/b", range="lines=1-2")).status == 200  # served whole
    assert store.respond(_get("dir/b", if_match='"other"')).status == 412
    assert store.respond(_get("dir/b", if_match=etag)).status == 200
    stale = store.respond(_get("dir/b", range="bytes=0-1", if_range='"other"'))
    assert (stale.status, bytes(stale.body)) == (200, b"abcdefghij")
    store.conditionals = False
    assert store.respond(_get("dir/b", if_match='"other"')).status == 200
    assert store.respond(_get("dir/missing")).status == 404


def test_generated_objects_and_corpora() -> None:
    store = Store(generated=True, corpora={1: [b"first", b"second"]})
    reply = store.respond(_get("obj/1000/50/7"))
    assert bytes(reply.body) == object_bytes(7, 1000) != object_bytes(8, 1000)
    assert dict(reply.headers)["ETag"] == '"3e8-7"'
    assert bytes(store.respond(_get("obj/1/0/1")).body) == b"second"
    assert store.respond(_get("obj/1/0/2")).status == 404
    assert store.admit(_get("obj/10/50/1")) == pytest.approx(0.05)
    bad = store.admit(_get("obj/10/fast/1"))
    assert isinstance(bad, Reply)
    assert bad.status == 400


def test_admit_counts_and_pushes_back() -> None:
    store = Store(latency=0.01, throttle_rate=1.0, throttle_burst=1.0, control=True)
    assert store.admit(_get("p/x", x_test="1"), {"X-Test": "1"}) == pytest.approx(0.01)
    throttled = store.admit(_get("p/y"))
    assert isinstance(throttled, Reply)
    assert (throttled.status, bytes(throttled.body)) == (503, S3_SLOWDOWN.encode())
    post = store.admit(Ticket("POST", "/p/z", {}))
    assert isinstance(post, Reply)
    assert post.status == 405
    assert (store.requests, store.throttled, store.active, store.peak_active) == (3, 1, 3, 3)
    assert store.hits == {"p/x": 1, "p/y": 1, "p/z": 1}
    assert store.headers_seen[0] == {"X-Test": "1"}
    count = store.answer_control("/count")
    assert count is not None
    assert bytes(count.body) == b"3"
    assert store.answer_control("/p/x") is None
    # The allowance changes while a loader reads: the bucket refills at the new rate.
    rate = store.answer_control("/throttle-rate/1000")
    assert rate is not None
    assert (rate.status, bytes(rate.body), store.throttle_rate) == (200, b"1000", 1000.0)
    bad = store.answer_control("/throttle-rate/fast")
    assert bad is not None
    assert (bad.status, store.throttle_rate) == (400, 1000.0)
    done, gone = Ticket("GET", "/a", {}), Ticket("GET", "/b", {})
    store.end(done)
    store.cancel(done)  # already ended: not cancelled too
    store.cancel(gone)
    assert (store.finished, store.cancelled, store.active) == (2, 1, 1)


# ── the front ends, over loopback TCP ─────────────────────────────────────────────────────────


@pytest.mark.asyncio
@pytest.mark.parametrize("fast", [False, True], ids=["aiohttp.web", "fast"])
async def test_front_ends_send_what_the_store_decided(fast: bool) -> None:
    with ServerThread(fast=fast) as running:
        store = running.store
        url = store.put("x/a b.bin", b"0123456789")
        store.fail("x/a b.bin", "404", "short")
        async with aiohttp.ClientSession() as session:
            async with session.get(url) as resp:
                assert resp.status == 404
            with pytest.raises(aiohttp.ClientPayloadError):
                async with session.get(url) as resp:
                    await resp.read()
            async with session.get(url, headers={"Range": "bytes=-3"}) as resp:
                assert (resp.status, await resp.read()) == (206, b"789")
                assert resp.headers["Content-Range"] == "bytes 7-9/10"
            async with session.head(url) as resp:
                assert (resp.status, resp.headers["Content-Length"]) == (200, "10")
            store.latency = 0.02
            replies = await asyncio.gather(*(session.get(url) for _ in range(8)))
            assert {r.status for r in replies} == {200}
            for r in replies:
                r.release()
        assert store.raw_paths[0] == "/x/a%20b.bin"
        assert store.hits["x/a b.bin"] == 12
        assert store.peak_active >= 2


@pytest.mark.parametrize("fast", [False, True], ids=["aiohttp.web", "fast"])
def test_a_child_serves_without_the_asyncload_package(fast: bool) -> None:
    with ServerProcess(["--generated", "--control"], fast=fast) as child:
        code = (
            "import sys, urllib.request as u;"
            f"b = u.urlopen('{child.base_url}/obj/100/0/3', timeout=5).read();"
            "sys.stdout.write(b.hex())"
        )
        got = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=20, check=True
        )
        assert bytes.fromhex(got.stdout) == object_bytes(3, 100)
        assert child.count("count") == 1
        # The child imported the package on its own, not asyncload's (whose __init__ needs torch).
        with open(f"/proc/{child.pid}/maps") as maps:
            assert "torch" not in maps.read()

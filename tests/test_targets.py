"""dns:/// targets: expansion to every address, and re-resolution when pods come and go.

DNS answers cannot be changed for real here, so a resolve function stands in for the name server;
the servers and the gRPC traffic are real.
"""

from __future__ import annotations

import asyncio

import pytest

from client.reward_client import RewardClient
from client.targets import Resolver, expand_targets
from tests.support.servers import fn_pipeline, reward_server, sample


def test_expand_resolves_dns_names_and_passes_plain_targets() -> None:
    assert expand_targets("a:1, b:2") == ["a:1", "b:2"]
    assert expand_targets(["dns:///localhost:50051"])[0].endswith(":50051")
    with pytest.raises(ValueError, match="expected dns:///HOST:PORT"):
        expand_targets(["dns:///no-port"])
    with pytest.raises(ValueError, match="cannot resolve"):
        expand_targets(["dns:///name.invalid:1"])


def test_resolver_only_reports_changes_and_survives_failures() -> None:
    answers: list[list[str] | Exception] = [["a:1"], ["a:1"], ValueError("NXDOMAIN"), ["a:1", "b:1"]]

    def resolve(specs: list[str]) -> list[str]:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    r = Resolver("dns:///svc:1", resolve=resolve, interval_s=3600)
    assert r.addresses == ["a:1"]
    assert r.refresh() is None  # unchanged
    assert r.refresh() is None and r.addresses == ["a:1"]  # resolution failed: keep what we know
    assert r.refresh() == ["a:1", "b:1"]
    assert r.maybe_refresh() is None  # not due yet
    assert Resolver("x:1").refresh() is None  # static lists never re-resolve


async def test_reward_client_follows_pods_that_are_replaced_and_added() -> None:
    pipes = {"sleepy": fn_pipeline("sleepy")}
    async with reward_server(pipes) as a, reward_server(pipes) as b:
        pods = [a.address]
        resolver = Resolver("dns:///reward:50051", resolve=lambda specs: list(pods), interval_s=0.0)
        async with RewardClient("dns:///reward:50051", resolver=resolver, retry_backoff_s=0.05) as client:
            first = [client.submit(sample(f"a{i}", delay=0.4), "sleepy") for i in range(6)]
            await asyncio.sleep(0.15)
            pods[:] = [b.address]  # a rolling update replaced pod a with pod b
            await a.grpc.server.stop(0)
            results = await asyncio.gather(*first)
            assert [s.address for s in client.streams] == [b.address]
            pods[:] = [b.address, a.address]  # scale-out: a new pod appears (a's address reused, it is down)
            more = await asyncio.gather(*(client.submit(sample(f"b{i}"), "sleepy") for i in range(4)))
            assert sorted(s.address for s in client.streams) == sorted([a.address, b.address])
    assert all(not r.HasField("error") for r in [*results, *more])
    assert sorted(r.sample_id for r in results) == [f"a{i}" for i in range(6)]

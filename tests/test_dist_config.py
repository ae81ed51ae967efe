"""The multi-node settings (docs/multinode.md): placement of runtimes on nodes, environment variables standing in
for flags, and the mistakes that get a clear error before anything starts."""

from __future__ import annotations

import argparse

import pytest

from amoe.config import AmoeConfig, DistSection, ParallelSection, add_config_flags, config_from_args
from amoe.errors import ConfigError
from amoe.hostaddr import parse_addr, route_ip
from amoe.placement import node_map, runtime_roles


def parse(*argv: str) -> AmoeConfig:
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    return config_from_args(parser.parse_args(list(argv)))


def test_runtimes_fill_the_nodes_in_placement_order():
    roles = runtime_roles(ParallelSection(attn_ranks=1, expert_ranks=2))
    assert roles == ("attention", "expert", "expert")
    one_each = DistSection(nnodes=3, init_addr="h:1", runtimes_per_node=1)
    assert node_map(one_each, 3) == (0, 1, 2)  # the attention runtime with the coordinator
    assert node_map(DistSection(nnodes=2, init_addr="h:1"), 5) == (0, 0, 0, 1, 1)  # evenly, in order
    assert node_map(DistSection(nnodes=3, init_addr="h:1", node_map="0,2,2"), 3) == (0, 2, 2)
    assert node_map(DistSection(), 4) == (0, 0, 0, 0)


@pytest.mark.parametrize(
    ("dist", "runtimes", "message"),
    [
        (DistSection(nnodes=2, init_addr="h:1", runtimes_per_node=1), 3, "do not fit"),
        (DistSection(nnodes=2, init_addr="h:1", node_map="0,1"), 3, "names 2 nodes for 3 runtimes"),
        (DistSection(nnodes=2, init_addr="h:1", node_map="0,1,2"), 3, "outside"),
        (DistSection(nnodes=2, init_addr="h:1", node_map="0,x,1"), 3, "node numbers"),
    ],
)
def test_a_placement_that_cannot_be_gets_a_clear_error(dist, runtimes, message):
    with pytest.raises(ConfigError, match=message):
        node_map(dist, runtimes)


def test_environment_variables_stand_in_for_flags_not_given(monkeypatch):
    monkeypatch.setenv("AMOE_NNODES", "3")
    monkeypatch.setenv("AMOE_NODE_RANK", "2")
    monkeypatch.setenv("AMOE_DIST_INIT_ADDR", "10.0.0.1:29500")
    monkeypatch.setenv("AMOE_DIST_TIMEOUT_S", "30")
    dist = parse().dist
    assert (dist.nnodes, dist.node_rank, dist.init_addr, dist.timeout_s) == (3, 2, "10.0.0.1:29500", 30.0)
    assert parse("--node-rank", "1").dist.node_rank == 1  # a flag wins
    monkeypatch.setenv("AMOE_NODE_RANK", "two")
    with pytest.raises(ConfigError, match="AMOE_NODE_RANK"):
        parse()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--nnodes", "2"], "--dist-init-addr"),
        (["--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "h:1"], "node_rank"),
        (["--nnodes", "2", "--dist-init-addr", "h:1", "--parallel", "ep"], "--parallel aep"),
        (["--nnodes", "2", "--dist-init-addr", "h:1", "--transport", "gloo"], "--transport inline"),
        (["--nnodes", "2", "--dist-init-addr", "h:1", "--node-ip", "0.0.0.0"], "not a wildcard"),
        (["--distributed-backend", "slurm"], "backend"),
    ],
)
def test_multi_node_mistakes_are_refused_before_anything_starts(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse(*flags)


def test_addresses():
    assert parse_addr("10.1.2.3:29500") == ("10.1.2.3", 29500)
    assert parse_addr("[::1]:7") == ("::1", 7)
    for bad in ("nohost", "h:", ":5", "h:99999", "h:x"):
        with pytest.raises(ConfigError, match="HOST:PORT"):
            parse_addr(bad)
    assert route_ip("127.0.0.1:1") == "127.0.0.1"  # the source address of the route there

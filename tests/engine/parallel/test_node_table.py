"""The node table (nodes.json): each node writes its own row only, in its schema; a peer with the secret can neither
grow it without bound, nor break its later writes, nor change what it says about another node."""
import json
import threading

import pytest

from conveyor.engine.parallel import cluster
from conveyor.engine.parallel.cluster import NODES_TOPIC, NodeTable, row_problem

WAIT = 20


def row(**changes):
    return {"node_id": 9, "roles": ["collector"], "pid": 4242, "host": "h", "address": "tcp://127.0.0.1:1",
            "labels": [], **changes}


def received(mine, n):
    """An event set once ``n`` more rows reached ``mine`` (its handler runs after the table's)."""
    done, seen = threading.Event(), []

    def count(payload):
        seen.append(payload)
        if len(seen) == n:
            done.set()
    mine.on(NODES_TOPIC, count)
    return done


def test_a_row_is_kept_only_from_the_node_it_describes_and_in_the_schema(peer_with_the_secret, tmp_path):
    mine, peer = peer_with_the_secret
    path = tmp_path / "nodes.json"
    table = NodeTable(path)
    wrong = [row(node_id=1), row(node_id=0, pid=1), row(pid=float("nan")), row(pid=True), row(pid=-5),
             row(host=b"h"), row(host="x" * (1 << 20)), row(address=7), row(roles=["king"]),
             row(labels=["a"] * 1000), row(extra="x"), {"node_id": 9}, [1, 2], "row"]
    done = received(mine, len(wrong) + 1)
    peer.wait_for_subscribers(NODES_TOPIC, 1, WAIT)
    for payload in [*wrong, row()]:
        peer.publish(NODES_TOPIC, payload)
    assert done.wait(WAIT)
    rows = json.loads(path.read_text())
    assert [r["node_id"] for r in rows] == ["0", 9] and rows[1] == row()  # node "0" is a bare router here
    assert table.stats() == {"rejected": len(wrong)} and mine.stats()["handler_errors"] == 0


def test_the_table_holds_at_most_max_rows(peer_with_the_secret, tmp_path, monkeypatch):
    mine, peer = peer_with_the_secret
    monkeypatch.setattr(cluster, "MAX_ROWS", 1)  # this node's own row fills it
    table = NodeTable(tmp_path / "nodes.json")
    done = received(mine, 1)
    peer.wait_for_subscribers(NODES_TOPIC, 1, WAIT)
    peer.publish(NODES_TOPIC, row())
    assert done.wait(WAIT)
    assert len(table.rows) == 1 and table.stats() == {"rejected": 1}


@pytest.mark.parametrize("bad", [row(pid="1"), row(host=""), row(node_id=-1), row(node_id=1 << 40)])
def test_row_problem_names_what_is_wrong(bad):
    assert row_problem(bad) is not None and row_problem(row()) is None

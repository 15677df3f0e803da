"""A router in its own process, for the router tests: echoes "ping" payloads back on "pong".

    python _router_peer.py NODE_ID LISTEN [PEER ...]   (the secret, hex, in $CONVEYOR_TEST_SECRET)

Prints its address once it has handshaken with every PEER, then one line per message on "note" (``note PAYLOAD``),
per peer it loses (``lost NODE_ID``) and per message on "ask" (``peers_lost N``: its count), and runs until its
stdin closes.
"""
import os
import sys
import threading

from conveyor.engine.parallel.router import Router

node_id, listen, peers = sys.argv[1], sys.argv[2], sys.argv[3:]
printing = threading.Lock()


def say(line):
    """Print ``line`` whole: the delivery and control threads both print."""
    with printing:
        print(line, flush=True)


router = Router(node_id, bytes.fromhex(os.environ["CONVEYOR_TEST_SECRET"]), listen=listen, peers=peers,
                heartbeat_s=0.05, peer_timeout_s=2.0, send_timeout_s=5.0)
router.on("ping", lambda payload: router.publish("pong", {"from": node_id, "echo": payload}))
router.on("note", lambda payload: say(f"note {payload}"))
router.on_peer_lost(lambda node: say(f"lost {node}"))
router.on("ask", lambda payload: say(f"peers_lost {router.stats()['peers_lost']}"))
router.wait_for_peers(len(peers), timeout=20)
print(router.address, flush=True)
sys.stdin.read()
router.close()

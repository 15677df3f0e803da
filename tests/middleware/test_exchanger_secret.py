"""A learner waiting for collected data while a node with another secret keeps knocking says so within seconds."""
import time

import pytest

from conveyor.engine import OnlineRLContext, task
from conveyor.engine.parallel import generate_secret
from conveyor.engine.parallel.router import Router
from conveyor.middleware.exchanger import ContextExchanger

FAST = dict(heartbeat_s=0.05, peer_timeout_s=2.0, send_timeout_s=5.0, auth_timeout_s=1.0)


@pytest.fixture
def learner_router():
    router = Router("0", generate_secret(), listen="tcp://127.0.0.1:0", **FAST)
    task.attach_router(router)
    yield router
    task.detach_router()
    router.close()


def test_a_learner_with_no_peer_names_the_address_with_another_secret_within_seconds(learner_router):
    with Router("1", generate_secret(), peers=[learner_router.address], **FAST):
        start = time.monotonic()
        with task.start(ctx=OnlineRLContext()):
            task.add_role(task.role.LEARNER)
            task.use(ContextExchanger(timeout_s=60))
            with pytest.raises(TimeoutError) as e:
                task.run(max_step=1)
        assert time.monotonic() - start < 15  # a few auth timeouts, not the 60 s it would wait for data
    message = str(e.value)
    assert "127.0.0.1:" in message and "failed authentication" in message and "another secret" in message
    assert "--secret-file" in message and "CONVEYOR_SECRET" in message and "\n" not in message

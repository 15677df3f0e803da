import pytest

from conveyor.engine.parallel.router import Router
from tests.engine.parallel._wire import FAST, SECRET


@pytest.fixture
def make_router():
    """Routers with fast heartbeats and the tests' shared secret, closed at the end of the test."""
    made = []

    def make(node_id, secret=SECRET, **kwargs):
        router = Router(node_id, secret, **{**FAST, **kwargs})
        made.append(router)
        return router

    yield make
    for router in made:
        router.close()

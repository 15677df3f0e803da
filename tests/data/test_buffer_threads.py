"""A buffer shared by a pusher and a learner thread, as in an async pipeline."""
import threading

import numpy as np

from conveyor.data import DequeBuffer


def test_concurrent_extend_sample_and_update_keep_the_buffer_consistent():
    buffer = DequeBuffer(500, prioritized=True, seed=0)
    buffer.extend({"obs": np.zeros((10, 3), np.float32), "reward": np.zeros(10, np.float32)})
    start = threading.Barrier(2, timeout=10)
    errors = []

    def pusher():
        start.wait()
        for i in range(300):
            buffer.extend({"obs": np.full((7, 3), i, np.float32), "reward": np.full(7, i, np.float32)})

    def learner():
        start.wait()
        for _ in range(300):
            batch = buffer.sample(16)
            if not np.array_equal(batch.obs[:, 0].numpy(), batch.reward.numpy()):
                errors.append("torn transition")
            buffer.update_priority(batch.index, np.ones(16))

    threads = [threading.Thread(target=pusher), threading.Thread(target=learner)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(buffer) == 500

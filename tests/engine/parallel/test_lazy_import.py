"""The message layer loads numpy, torch and treetensor only when a message holds their values."""
import subprocess
import sys

import numpy as np

from conveyor.engine.parallel import encode, seal

HEAVY = ("numpy", "torch", "treetensor", "pynng", "gymnasium")


def run(code, stdin=b""):
    out = subprocess.run([sys.executable, "-c", code], input=stdin, capture_output=True, check=True, timeout=120)
    return out.stdout.decode().strip()


def test_importing_the_engine_does_not_import_the_parallel_layer():
    assert run("import sys, conveyor.engine; print('conveyor.engine.parallel' in sys.modules)") == "False"


def test_plain_messages_travel_without_loading_numpy_torch_or_pynng():
    code = ("import sys; from conveyor.engine.parallel import *; s = generate_secret(); "
            "f = open_frame(s, seal(s, 't', 1, 'n', encode({'a': [1, 2.0, b'x', ('y', None)]})), 1 << 20); "
            "assert decode(f.payload) == {'a': [1, 2.0, b'x', ('y', None)]}; "
            f"print([m for m in {HEAVY!r} if m in sys.modules])")
    assert run(code) == "[]"


def test_an_array_payload_loads_numpy_on_decoding_only():
    data = seal(b"s" * 32, "t", 1, "n", encode({"obs": np.arange(6, dtype=">i2").reshape(2, 3)}))
    code = ("import sys; from conveyor.engine.parallel import *; "
            "f = open_frame(b's' * 32, sys.stdin.buffer.read(), 1 << 20); before = 'numpy' in sys.modules; "
            "obs = decode(f.payload)['obs']; print(before, type(obs).__name__, obs.dtype.str, obs.tolist())")
    assert run(code, stdin=data) == "False ndarray >i2 [[0, 1, 2], [3, 4, 5]]"


def test_parallel_is_reached_from_the_engine_without_loading_pynng_until_a_worker_needs_it():
    code = ("import sys, conveyor.engine; from conveyor.engine import Parallel; "
            "print(Parallel.__name__, [m for m in ('pynng', 'numpy', 'torch') if m in sys.modules])")
    assert run(code) == "Parallel []"

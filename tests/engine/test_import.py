"""The engine is a general runtime: importing it must not load the RL stack."""
import subprocess
import sys


def test_importing_the_engine_pulls_in_no_torch_gymnasium_or_pynng():
    code = ("import sys, conveyor.engine; heavy = [m for m in ('torch', 'gymnasium', 'pynng', 'numpy') "
            "if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

"""Importing Conveyor's RL stack prints no third-party deprecation noise."""
import subprocess
import sys


def test_importing_the_policies_raises_no_future_warning():
    code = "import conveyor.policy, conveyor.middleware"
    subprocess.run([sys.executable, "-W", "error::FutureWarning", "-c", code], check=True)

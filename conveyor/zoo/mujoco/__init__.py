"""Zoo entries for Gymnasium's MuJoCo v5 locomotion envs (needs ``pip install "conveyor[mujoco]"``).

Each entry trains HalfCheetah-v5 by default; ``--set env.env_id=Hopper-v5`` (or Walker2d-v5, Ant-v5,
Humanoid-v5) trains another with the same hyperparameters, as the papers and RL Zoo do. They set no
``env.stop_value`` (these envs have no "solved" score): a run ends at ``--max-env-step``.
"""

MUJOCO_ENV_IDS = ("HalfCheetah-v5", "Hopper-v5", "Walker2d-v5", "Ant-v5", "Humanoid-v5")
"""The MuJoCo envs the entries are meant for (tested to build and step)."""

"""Zoo entries for Atari 2600 games through ale-py and Gymnasium (needs ``pip install "conveyor[atari]"``).

Each entry plays ``ALE/Breakout-v5`` by default; ``--set env.env_id=ALE/Pong-v5`` (any ``ALE/<Game>-v5``) plays
another with the same hyperparameters. ALE ids get the Atari preprocessing of ``env.atari`` (frame skip 4,
84x84 grey frames, 4 stacked, up to 30 no-ops at reset, sticky actions 0.25 as v5 defines them); the
collector's envs end an episode at each lost life and clip rewards to their sign, the evaluator's play full
games and report their unclipped score. They set no ``env.stop_value``: a run ends at ``--max-env-step``.
"""

"""BenchMARL's evaluation as ``benchmarks.marl_learning`` reads it, imported only by that script's BenchMARL worker
(in BenchMARL's own virtualenv): a callback class, in a module because BenchMARL pickles an experiment's callbacks."""
from __future__ import annotations

from typing import Any, List

from benchmarl.experiment import Callback


class TeamReturns(Callback):
    """Each evaluation's mean team return over its episodes, in ``means``: per episode the sum over agents and steps
    of the rewards (BenchMARL logs the mean over agents)."""

    def __init__(self) -> None:
        super().__init__()
        self.means: List[float] = []

    def on_evaluation_end(self, rollouts: List[Any]) -> None:
        """Called by BenchMARL with the evaluation's episodes, each cut at its end."""
        returns = [sum(float(episode.get(("next", group, "reward")).sum()) for group in self.experiment.group_map)
                   for episode in rollouts]
        self.means.append(sum(returns) / len(returns))

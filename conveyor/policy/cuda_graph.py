"""A learning step replayed from a CUDA graph: one launch for the whole update instead of hundreds.

A SAC or TD3 update on 256-wide networks runs several hundred small kernels; on a GPU the time goes to
launching them from Python, not to the arithmetic (on an NVIDIA H100, 115 eager SAC updates/s against 134 on 16
CPU cores: ``benchmarks/device_path.py``). :class:`CudaGraphStep` captures the update once per batch signature and
then replays it, with torch's own graph API (``torch.cuda.CUDAGraph``), not a compiler.

A step is graph-safe when it runs on the GPU alone: no ``.item()`` or host tensors inside, no Python branch on
a tensor's value, its optimizers made with ``capturable=True``, and its random numbers drawn from the default
CUDA generator or from the ``generators`` given here (registered with every graph, so a replay advances them as
an eager step would, and their checkpointed state stays exact).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Hashable, Sequence, Tuple

import torch
import treetensor.torch as ttorch
import treevalue

__all__ = ["CudaGraphStep", "scalars"]

_Signature = Tuple[Hashable, Hashable, Tuple[Tuple[Tuple[str, ...], Tuple[int, ...], torch.dtype], ...]]


def scalars(metrics: Dict[str, torch.Tensor]) -> Dict[str, float]:
    """Scalar metric tensors as floats, in one device-to-host copy (one synchronisation, not one per metric)."""
    if not metrics:
        return {}
    values = torch.stack([value.detach().reshape(()).float() for value in metrics.values()]).tolist()
    return dict(zip(metrics, values))


class CudaGraphStep:
    """Runs ``step(batch, variant)`` (a learning step over a ttorch batch on the GPU) from captured CUDA graphs.

    The first ``warmup`` calls of each signature (the batch's leaf names, shapes and dtypes, ``variant`` and
    ``key``) run the step eagerly on a side stream, so optimizer state and library workspaces exist before capture; the
    next call captures it on that stream and replays it, and from then on each call copies the batch into the
    graph's input tensors and replays. ``variant`` (passed on to the step) is for a step that takes a different
    path on some calls (TD3's delayed actor update); ``key`` (not passed on) names whatever else a graph bakes into
    its kernels (learning rates): each value of either gets its own graph.

    What a call returns is the graph's own output, overwritten by the next replay: read it first. :meth:`reset`
    drops every graph; call it after anything replaced a tensor a graph reads (loading an optimizer's state
    replaces its moment tensors).
    """

    def __init__(self, step: Callable[[ttorch.Tensor, Hashable], Any], *,
                 generators: Sequence[torch.Generator] = (), warmup: int = 3) -> None:
        self._step = step
        self._generators = list(generators)
        self._warmup = warmup
        self._stream: torch.cuda.Stream | None = None
        self._eager_calls: Dict[_Signature, int] = {}
        self._graphs: Dict[_Signature, Tuple[torch.cuda.CUDAGraph, list, Any]] = {}

    @property
    def captured(self) -> int:
        """Graphs captured so far (one per batch signature and variant)."""
        return len(self._graphs)

    def reset(self) -> None:
        """Drop every graph; the next calls warm up and capture again."""
        self._graphs.clear()
        self._eager_calls.clear()

    def __call__(self, batch: ttorch.Tensor, variant: Hashable = None, *, key: Hashable = ()) -> Any:
        leaves = treevalue.flatten(batch)
        signature: _Signature = (variant, key, tuple((path, tuple(value.shape), value.dtype) for path, value in leaves))
        graphed = self._graphs.get(signature)
        if graphed is None:
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=leaves[0][1].device if leaves else None)
            done = self._eager_calls.get(signature, 0)
            if done < self._warmup:
                self._eager_calls[signature] = done + 1
                return self._on_side_stream(batch, variant)
            graphed = self._graphs[signature] = self._capture(leaves, variant)
        graph, inputs, outputs = graphed
        for static, (_, value) in zip(inputs, leaves):
            static.copy_(value, non_blocking=True)
        graph.replay()
        return outputs

    def _on_side_stream(self, batch: ttorch.Tensor, variant: Hashable) -> Any:
        """One eager step on the capture stream, ordered after the work already queued on the current one."""
        current = torch.cuda.current_stream()
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            out = self._step(batch, variant)
        current.wait_stream(self._stream)
        return out

    def _capture(self, leaves: list, variant: Hashable) -> Tuple[torch.cuda.CUDAGraph, list, Any]:
        """Capture the step over static copies of ``leaves``; the graph, its input tensors and its outputs."""
        inputs = [value.clone() for _, value in leaves]
        static = ttorch.Tensor(treevalue.unflatten([(path, value) for (path, _), value in zip(leaves, inputs)]))
        graph = torch.cuda.CUDAGraph()
        for generator in self._generators:
            graph.register_generator_state(generator)
        # thread_local: an acting thread may use the GPU while this one captures (async mode).
        with torch.cuda.graph(graph, stream=self._stream, capture_error_mode="thread_local"):
            outputs = self._step(static, variant)
        return graph, inputs, outputs

"""Data: the batch layout every layer shares, replay buffers and offline datasets.

``DequeBuffer`` keeps transitions in preallocated numpy rings and samples them as ttorch batches
(uniformly, or by priority); ``SequenceBuffer`` keeps padded sequences
of steps in one for recurrent learners; the batch helpers build and reshape those batches once per batch.
"""
from conveyor.data.batch import (
    Nested,
    as_tree,
    flatten_batch,
    map_nested,
    stack_nested,
    to_device,
    to_host,
    to_numpy,
    to_tensor,
    tree_of_tensors,
)
from conveyor.data.buffer import DequeBuffer
from conveyor.data.sequence import SequenceBuffer
from conveyor.data.offline import (DatasetError, DatasetWriter, OfflineDataset, check_spaces, concat_datasets,
                                   dataset_metadata, dataset_root, load_dataset, save_dataset)

__all__ = [
    "DatasetError",
    "DatasetWriter",
    "DequeBuffer",
    "OfflineDataset",
    "SequenceBuffer",
    "check_spaces",
    "concat_datasets",
    "dataset_metadata",
    "dataset_root",
    "load_dataset",
    "save_dataset",
    "Nested",
    "as_tree",
    "flatten_batch",
    "map_nested",
    "stack_nested",
    "to_device",
    "to_host",
    "to_numpy",
    "to_tensor",
    "tree_of_tensors",
]

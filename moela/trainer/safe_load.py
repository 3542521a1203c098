"""Reading checkpoints without running code hidden in them.

A checkpoint is something users share, so every file moela reads from one goes through an allow-list, never
through a general unpickler:
- DCP's `.metadata` is a pickle that `FileSystemReader.read_metadata` would load with `pickle.load`, which calls
  whatever a crafted file names. `read_metadata` here unpickles it with `find_class` limited to the classes DCP
  metadata is made of (the `torch.distributed.checkpoint.metadata` dataclasses, `_StorageInfo`, `torch.Size`, dtypes,
  layouts, paths) and then checks its shape: every entry a tensor or bytes record, every shard a plain file name
  inside the checkpoint folder (no `..`, no absolute path).
- DCP stores non-tensor values (the optimizer's hyperparameters) as torch-saved bytes and its default planner loads
  them with `torch.load(weights_only=False)`; `SafeLoadPlanner` loads them with `weights_only=True` (tensors and
  primitive containers only).
- The trainer state (`trainer-rank{r}.pt`) is saved as tensors and primitive containers only and read with
  `torch.load(weights_only=True)`. Files written before (NumPy arrays in the RNG state) load under the same
  restriction with NumPy's array reconstruction admitted, which rebuilds an array from its bytes and calls nothing
  else.

Anything outside the allow-list is refused with `CorruptCheckpoint`, one line naming the file.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

from moela.trainer.errors import CorruptCheckpoint

METADATA = ".metadata"
_DCP = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    *((_DCP, name) for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                                "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    *(("pathlib", name) for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")),
    *(("pathlib._local", name) for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")),
}
_REFUSED = "refusing to read it: a file of a shared checkpoint could be crafted to run code when loaded"


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata; any other class or function named in the file raises CorruptCheckpoint."""

    def __init__(self, file, path: Path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) not in _ALLOWED:
            raise CorruptCheckpoint(f"{self.path} names {module}.{name}, which DCP metadata never holds; {_REFUSED}")
        return super().find_class(module, name)


def read_metadata(checkpoint: str | Path) -> Metadata:
    """The DCP metadata of `checkpoint` (a step folder), read through the allow-list and checked."""
    path = Path(checkpoint) / METADATA
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f, path).load()
    except CorruptCheckpoint:
        raise
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{path} is missing: not a complete checkpoint folder") from None
    except Exception as e:  # a truncated or garbled pickle raises any of several types
        raise CorruptCheckpoint(f"{path} is unreadable ({type(e).__name__}: {str(e)[:120]}); the file is "
                                f"truncated or not a checkpoint's metadata") from None
    problem = _metadata_problem(metadata)
    if problem:
        raise CorruptCheckpoint(f"{path}: {problem}; {_REFUSED}")
    return metadata


def _metadata_problem(metadata: Any) -> str | None:
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        return f"holds a {type(metadata).__name__}, not DCP metadata"
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(key, str) or not isinstance(entry, (TensorStorageMetadata, BytesStorageMetadata)):
            return f"entry {key!r} is a {type(entry).__name__}, not a tensor or bytes record"
    if not isinstance(metadata.storage_data, dict):
        return "lists no shard files"
    for info in metadata.storage_data.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
            return f"points at {name!r}, which is not a file name inside the checkpoint folder"
    if metadata.storage_meta is not None and not isinstance(metadata.storage_meta, StorageMeta):
        return f"its storage_meta is a {type(metadata.storage_meta).__name__}"
    return None


class SafeReader(FileSystemReader):
    """DCP's file reader with `.metadata` read once, through the allow-list, when it is created (a refused file
    raises then, not inside DCP, which would catch the error and log it with a traceback before re-raising)."""

    def __init__(self, checkpoint: str | Path):
        super().__init__(str(checkpoint))
        self.metadata = read_metadata(checkpoint)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CorruptCheckpoint(f"{self.path}: per-rank metadata files are not read by moela")
        self.metadata.storage_meta = self.metadata.storage_meta or StorageMeta()
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata


def expect_tensor(metadata: Metadata, fqn: str, checkpoint: Path) -> None:
    """Refuse an entry that should hold a tensor (a weight, a moment) but is declared as pickled bytes."""
    if isinstance(metadata.state_dict_metadata.get(fqn), BytesStorageMetadata):
        raise CorruptCheckpoint(f"{checkpoint}: its entry {fqn} is stored as pickled bytes where a tensor belongs; "
                                f"{_REFUSED}")


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor entries with `torch.load(weights_only=True)`."""

    def __init__(self, checkpoint: str | Path, **kwargs: Any):
        super().__init__(**kwargs)
        self.checkpoint = Path(checkpoint)

    def create_local_plan(self) -> LoadPlan:
        for fqn, value in self.state_dict.items():
            if isinstance(value, torch.Tensor):
                expect_tensor(self.metadata, fqn, self.checkpoint)
        return super().create_local_plan()

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except Exception as e:
            raise CorruptCheckpoint(f"{self.checkpoint}: its entry {fqn} is not plain data "
                                    f"({str(e).splitlines()[-1][:160]}); {_REFUSED}") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def load(state: dict[str, Any], checkpoint: str | Path, planner: DefaultLoadPlanner | None = None,
         reader: SafeReader | None = None) -> None:
    """`dcp.load(state)` from `checkpoint` through the safe reader (`reader`: one already open on it) and planner
    (`planner` must derive from SafeLoadPlanner). A CorruptCheckpoint raised inside DCP comes out as itself."""
    reader = reader or SafeReader(checkpoint)
    try:
        dcp.load(state, storage_reader=reader, planner=planner or SafeLoadPlanner(checkpoint),
                 no_dist=not dist.is_initialized())
    except CheckpointException as e:
        refused = [f for fs in e.failures.values() for f in (fs if isinstance(fs, tuple) else (fs,))
                   if isinstance(f, CorruptCheckpoint)]
        if refused:
            raise refused[0] from None
        raise


_RECONSTRUCT = np.zeros(0).__reduce__()[0]  # numpy's array-from-bytes constructor, under either module name
_NUMPY_ARRAYS = [np.ndarray, np.dtype, *(type(np.dtype(t)) for t in (np.uint32, np.int64, np.float64)),
                 *((_RECONSTRUCT, f"{module}.multiarray._reconstruct") for module in ("numpy.core", "numpy._core"))]


def load_trainer_state(file: Path) -> dict[str, Any]:
    """A `trainer-rank{r}.pt` file: tensors and primitive containers only (NumPy arrays in files written before
    the trainer saved none)."""
    try:
        with torch.serialization.safe_globals(_NUMPY_ARRAYS):
            state = torch.load(file, weights_only=True, map_location="cpu")
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{file} is missing") from None
    except Exception as e:
        reason = str(e).strip().splitlines()[-1][:200] if str(e).strip() else type(e).__name__
        raise CorruptCheckpoint(f"{file} is not plain trainer state ({reason}); {_REFUSED}") from None
    if not isinstance(state, dict):
        raise CorruptCheckpoint(f"{file} holds a {type(state).__name__}, not the trainer state")
    return state

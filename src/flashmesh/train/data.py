"""The training text: the bytes of the running interpreter's standard library sources.

Every `*.py` file under `sysconfig.get_paths()['stdlib']` (third-party `site-packages` and
`dist-packages` folders excluded: they are not the standard library and differ from one machine
to the next) is read as bytes, in sorted order of its path relative to that folder. Files go to
the validation split by their place in that order (every `validation_every`-th file), so the
split is deterministic, disjoint by file, and spread over every folder of the library rather
than being one corner of it. Each split is one uint8 stream: the files' bytes, each followed by
`SEPARATOR` (byte 0, which no standard-library source contains), so a model can see where a
file ends. The vocabulary is the 256 byte values.

Batches are random windows of T + 1 consecutive bytes drawn with a seeded numpy generator:
inputs are the first T bytes, targets the last T (the next byte at each position).

Shapes: B batch, T sequence length.

Example:
  >>> corpus = load_corpus()
  >>> rng = np.random.default_rng(0)
  >>> x, y = sample_batch(corpus.train, rng, batch=8, seq=128)   # int32 [8, 128] each
"""

from __future__ import annotations

import dataclasses
import sysconfig
from pathlib import Path

import numpy as np

VOCAB = 256
SEPARATOR = 0
EXCLUDED_DIRS = ("site-packages", "dist-packages")


@dataclasses.dataclass(frozen=True)
class Corpus:
    """The two splits as byte streams, and which files went where.

    train, validation: uint8 [bytes] streams (files joined, each followed by SEPARATOR).
    train_files, validation_files: paths relative to `root`, in stream order.
    root: the folder that was read.
    """

    train: np.ndarray
    validation: np.ndarray
    train_files: tuple[str, ...]
    validation_files: tuple[str, ...]
    root: str

    def describe(self) -> dict:
        """Sizes for a report (no arrays)."""
        return dict(root=self.root, train_files=len(self.train_files), train_bytes=int(self.train.size),
                    validation_files=len(self.validation_files),
                    validation_bytes=int(self.validation.size), vocab=VOCAB)


def stdlib_root() -> Path:
    """The running interpreter's standard-library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: str | Path | None = None) -> list[str]:
    """Every *.py file under `root` (default: the stdlib folder), relative posix paths, sorted;
    files inside `EXCLUDED_DIRS` are left out."""
    root = Path(root) if root is not None else stdlib_root()
    if not root.is_dir():
        raise ValueError(f"root must be a folder, got {str(root)!r}")
    names = []
    for path in root.rglob("*.py"):
        relative = path.relative_to(root)
        if path.is_file() and not any(part in EXCLUDED_DIRS for part in relative.parts[:-1]):
            names.append(relative.as_posix())
    return sorted(names)


def split_files(names: list[str], validation_every: int = 20) -> tuple[list[str], list[str]]:
    """(train, validation) names: the file at sorted position i is a validation file when
    i % validation_every == validation_every - 1 (so 1 in `validation_every`)."""
    if not isinstance(validation_every, int) or validation_every < 2:
        raise ValueError(f"validation_every must be an int >= 2, got {validation_every!r}")
    train = [n for i, n in enumerate(names) if i % validation_every != validation_every - 1]
    validation = [n for i, n in enumerate(names) if i % validation_every == validation_every - 1]
    return train, validation


def _stream(root: Path, names: list[str]) -> np.ndarray:
    parts = []
    for name in names:
        parts.append(np.frombuffer((root / name).read_bytes(), dtype=np.uint8))
        parts.append(np.array([SEPARATOR], dtype=np.uint8))
    return np.concatenate(parts) if parts else np.zeros((0,), np.uint8)


def load_corpus(root: str | Path | None = None, validation_every: int = 20) -> Corpus:
    """Read the sources under `root` (default: the stdlib folder) into the two splits.

    Raises ValueError when `root` holds too few files for both splits.
    """
    root = Path(root) if root is not None else stdlib_root()
    names = source_files(root)
    train, validation = split_files(names, validation_every)
    if not train or not validation:
        raise ValueError(f"root {str(root)!r} holds {len(names)} *.py file(s); both splits need at least "
                         f"one (validation takes every {validation_every}-th file, so at least "
                         f"{validation_every} files are needed)")
    return Corpus(train=_stream(root, train), validation=_stream(root, validation),
                  train_files=tuple(train), validation_files=tuple(validation), root=str(root))


def sample_batch(stream: np.ndarray, rng: np.random.Generator, batch: int,
                 seq: int) -> tuple[np.ndarray, np.ndarray]:
    """`batch` random windows of seq + 1 bytes of `stream`: (inputs, targets), int32 [B, T] each,
    targets[b, t] == inputs[b, t + 1] for t < T - 1.

    The window starts are uniform over every position where a whole window fits, drawn from
    `rng` (a seeded `np.random.default_rng`), so the same generator state gives the same batch.
    """
    for name, value in (("batch", batch), ("seq", seq)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if stream.ndim != 1 or stream.dtype != np.uint8:
        raise ValueError(f"stream must be a 1-d uint8 array, got {stream.dtype} {stream.shape}")
    if stream.size < seq + 1:
        raise ValueError(f"stream holds {stream.size} bytes; a window needs seq + 1 = {seq + 1}")
    starts = rng.integers(0, stream.size - seq, size=batch)  # high is exclusive: start + seq <= size - 1
    windows = stream[starts[:, None] + np.arange(seq + 1)[None, :]].astype(np.int32)
    return windows[:, :-1], windows[:, 1:]


def validation_batches(stream: np.ndarray, seed: int, count: int, batch: int,
                       seq: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """A fixed list of `count` batches of the validation stream (its own generator, seeded by
    `seed`), so that every evaluation of a run, and every run, scores the same windows."""
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"count must be a positive int, got {count!r}")
    rng = np.random.default_rng([seed, 1])  # a stream separate from the training batches'
    return [sample_batch(stream, rng, batch, seq) for _ in range(count)]

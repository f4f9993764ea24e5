"""Where data sets are read from: a data root given on the command line, by ``BAM_DATA``, the
project's ``../shared/data`` when present, else a user cache the standard loaders download into."""

from __future__ import annotations

import gzip
import os
from pathlib import Path
from typing import Iterable, Iterator, Optional

ENV_VAR = "BAM_DATA"
_SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"  # beside the checkout


def default_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "bam-pyro"


def resolve_data_root(data_root: Optional[os.PathLike] = None) -> tuple[Path, bool]:
    """Returns (root, given): ``given`` is False only for the download cache, where loaders may
    fetch what is missing; under a given root, missing files are an error."""
    if data_root is not None:
        return Path(data_root).expanduser().resolve(), True
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR]).expanduser().resolve(), True
    if _SHARED.is_dir():
        return _SHARED, True
    return default_cache(), False


def require_files(directory: Path, names: list[str], what: str) -> None:
    """Raise FileNotFoundError naming every missing file and the folder it was looked for in."""
    missing = [n for n in names if not (directory / n).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{what}: missing {', '.join(missing)} in {directory} "
            f"(set the data root with --data-root or ${ENV_VAR})"
        )


def utf8_lines(path: Path, lines: Iterable[bytes]) -> Iterator[str]:
    """``lines`` (of the file ``path``) decoded; ``ValueError`` naming the file and the line that is
    not UTF-8."""
    for number, line in enumerate(lines, start=1):
        try:
            yield line.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"{path}, line {number}: not UTF-8 ({error.reason} at byte {error.start})") from None


def gzip_lines(path: Path) -> list[str]:
    """The lines of a gzip file of UTF-8 text, newlines stripped; ``ValueError`` naming the file and
    the line that could not be read (not UTF-8, or the file cut short or not gzip there)."""
    lines: list[str] = []
    try:
        with gzip.open(path, "rb") as handle:
            lines.extend(line.rstrip("\n") for line in utf8_lines(path, handle))
    except (OSError, EOFError) as error:  # BadGzipFile is an OSError; a file cut short ends in EOFError
        raise ValueError(f"{path}, line {len(lines) + 1}: not a whole gzip file ({error})") from None
    return lines

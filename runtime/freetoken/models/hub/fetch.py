"""Fetch one file of a repository into the Hugging Face cache, and check what arrived.

huggingface_hub downloads it (its cache layout, HF_ENDPOINT, HF_TOKEN; a dropped connection
resumes from the bytes already received with a range request). A file fetched now is then
checked against the listing: its size, and its sha256 (LFS files) or git blob id (others);
a file that fails is removed from the cache so that the next run fetches it again.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from freetoken.models.errors import ModelDownloadError
from freetoken.models.hub.files import RepoFile

_CHUNK = 8 << 20


def cached_path(repo_id: str, file: RepoFile, commit: str) -> Path | None:
    """The file's path in the cache when it is there already (no network)."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, file.path, revision=commit)
    return Path(found) if isinstance(found, str) else None


def _progress_class(name: str):
    """huggingface_hub's progress bar on stderr, labelled with the file's name, also when
    stderr is not a terminal (a log then gets the bar's line every 10 s);
    HF_HUB_DISABLE_PROGRESS_BARS=1 still hides it."""
    from huggingface_hub.utils import are_progress_bars_disabled, tqdm

    class DownloadProgress(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = are_progress_bars_disabled()
            kwargs["file"] = sys.stderr
            kwargs["desc"] = name
            if not sys.stderr.isatty():
                kwargs.setdefault("mininterval", 10.0)
            super().__init__(*args, **kwargs)

    return DownloadProgress


def download(repo_id: str, file: RepoFile, commit: str) -> Path:
    """Download `file` at `commit` (huggingface_hub's errors propagate) and check it."""
    from huggingface_hub import hf_hub_download

    local = Path(hf_hub_download(repo_id, file.path, revision=commit,
                                 tqdm_class=_progress_class(file.path)))
    problem = _integrity_problem(local, file)
    if problem is not None:
        _evict(local)
        raise ModelDownloadError(
            f"{repo_id}/{file.path}: {problem}; the file was removed from the cache, run the "
            f"command again (if HF_ENDPOINT names a mirror, it may serve another file)")
    return local


def _integrity_problem(local: Path, file: RepoFile) -> str | None:
    size = local.stat().st_size
    if file.size is not None and size != file.size:
        return f"{size} bytes arrived but the repository lists {file.size}"
    if file.sha256:
        digest = _digest(local, hashlib.sha256())
        if digest != file.sha256.lower():
            return f"its sha256 is {digest} but the repository lists {file.sha256}"
    elif file.blob_id:
        # git's blob id: sha1 over a "blob <size>\0" header and the content
        digest = _digest(local, hashlib.sha1(f"blob {size}\0".encode()))
        if digest != file.blob_id.lower():
            return f"its git blob id is {digest} but the repository lists {file.blob_id}"
    return None


def _digest(path: Path, state) -> str:
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            state.update(chunk)
    return state.hexdigest()


def _evict(local: Path) -> None:
    """Remove a cached file: the blob the snapshot's link points to, then the link."""
    blob = Path(os.path.realpath(local))
    for path in (blob, local):
        try:
            path.unlink()
        except FileNotFoundError:
            pass

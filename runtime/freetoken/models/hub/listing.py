"""A repository's files at its current commit, with sizes and hashes (one Hub API call), or
the files of its snapshot in the local cache when the Hub is not to be (or cannot be) asked."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from freetoken.models.hub.files import RepoFile

# Seconds to wait for the listing: a dead network fails in this time, not never.
LISTING_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class RepoListing:
    """The files of `repo_id` at `commit`; `snapshot` is the cache folder they are (or will
    be) in, known up front only for a listing read from the cache."""

    repo_id: str
    commit: str
    files: tuple[RepoFile, ...]
    snapshot: Path | None = None

    @property
    def paths(self) -> list[str]:
        return [f.path for f in self.files]

    def file(self, path: str) -> RepoFile:
        return next(f for f in self.files if f.path == path)


def list_remote(repo_id: str) -> RepoListing:
    """The Hub's listing (model_info with files metadata); raises huggingface_hub's errors."""
    from huggingface_hub import HfApi

    # A fresh HfApi reads HF_ENDPOINT as huggingface_hub holds it now (the module-level one
    # keeps the endpoint it had when imported).
    info = HfApi().model_info(repo_id, files_metadata=True, timeout=LISTING_TIMEOUT_S)
    files = tuple(sorted(
        (RepoFile(s.rfilename, s.size, s.lfs.sha256 if s.lfs else None,
                  None if s.lfs else s.blob_id) for s in info.siblings or ()),
        key=lambda f: f.path))
    return RepoListing(repo_id, info.sha, files)


def _storage_folder(repo_id: str) -> Path:
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    return Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model")


def list_cached(repo_id: str) -> RepoListing | None:
    """The files of the snapshot `refs/main` points to in the Hugging Face cache (HF_HOME,
    HF_HUB_CACHE), or None when the repository was never fetched."""
    folder = _storage_folder(repo_id)
    ref = folder / "refs" / "main"
    if not ref.is_file():
        return None
    commit = ref.read_text().strip()
    snapshot = folder / "snapshots" / commit
    if not snapshot.is_dir():
        return None
    # is_file() follows the cache's symlinks: a link whose blob is gone is no file
    files = tuple(RepoFile(p.relative_to(snapshot).as_posix())
                  for p in sorted(snapshot.rglob("*")) if p.is_file())
    return RepoListing(repo_id, commit, files, snapshot)


def remember_commit(repo_id: str, commit: str) -> None:
    """Point `refs/main` at `commit` once its files are fetched, as huggingface_hub does for
    downloads by branch name: the offline look-up (list_cached) finds the snapshot by it."""
    ref = _storage_folder(repo_id) / "refs" / "main"
    ref.parent.mkdir(parents=True, exist_ok=True)
    if not ref.is_file() or ref.read_text().strip() != commit:
        ref.write_text(commit)

"""ORG/NAME[:QUANT] -> the local path of its model in the Hugging Face cache.

List the repository (one API call), pick the files the loader needs (files.py for safetensors,
gguf_pick.py for GGUF), check the architecture before anything large (architecture.py), and
fetch what the cache lacks (fetch.py). With HF_HUB_OFFLINE=1, or when the Hub cannot be
reached, the same pick is made among the files of the cached snapshot.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from freetoken.models.errors import ModelDownloadError, ModelError, ModelOptionError
from freetoken.models.hub import files as repo_files
from freetoken.models.hub.errors import hub_error, is_unreachable
from freetoken.models.hub.gguf_pick import is_model_gguf, pick_gguf
from freetoken.models.hub.listing import RepoListing, list_cached, list_remote, remember_commit
from freetoken.models.hub.reference import HubReference

Say = Callable[[str], None]


def pull(ref: HubReference, say: Say) -> Path:
    """The local path (a GGUF file, its first part when split, or a snapshot folder) of the
    model `ref` names, fetched into the Hugging Face cache as needed; progress through `say`
    and huggingface_hub's bars on stderr. Raises ModelError subclasses with one-line messages.
    """
    from huggingface_hub import is_offline_mode

    if is_offline_mode():
        return _from_cache(ref, say, "HF_HUB_OFFLINE=1 forbids downloading", None)
    try:
        listing = list_remote(ref.repo_id)
    except Exception as exc:   # noqa: BLE001 - sorted below; anything else re-raised
        error = hub_error(ref.label, ref.repo_id, exc)
        if error is None:
            raise
        if is_unreachable(exc):
            return _from_cache(ref, say, "the Hub cannot be reached", error)
        raise error from None
    return _Fetcher(ref, listing, say).run()


def is_gguf_choice(ref: HubReference, paths: list[str]) -> bool:
    """GGUF when a quantization is named or the repository has a model GGUF (llama.cpp's -hf
    reading of a name); else its safetensors. Neither: an error naming what it holds."""
    if ref.quant is not None:
        if not any(is_model_gguf(p) for p in paths):
            raise ModelOptionError(f"{ref.label}: the repository has no GGUF files, so "
                                   f":{ref.quant} picks nothing; drop :{ref.quant} to use its "
                                   f"safetensors")
        return True
    if any(is_model_gguf(p) for p in paths):
        return True
    if repo_files.is_safetensors_repo(paths):
        return False
    raise ModelOptionError(
        f"{ref.label}: the repository has neither safetensors weights with a config.json nor "
        f"GGUF files ({repo_files.describe_weights(paths)}); FreeToken reads those two formats")


def _from_cache(ref: HubReference, say: Say, reason: str, error: ModelError | None) -> Path:
    listing = list_cached(ref.repo_id)
    if listing is None:
        if error is not None:
            raise error
        raise ModelDownloadError(
            f"{ref.label}: not in the Hugging Face cache and {reason}; run `ft pull "
            f"{ref.label}` with network access first, or unset HF_HUB_OFFLINE")
    try:
        path = _cached_entry(ref, listing)
    except ModelError as exc:
        raise ModelDownloadError(f"{ref.label}: the cached copy is not usable ({exc}) and "
                                 f"{reason}; run `ft pull {ref.label}` with network "
                                 f"access") from None
    say(f"{ref.label}: {reason}; using the cached snapshot {listing.commit[:12]}: {path}")
    return path


def _cached_entry(ref: HubReference, listing: RepoListing) -> Path:
    from freetoken.models.checkpoint.json_file import read_json

    snapshot, paths = listing.snapshot, listing.paths
    if is_gguf_choice(ref, paths):
        return snapshot / pick_gguf(paths, ref.quant, ref.repo_id)[0]
    repo_files.safetensors_metadata_files(paths, ref.repo_id)   # the tokenizer is there
    index = snapshot / repo_files.SAFETENSORS_INDEX
    repo_files.safetensors_weight_files(paths, read_json(index) if index.is_file() else None,
                                        ref.repo_id)
    return snapshot


class _Fetcher:
    """One pull from the Hub: the chosen files, fetched in order, counted for the summary."""

    def __init__(self, ref: HubReference, listing: RepoListing, say: Say):
        self.ref, self.listing, self.say = ref, listing, say
        self.fetched_files, self.fetched_bytes = 0, 0
        self.start = time.perf_counter()

    def run(self) -> Path:
        paths = self.listing.paths
        entry = (self._gguf(paths) if is_gguf_choice(self.ref, paths)
                 else self._safetensors(paths))
        remember_commit(self.ref.repo_id, self.listing.commit)
        if self.fetched_files:
            self.say(f"{self.ref.label}: fetched {self.fetched_files} file(s), "
                     f"{_size(self.fetched_bytes)} in {time.perf_counter() - self.start:.1f} s "
                     f"(sizes and hashes checked): {entry}")
        else:
            self.say(f"{self.ref.label}: in the Hugging Face cache: {entry}")
        return entry

    def _gguf(self, paths: list[str]) -> Path:
        from freetoken.models.hub.architecture import check_gguf_header, read_remote_header
        from freetoken.models.hub.fetch import cached_path

        names = pick_gguf(paths, self.ref.quant, self.ref.repo_id)
        first = self.listing.file(names[0])
        if cached_path(self.ref.repo_id, first, self.listing.commit) is None:
            header = self._remote(read_remote_header, self.ref.repo_id, first.path,
                                  self.listing.commit)
            check_gguf_header(header, f"{self.ref.repo_id}/{first.path}")
        return self._fetch(names)[0]

    def _safetensors(self, paths: list[str]) -> Path:
        from freetoken.models.checkpoint.json_file import read_json
        from freetoken.models.hub.architecture import check_hf_config

        small = repo_files.safetensors_metadata_files(paths, self.ref.repo_id)
        config = self._fetch(small[:1])[0]
        check_hf_config(config, f"{self.ref.repo_id}/config.json")
        fetched = self._fetch(small[1:])
        index = (read_json(fetched[-1]) if small[-1] == repo_files.SAFETENSORS_INDEX
                 else None)
        self._fetch(repo_files.safetensors_weight_files(paths, index, self.ref.repo_id))
        return config.parent

    def _fetch(self, names: list[str]) -> list[Path]:
        from freetoken.models.hub.fetch import cached_path, download

        local = []
        for name in names:
            file = self.listing.file(name)
            found = cached_path(self.ref.repo_id, file, self.listing.commit)
            if found is None:
                size = "" if file.size is None else f" ({_size(file.size)})"
                self.say(f"fetching {self.ref.repo_id}/{name}{size}")
                found = self._remote(download, self.ref.repo_id, file, self.listing.commit)
                self.fetched_files += 1
                self.fetched_bytes += found.stat().st_size
            local.append(found)
        return local

    def _remote(self, call, *args):
        """`call(*args)` with huggingface_hub's failures turned into one-line errors."""
        try:
            return call(*args)
        except ModelError:
            raise
        except Exception as exc:   # noqa: BLE001 - sorted below; anything else re-raised
            error = hub_error(self.ref.label, self.ref.repo_id, exc)
            if error is not None:
                raise error from None
            if isinstance(exc, OSError):     # huggingface_hub's size check after retries
                raise ModelDownloadError(
                    f"{self.ref.label}: the download failed ({' '.join(str(exc).split())}); "
                    f"run the command again (files already complete stay in the "
                    f"cache)") from None
            raise


def _size(count: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} B"

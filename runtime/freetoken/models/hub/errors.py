"""huggingface_hub's exceptions as one-line ModelDownloadErrors that name the fix."""

from __future__ import annotations

from freetoken.models.errors import ModelDownloadError


def endpoint() -> str:
    """The Hub (or mirror, HF_ENDPOINT) huggingface_hub talks to."""
    from huggingface_hub import constants

    return constants.ENDPOINT


def is_unreachable(exc: BaseException) -> bool:
    """A transport failure (no route, refused, DNS, timeout) rather than an HTTP answer;
    huggingface_hub reports some as LocalEntryNotFoundError caused by one."""
    import httpx2
    from huggingface_hub.errors import LocalEntryNotFoundError

    if isinstance(exc, LocalEntryNotFoundError) and exc.__cause__ is not None:
        exc = exc.__cause__
    return isinstance(exc, (httpx2.TransportError, ConnectionError, TimeoutError))


def unreachable(label: str, exc: BaseException) -> ModelDownloadError:
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    reason = " ".join(str(cause).split()) or type(cause).__name__
    return ModelDownloadError(
        f"{label}: cannot reach {endpoint()} ({reason}) and the model is not in the Hugging "
        f"Face cache; check the network, set HF_ENDPOINT to a mirror, or pass a local path")


def _has_token() -> bool:
    from huggingface_hub import get_token

    return get_token() is not None


def hub_error(label: str, repo_id: str, exc: Exception) -> ModelDownloadError | None:
    """The one-line error for `exc` raised while listing or fetching `repo_id`, or None when
    it is not one huggingface_hub raises for a remote problem."""
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, RemoteEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    page = f"{endpoint()}/{repo_id}"
    if isinstance(exc, GatedRepoError):
        if _has_token():
            return ModelDownloadError(
                f"{label}: a gated repository, and the token in use (HF_TOKEN or `hf auth "
                f"login`) has no access; accept its conditions at {page} with that account")
        return ModelDownloadError(
            f"{label}: a gated repository; accept its conditions at {page}, then set HF_TOKEN "
            f"to an access token of that account (or run `hf auth login`)")
    if isinstance(exc, RepositoryNotFoundError):
        private = "" if _has_token() else "; a private one needs HF_TOKEN"
        return ModelDownloadError(
            f"{label}: no such local path, and no model repository {repo_id} on {endpoint()}; "
            f"check the spelling{private}")
    if isinstance(exc, RevisionNotFoundError):
        return ModelDownloadError(f"{label}: {endpoint()} has no revision 'main' of {repo_id}")
    if isinstance(exc, RemoteEntryNotFoundError):
        return ModelDownloadError(f"{label}: a file the listing of {repo_id} names is missing "
                                  f"on {endpoint()} ({' '.join(str(exc).split())})")
    if isinstance(exc, HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else "an error"
        return ModelDownloadError(f"{label}: {endpoint()} answered HTTP {status} for "
                                  f"{repo_id}; try again later, or set HF_ENDPOINT to a mirror")
    if is_unreachable(exc):
        return unreachable(label, exc)
    return None

"""Fetching a remote image (only with `ft serve --allow-image-urls`): http(s) only, redirects
included, within a total time limit and a byte limit."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

from freetoken.vision.decode import ImageError, ImageTooLarge

FETCH_TIMEOUT_S = 10.0
CHUNK = 1 << 16


class ImageFetchError(ImageError):
    """The URL could not be fetched (refused, HTTP error, timeout, not http(s))."""


class _HTTPOnlyRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if not newurl.lower().startswith(("http://", "https://")):
            raise ImageFetchError(f"the server redirected to a non-http(s) URL ({newurl[:64]})")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def fetch_image(url: str, max_bytes: int,
                timeout_s: float = FETCH_TIMEOUT_S) -> tuple[bytes, str | None]:
    """(body, media type the server declared if it is an image/* type). Raises ImageFetchError
    or ImageTooLarge."""
    from freetoken import __version__

    # NOTE: the URL is http(s) (checked by the adapter) and so is every redirect, so the
    # opener's file:, ftp: and data: handlers are never reached.
    opener = urllib.request.build_opener(_HTTPOnlyRedirects())
    request = urllib.request.Request(url, headers={
        "User-Agent": f"freetoken/{__version__}",
        "Accept": "image/png, image/jpeg, image/webp"})
    deadline = time.monotonic() + timeout_s
    try:
        with opener.open(request, timeout=timeout_s) as response:
            declared = response.headers.get("Content-Length")
            if declared is not None and declared.isdigit() and int(declared) > max_bytes:
                raise ImageTooLarge(f"the image at the URL is {declared} bytes; the limit is "
                                    f"{max_bytes}")
            body = read_limited(response, max_bytes, deadline, timeout_s)
            content_type = response.headers.get_content_type()
    except ImageError:
        raise
    except urllib.error.HTTPError as exc:
        raise ImageFetchError(f"fetching the image failed: HTTP {exc.code} {exc.reason}") \
            from None
    except urllib.error.URLError as exc:
        raise ImageFetchError(f"fetching the image failed: {exc.reason}") from None
    except (OSError, ValueError) as exc:   # timeouts, resets, malformed URLs or replies
        raise ImageFetchError(f"fetching the image failed: {exc}") from None
    return body, content_type if content_type.startswith("image/") else None


def read_limited(response, max_bytes: int, deadline: float, timeout_s: float) -> bytes:
    """The body, refusing more than max_bytes and a transfer past the deadline (the socket
    timeout bounds each read only, so a slow trickle would otherwise never end)."""
    chunks, size = [], 0
    while True:
        if time.monotonic() > deadline:
            raise ImageFetchError(f"fetching the image took longer than {timeout_s:g} s")
        chunk = response.read1(CHUNK)   # what has arrived, so the deadline is checked often
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > max_bytes:
            raise ImageTooLarge(f"the image at the URL is over the {max_bytes}-byte limit")
        chunks.append(chunk)

"""Untrusted image bytes -> a decoded RGB Pillow image, refusing anything but PNG, JPEG and WebP
and anything whose pixel count is over a limit before its pixel data is decoded."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from PIL import Image

# The formats a request may carry, by the media type clients declare ("image/jpg" is common).
MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG",
               "image/webp": "WEBP"}
SUPPORTED = "PNG, JPEG or WebP"

# Decoded size limit (width * height), checked from the header before any pixel is decoded:
# 8192 x 8192, 4x the 4096 x 4096 that Qwen3.5/3.6's max_pixels resizes to; an RGBA image of
# that size already takes 256 MiB while it is converted.
MAX_DECODED_PIXELS = 8192 * 8192
# Encoded size limit per image (OpenAI's own limit for an image input is 20 MB).
MAX_IMAGE_BYTES = 20 * 1024 * 1024


class ImageError(ValueError):
    """An image a request may not use; the message says what is wrong with it."""


class UnsupportedImage(ImageError):
    """Not PNG, JPEG or WebP (declared or actual)."""


class CorruptImage(ImageError):
    """The bytes do not decode: not an image, truncated, or damaged."""


class ImageTooLarge(ImageError):
    """Over the encoded-size or decoded-pixel limit, or too elongated to resize."""


def sniff_format(data: bytes) -> str | None:
    """The Pillow format name of the bytes by their signature, or None if not one we accept."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return None


def describe_signature(data: bytes) -> str:
    """What the bytes look like when they are not an accepted format (for the error)."""
    for magic, name in ((b"GIF87a", "GIF"), (b"GIF89a", "GIF"), (b"BM", "BMP"),
                        (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF")):
        if data.startswith(magic):
            return f"a {name} image"
    if data[4:12] in (b"ftypavif", b"ftypheic", b"ftypheix", b"ftypmif1"):
        return "an AVIF/HEIF image"
    return "not a PNG, JPEG or WebP image (unrecognised signature)"


def check_media_type(media_type: str) -> str:
    """The format a declared media type names; UnsupportedImage unless PNG, JPEG or WebP."""
    declared = media_type.split(";")[0].strip().lower()
    if declared not in MEDIA_TYPES:
        raise UnsupportedImage(f"media type {media_type!r} is not supported: send {SUPPORTED} "
                               "(image/png, image/jpeg, image/webp)")
    return MEDIA_TYPES[declared]


def check_format(data: bytes, media_type: str | None) -> str:
    """The format to decode with. The bytes decide; a declared media type must be one we accept
    too, and when it names another accepted format than the bytes have (a client that calls
    every image image/png) the bytes win."""
    actual = sniff_format(data)
    if media_type is not None:
        check_media_type(media_type)
    if actual is None:
        if not data:
            raise CorruptImage("the image is empty (0 bytes)")
        raise UnsupportedImage(f"the data is {describe_signature(data)}: send {SUPPORTED}")
    return actual


def open_image(data: bytes, media_type: str | None = None,
               max_decoded_pixels: int = MAX_DECODED_PIXELS) -> Image.Image:
    """The decoded image (its first frame), upright per its EXIF orientation as HF's load_image
    makes it, in its own mode (conversion to RGB is the processor's step).

    Raises UnsupportedImage, CorruptImage or ImageTooLarge."""
    from PIL import Image, ImageOps

    if len(data) > MAX_IMAGE_BYTES:
        raise ImageTooLarge(f"the image is {len(data)} bytes; the limit is {MAX_IMAGE_BYTES}")
    kind = check_format(data, media_type)
    try:
        image = Image.open(io.BytesIO(data), formats=[kind])
    except Image.DecompressionBombError as exc:
        raise ImageTooLarge(f"the image is too large to decode: {exc}") from None
    except Exception as exc:   # noqa: BLE001 - any failure to parse untrusted bytes is theirs
        raise CorruptImage(f"the {kind} data does not decode: {exc}") from None
    width, height = image.size
    if width * height > max_decoded_pixels:
        raise ImageTooLarge(f"the image is {width}x{height} = {width * height} pixels; the "
                            f"limit is {max_decoded_pixels} pixels before resizing")
    if width == 0 or height == 0:
        raise CorruptImage(f"the image has no pixels ({width}x{height})")
    try:
        image.load()
        return ImageOps.exif_transpose(image)
    except Image.DecompressionBombError as exc:
        raise ImageTooLarge(f"the image is too large to decode: {exc}") from None
    except Exception as exc:   # noqa: BLE001 - truncated or damaged pixel data
        raise CorruptImage(f"the {kind} data is truncated or damaged: {exc}") from None

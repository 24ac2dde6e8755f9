"""Decoding untrusted bytes: only PNG, JPEG and WebP, by their signature; corrupt and truncated
data and pixel bombs are named errors, raised before any pixel data is decoded where possible."""

from __future__ import annotations

import struct
import time
import zlib

import pytest

from freetoken.vision.decode import (MAX_IMAGE_BYTES, CorruptImage, ImageTooLarge,
                                     UnsupportedImage, check_format, open_image)
from tests.vision.images import encode, random_image


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height RGB pixels, with one tiny IDAT chunk."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return (struct.pack(">I", len(body)) + kind + body
                + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
            + chunk(b"IEND", b""))


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_each_format_decodes_to_its_pixels(fmt):
    source = random_image(64, 48, "RGB", seed=1)
    image = open_image(encode(source, fmt, **({"lossless": True} if fmt == "WEBP" else {})))
    assert image.size == (64, 48)
    if fmt != "JPEG":   # lossless encodings give the pixels back
        assert image.convert("RGB").tobytes() == source.tobytes()


def test_declared_type_of_another_supported_format_is_accepted_and_bytes_win():
    """Clients that label every image image/png: the bytes are JPEG, both are supported."""
    data = encode(random_image(40, 30, "RGB"), "JPEG")
    assert check_format(data, "image/png") == check_format(data, "image/jpg") == "JPEG"
    assert check_format(data, None) == "JPEG"
    assert open_image(data, "image/png").tobytes() == open_image(data, "image/jpeg").tobytes()


@pytest.mark.parametrize("declared", ["image/gif", "image/bmp", "text/plain", "image/svg+xml"])
def test_unsupported_declared_type_is_refused_even_for_good_bytes(declared):
    with pytest.raises(UnsupportedImage, match="not supported"):
        open_image(encode(random_image(8, 8, "RGB"), "PNG"), declared)


@pytest.mark.parametrize("fmt,named", [("GIF", "GIF"), ("BMP", "BMP"), ("TIFF", "TIFF")])
def test_unsupported_actual_format_is_refused_by_name(fmt, named):
    data = encode(random_image(8, 8, "RGB"), fmt)
    with pytest.raises(UnsupportedImage, match=named):
        open_image(data, "image/png")


def test_not_an_image_and_empty():
    with pytest.raises(UnsupportedImage, match="unrecognised"):
        open_image(b"hello, this is text and not an image")
    with pytest.raises(CorruptImage, match="empty"):
        open_image(b"")


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_truncated_data_is_corrupt(fmt):
    data = encode(random_image(200, 150, "RGB", seed=2), fmt)
    with pytest.raises(CorruptImage):
        open_image(data[: len(data) // 2])


def test_damaged_png_is_corrupt():
    data = bytearray(encode(random_image(64, 64, "RGB"), "PNG"))
    data[60:80] = bytes(20)   # inside the first IDAT chunk: its CRC no longer matches
    with pytest.raises(CorruptImage):
        open_image(bytes(data))
    with pytest.raises(CorruptImage):
        open_image(png_header_only(64, 64)[:20])   # cut inside the header


def test_pixel_bomb_refused_from_the_header_before_decoding():
    bomb = png_header_only(50_000, 50_000)   # 2.5 G pixels claimed in 100 bytes
    start = time.perf_counter()
    with pytest.raises(ImageTooLarge, match="2500000000 pixels"):
        open_image(bomb)
    assert time.perf_counter() - start < 1.0
    with pytest.raises(ImageTooLarge, match="limit is 1000 pixels"):
        open_image(encode(random_image(40, 30, "RGB"), "PNG"), max_decoded_pixels=1000)


def test_pillows_own_bomb_check_is_a_named_error_too():
    """With our limit raised past Pillow's (2 x 89.5 M pixels), Pillow's refusal is mapped."""
    with pytest.raises(ImageTooLarge, match="too large"):
        open_image(png_header_only(20_000, 20_000), max_decoded_pixels=10 ** 12)


def test_encoded_size_limit():
    data = b"\x89PNG\r\n\x1a\n" + bytes(MAX_IMAGE_BYTES)
    with pytest.raises(ImageTooLarge, match="bytes"):
        open_image(data)


def test_exif_orientation_is_applied():
    """A JPEG stored landscape with orientation 6 (rotate 90 degrees to view) decodes upright,
    as transformers' load_image returns it."""
    from PIL import Image

    source = random_image(64, 32, "RGB")
    exif = Image.Exif()
    exif[0x0112] = 6
    image = open_image(encode(source, "JPEG", exif=exif))
    assert image.size == (32, 64)

"""Image parts of request bodies: OpenAI's `image_url` content part and Anthropic's `image`
block. Only their shape is checked here; what the URL or data holds is checked when the image
is loaded (server/images.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class Strict(BaseModel):
    # NOTE: protocol.py's Strict, restated: protocol.py imports these parts.
    model_config = ConfigDict(extra="forbid", strict=True)


class ImageURL(Strict):
    url: str = Field(description="data:image/png;base64,... (PNG, JPEG or WebP), or an "
                                 "http(s) URL when the server runs with --allow-image-urls")
    detail: Literal["auto", "low", "high"] | None = Field(
        None, description="low: at most 512x512 pixels after resizing; auto/high: up to "
                          "--max-image-pixels")


class ImageURLPart(Strict):
    type: Literal["image_url"]
    image_url: ImageURL


class AnthropicImageSource(Strict):
    """base64: media_type and data; url: url (needs --allow-image-urls)."""

    type: Literal["base64", "url"]
    media_type: str | None = Field(None, description="image/png, image/jpeg or image/webp")
    data: str | None = None
    url: str | None = None


class AnthropicImage(Strict):
    type: Literal["image"]
    source: AnthropicImageSource
    cache_control: dict | None = None   # accepted and ignored, as on text blocks

"""The images of a chat request on their way to the engine: checked against the served model
and the server's flags, base64-decoded or fetched, decoded and resized off the event loop, and
each image's placeholder token in the prompt expanded to the tokens it occupies."""

from __future__ import annotations

import asyncio
import base64
import binascii
from typing import TYPE_CHECKING

from freetoken.server.context import agent_errors
from freetoken.server.errors import APIError
from freetoken.vision.decode import MAX_IMAGE_BYTES, ImageError, ImageTooLarge

if TYPE_CHECKING:
    from freetoken.agent.request import AgentRequest, ImageRef
    from freetoken.server.agent import PreparedChat
    from freetoken.server.context import ServerContext
    from freetoken.vision.inputs import ImageInput, VisionPreprocess

# base64 of MAX_IMAGE_BYTES, plus room for MIME line breaks (CRLF every 76 characters).
MAX_BASE64_CHARS = (MAX_IMAGE_BYTES + 2) // 3 * 4 * 78 // 76 + 4


class BadImageData(ImageError):
    """The base64 text does not decode."""


def check_image_refs(ctx: ServerContext, refs: tuple[ImageRef, ...]
                     ) -> VisionPreprocess | None:
    """The served model's vision settings (None: text-only). The checks that need no
    decoding: images on a text-only model, URLs the server may not fetch."""
    vision = getattr(ctx.engine, "vision", None)
    if refs and vision is None:
        raise APIError(400, f"{refs[0].where}: the model {ctx.model_name!r} is text-only and "
                            "takes no images; send text only", refs[0].where)
    for ref in refs:
        if ref.url is not None and not ctx.allow_image_urls:
            raise APIError(400, f"{ref.where}: this server does not fetch image URLs; send the "
                                "image inline (data:image/png;base64,...) or start it with "
                                "--allow-image-urls", ref.where)
    return vision


async def load_images(ctx: ServerContext, refs: tuple[ImageRef, ...],
                      vision: VisionPreprocess) -> tuple[ImageInput, ...]:
    """Every image preprocessed, each on a worker thread; the first bad one is a 400 naming
    its field."""
    limit = ctx.max_image_pixels or vision.max_pixels
    results = await asyncio.gather(
        *(asyncio.to_thread(load_image, ref, vision, limit) for ref in refs),
        return_exceptions=True)
    for ref, result in zip(refs, results):
        if isinstance(result, ImageError):
            raise APIError(400, f"{ref.where}: {result}", ref.where)
        if isinstance(result, BaseException):
            raise result
    return tuple(results)


def load_image(ref: ImageRef, vision: VisionPreprocess, max_pixels: int) -> ImageInput:
    """One image's bytes (inline or fetched) as the vision tower's input."""
    from freetoken.server.image_fetch import fetch_image
    from freetoken.vision.preprocess import preprocess_bytes

    if ref.url is not None:
        data, media_type = fetch_image(ref.url, MAX_IMAGE_BYTES)
    else:
        data, media_type = decode_base64(ref.data or ""), ref.media_type
    if ref.max_pixels is not None:
        max_pixels = max(vision.min_pixels, min(max_pixels, ref.max_pixels))
    return preprocess_bytes(data, vision, media_type, max_pixels)


def decode_base64(text: str) -> bytes:
    """Standard base64 (line breaks allowed), refusing more than MAX_IMAGE_BYTES."""
    if len(text) > MAX_BASE64_CHARS:
        raise ImageTooLarge(f"the image data is {len(text)} base64 characters; the limit is "
                            f"{MAX_IMAGE_BYTES} bytes ({MAX_BASE64_CHARS} characters)")
    compact = "".join(text.split())
    try:
        return base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise BadImageData(f"the image data is not valid base64: {exc}") from None


def expand_image_tokens(ids: list[int], images: tuple[ImageInput, ...],
                        vision: VisionPreprocess) -> list[int]:
    """ids with each image's one placeholder token repeated image.num_tokens times (between
    its vision start and end tokens, where the chat template put them)."""
    pad = vision.image_token_id
    found = [i for i, token in enumerate(ids) if token == pad]
    if len(found) > len(images):
        raise APIError(400, f"the messages' text contains the image placeholder "
                            f"{vision.image_token!r}; remove it (images go in image parts)",
                       "messages")
    framed = all(0 < i < len(ids) - 1 and ids[i - 1] == vision.vision_start_token_id
                 and ids[i + 1] == vision.vision_end_token_id for i in found)
    if len(found) < len(images) or not framed:
        raise APIError(400, f"the model's chat template placed {len(found)} of "
                            f"{len(images)} images as <vision start>{vision.image_token}"
                            "<vision end>; this model cannot take images in these messages",
                       "messages")
    out: list[int] = []
    start = 0
    for i, image in zip(found, images):
        out += ids[start:i]
        out += [pad] * image.num_tokens(vision.merge_size)
        start = i + 1
    return out + ids[start:]


async def prepare_chat(ctx: ServerContext, request: AgentRequest,
                       max_tokens: int | None) -> tuple[PreparedChat, tuple[ImageInput, ...]]:
    """The request's prompt (image tokens expanded), parser and guide, and its images."""
    vision = check_image_refs(ctx, request.images)
    with agent_errors():
        prepared = ctx.agent.prepare(request, max_tokens)
    images = await load_images(ctx, request.images, vision) if request.images else ()
    if vision is not None:
        prepared.prompt_ids = expand_image_tokens(prepared.prompt_ids, images, vision)
    return prepared, images


async def count_prompt_tokens(ctx: ServerContext, request: AgentRequest) -> int:
    """Prompt tokens of a request, each image counted as the tokens it occupies."""
    vision = check_image_refs(ctx, request.images)
    with agent_errors():
        _, ids = ctx.agent.render(request)
    if vision is None:
        return len(ids)
    images = await load_images(ctx, request.images, vision) if request.images else ()
    return len(expand_image_tokens(ids, images, vision))


def refuse_placeholders(ctx: ServerContext, ids: list[int], param: str) -> None:
    """A prompt that comes without images (a raw /v1/completions prompt) holding the image
    placeholder is a 400: the engine would have no image for it."""
    vision = getattr(ctx.engine, "vision", None)
    if vision is not None and vision.image_token_id in ids:
        raise APIError(400, f"{param} holds the image placeholder {vision.image_token!r} "
                            f"(token {vision.image_token_id}), but /v1/completions takes no "
                            "images; send images as image parts to /v1/chat/completions or "
                            "/v1/messages", param)


def image_flags_problem(vision: VisionPreprocess | None, config, model_name: str) -> str | None:
    """What is wrong with `ft serve`'s image flags for the loaded model, or None."""
    given = [flag for flag, on in (("--allow-image-urls", config.allow_image_urls),
                                   ("--max-image-pixels", config.max_image_pixels is not None))
             if on]
    if vision is None:
        return (f"{' and '.join(given)}: the model {model_name!r} is text-only and takes no "
                "images") if given else None
    limit = config.max_image_pixels
    if limit is not None and limit < vision.min_pixels:
        return (f"--max-image-pixels {limit} is below the model's min_pixels "
                f"({vision.min_pixels}), the area every image is scaled up to at least")
    return None

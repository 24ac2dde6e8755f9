"""Image parts of chat messages as the adapters pass them on: the message content becomes the
list of text and image items HF chat templates take, and each image an ImageRef (checked for
shape here; fetched, decoded and resized later, off the event loop)."""

from __future__ import annotations

from freetoken.agent.request import AgentRequestError, ImageRef
from freetoken.vision.decode import ImageError, check_media_type

# OpenAI's detail "low" means a 512 x 512 image; here: at most that many pixels after resizing.
LOW_DETAIL_PIXELS = 512 * 512
IMAGE_PART_TYPES = ("image_url", "image")


def has_images(parts) -> bool:
    return isinstance(parts, list) and any(p.type in IMAGE_PART_TYPES for p in parts)


def openai_content(parts, role: str, where: str, images: list[ImageRef]) -> str | list[dict]:
    """An OpenAI message's content for the template: its text (parts joined by newlines) when
    it has no image, else its parts in order as text and image items; images collects the
    refs."""
    if not has_images(parts):
        if parts is None or isinstance(parts, str):
            return parts or ""
        return "\n".join(p.text for p in parts)
    check_role(role, where)
    items: list[dict] = []
    for j, part in enumerate(parts):
        if part.type == "text":
            items.append({"type": "text", "text": part.text})
        else:
            images.append(openai_image_ref(part, f"{where}.{j}"))
            items.append({"type": "image"})
    return items


def check_role(role: str, where: str) -> None:
    if role != "user":
        raise AgentRequestError(f"{where}: images are accepted in user messages only, not in "
                                f"a {role} message", where)


def openai_image_ref(part, where: str) -> ImageRef:
    at = f"{where}.image_url.url"
    url = part.image_url.url
    cap = LOW_DETAIL_PIXELS if part.image_url.detail == "low" else None
    if url[:5].lower() == "data:":
        media_type, data = parse_data_url(url, at)
        return ImageRef(at, data=data, media_type=media_type, max_pixels=cap)
    return ImageRef(at, url=check_url(url, at), max_pixels=cap)


def parse_data_url(url: str, where: str) -> tuple[str | None, str]:
    """(media type or None, base64 text) of `data:[<media type>][;params];base64,<data>`."""
    header, comma, data = url.partition(",")
    if not comma:
        raise AgentRequestError(f"{where}: a data URL needs a comma before its data "
                                "(data:image/png;base64,...)", where)
    params = [p.strip() for p in header[5:].split(";")]
    if "base64" not in (p.lower() for p in params[1:]):
        raise AgentRequestError(f"{where}: only base64 data URLs are accepted "
                                "(data:image/png;base64,...)", where)
    media_type = params[0] or None
    if media_type is not None:
        check_declared(media_type, where)
    return media_type, data


def check_url(url: str, where: str) -> str:
    if url[:7].lower() == "http://" or url[:8].lower() == "https://":
        return url
    raise AgentRequestError(f"{where} must be a data URL (data:image/png;base64,...) or an "
                            f"http(s) URL; got {url[:32]!r}", where)


def check_declared(media_type: str, where: str) -> None:
    try:
        check_media_type(media_type)
    except ImageError as exc:
        raise AgentRequestError(f"{where}: {exc}", where) from None


def anthropic_image_ref(block, where: str) -> ImageRef:
    """An Anthropic image block's source: base64 (media_type and data) or url."""
    source, at = block.source, f"{where}.source"
    if source.type == "base64":
        for name, value in (("media_type", source.media_type), ("data", source.data)):
            if not value:
                raise AgentRequestError(f"{at}.{name} is required for a base64 image source",
                                        f"{at}.{name}")
        if source.url is not None:
            raise AgentRequestError(f"{at}.url: a base64 source takes media_type and data",
                                    f"{at}.url")
        check_declared(source.media_type, f"{at}.media_type")
        return ImageRef(f"{at}.data", data=source.data, media_type=source.media_type)
    if not source.url:
        raise AgentRequestError(f"{at}.url is required for a url image source", f"{at}.url")
    for name in ("media_type", "data"):
        if getattr(source, name) is not None:
            raise AgentRequestError(f"{at}.{name}: a url source takes only url", f"{at}.{name}")
    return ImageRef(f"{at}.url", url=check_url(source.url, f"{at}.url"))


def anthropic_tool_content(block, where: str, images: list[ImageRef]) -> str | list[dict]:
    """A tool_result's content: text (prefixed "Error: " when is_error), or with image blocks
    (a screenshot tool's result) the list of text and image items."""
    content = block.content
    if not has_images(content):
        if content is None or isinstance(content, str):
            text = content or ""
        else:
            text = "\n".join(part.text for part in content)
        return f"Error: {text}" if block.is_error else text
    items: list[dict] = [{"type": "text", "text": "Error: "}] if block.is_error else []
    for k, part in enumerate(content):
        if part.type == "text":
            items.append({"type": "text", "text": part.text})
        else:
            images.append(anthropic_image_ref(part, f"{where}.content.{k}"))
            items.append({"type": "image"})
    return items

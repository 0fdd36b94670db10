"""Multipart input of /v1/images/edits: read the form within limits, split files from fields, decode.

Decoding goes through the engine's media workers (codecs are attack surface, DESIGN §3), in a
thread so the event loop keeps serving; it runs only after every cheap check has passed.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException

from pipelines.image_request import ImageRequest, RequestError, Task
from serve.bodies import read_json_object
from serve.errors import ApiError

FILE_FIELDS = {"image": "image", "image[]": "image", "mask": "mask"}  # the openai client sends lists as image[]


@dataclass
class EditUpload:
    fields: dict[str, Any]  # text fields, validated next by ImageEditRequest
    image: bytes | str  # uploaded bytes, or a source to fetch (data: URI, http(s) URL, allowed file://)
    mask: bytes | str | None
    image_param: str = "image"  # the field errors name: "image" (multipart) or "images" (JSON)


async def read_edit_json(request: Request) -> EditUpload:
    """A JSON edit request: images as `{"image_url": ...}` references (OpenAI's JSON form of edits)."""
    body = await read_json_object(request)
    images = body.pop("images", None)
    if images is None and "image" in body:  # a single reference, for clients that send one
        images = [body.pop("image")]
    if not isinstance(images, list) or len(images) != 1:
        raise ApiError(400, "send exactly one image in 'images' (a list of {\"image_url\": ...}); these models "
                            "edit one image", param="images", code="invalid_value")
    mask = body.pop("mask", None)
    return EditUpload(body, _image_reference(images[0], "images"),
                      None if mask is None else _image_reference(mask, "mask"), image_param="images")


def _image_reference(value: Any, param: str) -> str:
    url = value.get("image_url") if isinstance(value, dict) else value
    if isinstance(url, dict):  # {"image_url": {"url": ...}} as in chat messages
        url = url.get("url")
    if not isinstance(url, str) or not url:
        raise ApiError(400, f"'{param}' must be {{\"image_url\": \"<data:, http(s):// or file:// URL>\"}}",
                       param=param, code="invalid_value")
    return url


async def read_edit_form(request: Request, *, max_file_bytes: int) -> EditUpload:
    """Parse the multipart body; 400 naming the part on anything malformed, 413 on an oversized file."""
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith("multipart/form-data"):
        raise ApiError(400, f"/v1/images/edits takes multipart/form-data (with the image as a file part) or "
                            f"application/json (with image references); "
                            f"got Content-Type {content_type or 'none'!r}", code="invalid_content_type")
    declared = int(request.headers.get("content-length") or 0)
    if declared > 2 * max_file_bytes + 2**20:  # image + mask + text fields: refuse before reading a byte
        raise ApiError(413, f"request body is {declared} bytes; the limit is {max_file_bytes} bytes per image",
                       code="request_too_large")
    try:
        form = await request.form(max_files=4, max_fields=64)
    except (MultiPartException, HTTPException) as e:
        detail = getattr(e, "message", None) or getattr(e, "detail", None) or str(e)
        raise ApiError(400, f"malformed multipart body: {detail}", code="invalid_multipart") from None

    fields: dict[str, Any] = {}
    files: dict[str, list[UploadFile]] = {"image": [], "mask": []}
    for key, value in form.multi_items():
        if isinstance(value, UploadFile):
            if key not in FILE_FIELDS:
                raise ApiError(400, f"Unrecognized request argument supplied: {key}", param=key,
                               code="unknown_parameter")
            files[FILE_FIELDS[key]].append(value)
        elif key in FILE_FIELDS:
            raise ApiError(400, f"'{key}' must be sent as a file part, not a text field", param=FILE_FIELDS[key],
                           code="invalid_value")
        elif key in fields:
            raise ApiError(400, f"'{key}' was sent more than once", param=key, code="invalid_value")
        else:
            fields[key] = value
    if len(files["image"]) != 1:
        raise ApiError(400, f"send exactly one 'image' file (got {len(files['image'])}); these models edit one image",
                       param="image", code="missing_required_parameter" if not files["image"] else "invalid_value")
    if len(files["mask"]) > 1:
        raise ApiError(400, "send at most one 'mask' file", param="mask", code="invalid_value")
    image = await _read_file(files["image"][0], "image", max_file_bytes)
    mask = await _read_file(files["mask"][0], "mask", max_file_bytes) if files["mask"] else None
    return EditUpload(fields, image, mask)


async def _read_file(upload: UploadFile, param: str, max_bytes: int) -> bytes:
    data = await upload.read(max_bytes + 1)
    await upload.close()
    if len(data) > max_bytes:
        raise ApiError(413, f"'{param}' is larger than the limit of {max_bytes} bytes", param=param,
                       code="file_too_large")
    if not data:
        raise ApiError(400, f"'{param}' is an empty file", param=param, code="invalid_value")
    return data


def precheck(engine, model: str, request: ImageRequest) -> None:
    """The request's own fields against the model and limits, before any bytes are decoded.

    The same checks run again in `engine.submit_image` with the decoded image; here we only want
    an out-of-range field to be refused without paying for a decode. Unset steps/guidance stay
    unset-and-valid (the family default is checked later).
    """
    info = engine.models[model]
    limits = engine.config.limits
    dataclasses.replace(request, task=Task.TEXT_TO_IMAGE, image=None, mask=None).validate(
        size_factor=info.size_factor, default_size=info.default_size, default_steps=limits.max_steps,
        default_guidance=0.0, limits=limits)


async def decode_inputs(engine, upload: EditUpload):
    """(image, mask or None) as PIL images: fetched if referenced, decoded concurrently in the media workers."""
    async def decode(source: bytes | str, param: str, mode: str):
        data = source if isinstance(source, bytes) else await engine.load_source(source, param=param)
        return await asyncio.to_thread(engine.decode_image, data, param=param, mode=mode)

    image_job = decode(upload.image, upload.image_param, "RGB")
    if upload.mask is None:
        return await image_job, None
    image, mask_rgba = await asyncio.gather(image_job, decode(upload.mask, "mask", "RGBA"))
    return image, await asyncio.to_thread(repaint_mask, mask_rgba)


def repaint_mask(mask_rgba):
    """A mask upload -> the engine's convention (mode "L", white = repaint).

    OpenAI's convention is an RGBA mask whose transparent pixels mark where to edit; a mask
    with no transparency is read the diffusers way (white = repaint), so both kinds work.
    """
    from PIL import ImageOps

    alpha = mask_rgba.getchannel("A")
    if alpha.getextrema()[0] < 255:
        return ImageOps.invert(alpha)
    return mask_rgba.convert("L")


def edit_size(image, size_factor: int) -> tuple[int, int] | None:
    """With size "auto", an edit keeps the input's size, rounded down to the model's multiple."""
    width, height = (dim // size_factor * size_factor for dim in image.size)
    if width < size_factor or height < size_factor:
        raise RequestError("image", f"image is {image.size[0]}x{image.size[1]}; this model needs at least "
                                    f"{size_factor}x{size_factor}", code="image_too_small")
    return width, height

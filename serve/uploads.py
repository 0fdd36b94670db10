"""Multipart input of /v1/images/edits: read the form within limits, split files from fields, fetch references.

Decoding is the graph's first node (media_decode, in the engine's media workers: codecs are attack surface,
DESIGN §3); it runs only after every cheap check has passed.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException

from serve.bodies import read_json_object
from serve.errors import ApiError
from stages.media.stage import DecodeImages

FILE_FIELDS = {"image": "image", "image[]": "image", "mask": "mask"}  # the openai client sends lists as image[]

Source = bytes | str  # uploaded bytes, or a source to fetch (data: URI, http(s) URL, allowed file://)


@dataclass
class EditUpload:
    fields: dict[str, Any]  # text fields, validated next by ImageEditRequest
    image: Source | tuple[Source, ...]  # one image, or several in order (a list: `image[]` parts, JSON `images`)
    mask: Source | None
    image_param: str = "image"  # the field errors name: "image" (multipart) or "images" (JSON)


def _check_count(count: int, max_images: int, param: str) -> None:
    """At most `max_images` input images (ImageLimits.max_images) before any is read further; the model's own
    limit (most edit one) is checked with the request's other fields."""
    if count > max_images:
        raise ApiError(400, f"'{param}' has {count} images; the limit is {max_images} a request", param=param,
                       code="too_many_images")


async def read_edit_json(request: Request, *, max_images: int) -> EditUpload:
    """A JSON edit request: images as `{"image_url": ...}` references (OpenAI's JSON form of edits); several make
    a list (for the models that edit several)."""
    body = await read_json_object(request)
    images = body.pop("images", None)
    if images is None and "image" in body:  # a single reference, for clients that send one
        images = [body.pop("image")]
    if not isinstance(images, list) or not images:
        raise ApiError(400, "send the input images in 'images' (a list of {\"image_url\": ...})", param="images",
                       code="invalid_value")
    _check_count(len(images), max_images, "images")
    mask = body.pop("mask", None)
    refs = tuple(_image_reference(image, "images") for image in images)
    return EditUpload(body, refs[0] if len(refs) == 1 else refs,
                      None if mask is None else _image_reference(mask, "mask"), image_param="images")


def _image_reference(value: Any, param: str) -> str:
    url = value.get("image_url") if isinstance(value, dict) else value
    if isinstance(url, dict):  # {"image_url": {"url": ...}} as in chat messages
        url = url.get("url")
    if not isinstance(url, str) or not url:
        raise ApiError(400, f"'{param}' must be {{\"image_url\": \"<data:, http(s):// or file:// URL>\"}}",
                       param=param, code="invalid_value")
    return url


async def read_edit_form(request: Request, *, max_file_bytes: int, max_images: int) -> EditUpload:
    """Parse the multipart body; 400 naming the part on anything malformed, 413 on an oversized file. `image` is
    one file part, or several (`image[]` parts, as the openai client sends a list; or `image` repeated): a list."""
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith("multipart/form-data"):
        raise ApiError(400, f"/v1/images/edits takes multipart/form-data (with the image as a file part) or "
                            f"application/json (with image references); "
                            f"got Content-Type {content_type or 'none'!r}", code="invalid_content_type")
    declared = int(request.headers.get("content-length") or 0)
    if declared > (max_images + 1) * max_file_bytes + 2**20:  # images + mask + text fields: before reading a byte
        raise ApiError(413, f"request body is {declared} bytes; the limit is {max_file_bytes} bytes per image",
                       code="request_too_large")
    try:
        form = await request.form(max_files=max_images + 4, max_fields=64)
    except (MultiPartException, HTTPException) as e:
        detail = getattr(e, "message", None) or getattr(e, "detail", None) or str(e)
        raise ApiError(400, f"malformed multipart body: {detail}", code="invalid_multipart") from None

    fields: dict[str, Any] = {}
    files: dict[str, list[UploadFile]] = {"image": [], "mask": []}
    listed = False  # an `image[]` part: the images are a list, even of one
    for key, value in form.multi_items():
        if isinstance(value, UploadFile):
            if key not in FILE_FIELDS:
                raise ApiError(400, f"Unrecognized request argument supplied: {key}", param=key,
                               code="unknown_parameter")
            files[FILE_FIELDS[key]].append(value)
            listed = listed or key == "image[]"
        elif key in FILE_FIELDS:
            raise ApiError(400, f"'{key}' must be sent as a file part, not a text field", param=FILE_FIELDS[key],
                           code="invalid_value")
        elif key in fields:
            raise ApiError(400, f"'{key}' was sent more than once", param=key, code="invalid_value")
        else:
            fields[key] = value
    if not files["image"]:
        raise ApiError(400, "send the input image as an 'image' file part (several: 'image[]' parts)", param="image",
                       code="missing_required_parameter")
    _check_count(len(files["image"]), max_images, "image")
    if len(files["mask"]) > 1:
        raise ApiError(400, "send at most one 'mask' file", param="mask", code="invalid_value")
    images = tuple([await _read_file(upload, "image", max_file_bytes) for upload in files["image"]])
    mask = await _read_file(files["mask"][0], "mask", max_file_bytes) if files["mask"] else None
    return EditUpload(fields, images if listed or len(images) > 1 else images[0], mask)


async def _read_file(upload: UploadFile, param: str, max_bytes: int) -> bytes:
    data = await upload.read(max_bytes + 1)
    await upload.close()
    if len(data) > max_bytes:
        raise ApiError(413, f"'{param}' is larger than the limit of {max_bytes} bytes", param=param,
                       code="file_too_large")
    if not data:
        raise ApiError(400, f"'{param}' is an empty file", param=param, code="invalid_value")
    return data


async def fetch_sources(engine, upload: EditUpload) -> DecodeImages:
    """The upload's image(s) and mask bytes, fetched safely when they are references (data:, http(s)://,
    file://), all at once."""
    async def load(source: Source, param: str) -> bytes:
        return source if isinstance(source, bytes) else await engine.load_source(source, param=param)

    sources = upload.image if isinstance(upload.image, tuple) else (upload.image,)
    loads = [load(source, upload.image_param) for source in sources]
    if upload.mask is not None:
        loads.append(load(upload.mask, "mask"))
    loaded = await asyncio.gather(*loads)
    images, mask = loaded[:len(sources)], loaded[len(sources)] if upload.mask is not None else None
    return DecodeImages(tuple(images) if isinstance(upload.image, tuple) else images[0], mask, upload.image_param)

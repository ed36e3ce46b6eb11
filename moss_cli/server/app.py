"""The HTTP face of the engine (FastAPI): OpenAI's images API, a native PNG endpoint, the models and health.

Thin by design: each endpoint checks its body into an engine.Request, queues it, and waits for its pictures;
errors leave in OpenAI's shape {"error": {"message", "type", "param", "code"}}.
"""

import asyncio
import base64
import binascii
import hmac
import json
import secrets
import time
from typing import Literal, Optional, Union

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, ValidationError

from .. import stages
from ..errors import MossError, PictureError, UsageError
from .engine import Busy, Unavailable

MAX_BODY = 1 << 25          # bytes of a request body (a picture to start from, in base64, among them)
KEEP_URLS = 64              # pictures kept for response_format url ...
URL_SECONDS = 600           # ... and for how long
POLL_SECONDS = 0.2          # how often a waiting request looks whether its client is still there


class ApiError(Exception):
    def __init__(self, status, message, kind="invalid_request_error", param=None, code=None, headers=None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = headers

    def response(self):
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


class LoraChoice(BaseModel):
    """One adapter of a request's `lora` list: a name given at start (--lora NAME=FILE), its scale (default: the
    one given at start)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    scale: Optional[float] = None


class _Request(BaseModel):
    """The fields both picture endpoints take under one name."""

    model_config = ConfigDict(extra="forbid", strict=True)
    prompt: str
    seed: Optional[int] = None
    shift: Optional[float] = None
    uncond_skip_layers: Union[str, list[int]] = "22"
    skip_start: float = stages.DEFAULT_SKIP_START
    skip_stop: float = stages.DEFAULT_SKIP_STOP
    lora: Optional[list[LoraChoice]] = None


class Generation(_Request):
    """POST /v1/images/generations: OpenAI's fields, SGLang's and vLLM-Omni's, and ours (shift, skip window, lora)."""

    n: int = 1
    size: str = "auto"
    response_format: Literal["b64_json", "url"] = "b64_json"
    model: Optional[str] = None
    user: Optional[str] = None
    negative_prompt: str = stages.DEFAULT_NEGATIVE
    num_inference_steps: Optional[int] = None
    guidance_scale: Optional[float] = None


class Edit(Generation):
    """POST /v1/images/edits: OpenAI's image edit as a multipart form (values as text): Generation's fields and
    strength; the picture (`image`) and its mask are the form's files."""

    model_config = ConfigDict(extra="forbid", strict=False)
    strength: Optional[float] = None


class Native(_Request):
    """POST /v1/moss/image: moss-image's options under their own names, one picture."""

    negative: str = stages.DEFAULT_NEGATIVE
    steps: Optional[int] = None
    guidance: Optional[float] = None
    width: Optional[int] = None
    height: Optional[int] = None
    noise: Literal["avx2", "generic"] = "avx2"
    init_image: Optional[str] = None        # a PNG, JPEG or WebP file in base64: moss-image --init-image
    strength: Optional[float] = None
    mask: Optional[str] = None              # the same, white repaints: moss-image --mask


# the request field that each of SamplingOptions.check's options comes from
OPENAI_FIELDS = {"--width": "size", "--height": "size", "--steps": "num_inference_steps",
                 "--guidance": "guidance_scale", "--shift": "shift", "--seed": "seed", "--skip-start": "skip_start",
                 "--skip-stop": "skip_stop", "--uncond-skip-layers": "uncond_skip_layers", "n": "n",
                 "prompt": "prompt", "negative": "negative_prompt", "lora": "lora"}
NATIVE_FIELDS = {"--width": "width", "--height": "height", "--steps": "steps", "--guidance": "guidance",
                 "--shift": "shift", "--seed": "seed", "--skip-start": "skip_start", "--skip-stop": "skip_stop",
                 "--uncond-skip-layers": "uncond_skip_layers", "prompt": "prompt", "negative": "negative",
                 "lora": "lora", "--strength": "strength", "--mask": "mask", "init_image": "init_image",
                 "mask": "mask"}
EDIT_FIELDS = {**OPENAI_FIELDS, "--strength": "strength", "--mask": "mask", "init_image": "image", "mask": "mask"}


class Kept:
    """The PNGs of response_format url: the last KEEP, each for at most SECONDS."""

    def __init__(self, keep=KEEP_URLS, seconds=URL_SECONDS, clock=time.monotonic):
        self.keep, self.seconds, self.clock = keep, seconds, clock
        self._pngs = {}          # id -> (when, png), oldest first

    def put(self, png):
        self._expire()
        name = secrets.token_urlsafe(16)
        self._pngs[name] = (self.clock(), png)
        while len(self._pngs) > self.keep:
            del self._pngs[next(iter(self._pngs))]
        return name

    def get(self, name):
        self._expire()
        found = self._pngs.get(name)
        return found and found[1]

    def _expire(self):
        now = self.clock()
        for name in [n for n, (when, _) in self._pngs.items() if now - when > self.seconds]:
            del self._pngs[name]


def _lora(choices):
    """[(name, scale)] of a request's lora list (None: not given)."""
    return None if choices is None else [(c.name, c.scale) for c in choices]


def _skip_layers(value):
    return value if isinstance(value, str) else ",".join(str(i) for i in value)


def _size(text, defaults):
    if text == "auto":
        return defaults["width"], defaults["height"]
    w, x, h = text.partition("x")
    if not (x and w.isascii() and h.isascii() and w.isdigit() and h.isdigit()):
        raise ApiError(400, f"size {text!r}: give WIDTHxHEIGHT, e.g. 1024x1024, or auto", param="size",
                       code="invalid_size")
    return int(w), int(h)


def _validated(schema, value):
    """SCHEMA of a request's fields (None: the default), a ValidationError as a 400 naming the first field."""
    try:
        return schema.model_validate({k: v for k, v in value.items() if v is not None})
    except ValidationError as e:
        first = e.errors()[0]
        param = str(first["loc"][0]) if first["loc"] else None     # the field; deeper parts name union members
        raise ApiError(400, f"{param}: {first['msg']}", param=param, code="invalid_value") from None


def _file(text, field):
    """The bytes of a file sent in base64 (None stays None)."""
    if text is None:
        return None
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, f"{field}: not base64", param=field, code="invalid_value") from None


def _usage(error, fields):
    """ApiError 400 of a UsageError, named after the request's field (its message names moss-image's option)."""
    message = str(error)
    flag = message.split(" ", 1)[0].rstrip(":")
    field = fields.get(flag)
    if field is not None and flag.startswith("--"):
        message = message.replace(flag, flag[2:].replace("-", "_"), 1)
    message = message.replace(stages.START_HINT, f"give {fields.get('init_image', 'init_image')}")
    return ApiError(400, message, param=field, code="invalid_value")


def create_app(engine, api_key=None, kept=None):
    """The FastAPI app serving ENGINE; API_KEY (when given) is required as `Authorization: Bearer KEY`."""
    app = FastAPI(title="moss-server", docs_url=None, redoc_url=None, openapi_url=None)
    kept = kept or Kept()
    model_id = engine.checkpoint.root.name
    started = int(time.time())

    @app.exception_handler(ApiError)
    async def _api_error(request, error):
        return error.response()

    @app.exception_handler(404)
    async def _not_found(request, error):
        return ApiError(404, f"no such endpoint: {request.method} {request.url.path}", code="not_found").response()

    @app.exception_handler(405)
    async def _not_allowed(request, error):
        return ApiError(405, f"{request.method} is not allowed on {request.url.path}",
                        code="method_not_allowed").response()

    def authorize(request: Request):
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise ApiError(401, "a valid API key is required: Authorization: Bearer KEY", code="invalid_api_key")

    api = APIRouter(dependencies=[Depends(authorize)])   # every endpoint but /health

    async def body(request, schema):
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > MAX_BODY:
            raise ApiError(413, f"the body is over {MAX_BODY} bytes", code="body_too_large")
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > MAX_BODY:
                raise ApiError(413, f"the body is over {MAX_BODY} bytes", code="body_too_large")
        try:
            value = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the body is not JSON ({e})", code="invalid_json") from None
        if not isinstance(value, dict):
            raise ApiError(400, "the body must be a JSON object", code="invalid_json")
        return _validated(schema, value)

    async def form(request):
        """(fields, files) of a multipart form: text fields by name, each file's bytes by name ("image[]" is
        "image"), one file a name."""
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > MAX_BODY:
            raise ApiError(413, f"the body is over {MAX_BODY} bytes", code="body_too_large")
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise ApiError(400, "the body must be a multipart form (multipart/form-data)", code="invalid_form")
        try:
            sent = await request.form(max_files=4, max_fields=64, max_part_size=MAX_BODY)
        except Exception as e:        # not multipart, or past the limits: the parser's own words
            raise ApiError(400, f"the body is not a multipart form within its limits ({e})", code="invalid_form") \
                from None
        fields, files = {}, {}
        for key, value in sent.multi_items():
            name = key[:-2] if key.endswith("[]") else key
            if isinstance(value, str):
                fields[name] = value
                continue
            if name in files:
                raise ApiError(400, f"{name}: one file, not several", param=name, code="invalid_value")
            files[name] = await value.read()
        return fields, files

    def listing(request, req, made):
        """OpenAI's images response of the pictures made for REQ."""
        data = []
        for picture in made:
            if req.response_format == "url":
                item = {"url": str(request.url_for("image", name=kept.put(picture.png)))}
            else:
                item = {"b64_json": base64.b64encode(picture.png).decode("ascii")}
            data.append({**item, "revised_prompt": None, "parameters": picture.parameters})
        return {"created": int(time.time()), "data": data}

    def make(fields, **given):
        try:
            return engine.request(**given)
        except (UsageError, PictureError) as e:
            raise _usage(e, fields) from None

    async def pictures(request, job):
        """The pictures of JOB once made; the job is withdrawn when the client leaves first."""
        try:
            engine.submit(job)
        except Busy as e:
            raise ApiError(429, str(e), kind="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": str(e.retry_after)}) from None
        except Unavailable as e:
            raise ApiError(503, str(e), kind="server_error", code="unavailable") from None
        waiting = asyncio.wrap_future(job.future)
        while not waiting.done():
            await asyncio.wait({waiting}, timeout=POLL_SECONDS)
            if not waiting.done() and await request.is_disconnected():
                engine.withdraw(job)
                waiting.add_done_callback(lambda f: f.cancelled() or f.exception())
                return None
        try:
            return waiting.result()
        except Unavailable as e:
            raise ApiError(503, str(e), kind="server_error", code="unavailable") from None
        except UsageError as e:      # a size past the memory plan, found once the plan was made
            raise ApiError(400, str(e), param="size", code="invalid_value") from None
        except MossError as e:
            raise ApiError(500, str(e), kind="server_error", code="picture_failed") from None
        except Exception as e:       # a failure inside the picture fails this request, never the server
            raise ApiError(500, f"{type(e).__name__}: {e}", kind="server_error", code="picture_failed") from None

    async def openai_images(request, req, fields, width, height, **start):
        """OpenAI's images response to a Generation (or Edit) request REQ, the picture to start from in START."""
        job = make(fields, prompt=req.prompt, negative=req.negative_prompt, seed=req.seed, count=req.n,
                   steps=req.num_inference_steps, guidance=req.guidance_scale, width=width, height=height,
                   shift=req.shift, uncond_skip_layers=_skip_layers(req.uncond_skip_layers),
                   skip_start=req.skip_start, skip_stop=req.skip_stop, lora=_lora(req.lora), **start)
        made = await pictures(request, job)
        if made is None:
            return Response(status_code=499)
        return listing(request, req, made)

    @api.post("/v1/images/generations")
    async def generations(request: Request):
        req = await body(request, Generation)
        return await openai_images(request, req, OPENAI_FIELDS, *_size(req.size, engine.defaults))

    @api.post("/v1/images/edits")
    async def edits(request: Request):
        """The picture (and OpenAI's mask: its transparent pixels are repainted) as moss-image --init-image (--mask)
        takes them; the size is the picture's unless given."""
        fields, files = await form(request)
        req = _validated(Edit, fields)
        if "image" not in files:
            raise ApiError(400, "image: give the picture to edit as a file", param="image", code="invalid_value")
        width, height = (None, None) if req.size == "auto" else _size(req.size, engine.defaults)
        return await openai_images(request, req, EDIT_FIELDS, width, height, init_image=files["image"],
                                   strength=req.strength, mask=files.get("mask"), transparent=True)

    @api.post("/v1/moss/image")
    async def native(request: Request):
        req = await body(request, Native)
        job = make(NATIVE_FIELDS, prompt=req.prompt, negative=req.negative, seed=req.seed, steps=req.steps,
                   guidance=req.guidance, width=req.width, height=req.height, shift=req.shift,
                   uncond_skip_layers=_skip_layers(req.uncond_skip_layers), skip_start=req.skip_start,
                   skip_stop=req.skip_stop, noise=req.noise, lora=_lora(req.lora),
                   init_image=_file(req.init_image, "init_image"), strength=req.strength, mask=_file(req.mask, "mask"))
        made = await pictures(request, job)
        if made is None:
            return Response(status_code=499)
        return Response(made[0].png, media_type="image/png", headers={"X-Moss-Seed": str(made[0].seed),
                                                                         "X-Moss-Seconds": f"{made[0].seconds:.4f}"})

    @api.get("/v1/images/{name}", name="image")
    async def image(name: str, request: Request):
        if name in ("generations", "edits"):        # the POST endpoints, asked with GET
            raise ApiError(405, f"GET is not allowed on {request.url.path}: POST a request",
                           code="method_not_allowed")
        png = kept.get(name)
        if png is None:
            raise ApiError(404, f"no picture {name} (pictures are kept {URL_SECONDS} s, the last {kept.keep})",
                           param="name", code="not_found")
        return Response(png, media_type="image/png")

    @api.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": started,
                                            "owned_by": "moss-cli"}]}

    @app.get("/health")
    async def health():
        status = {"status": engine.state, "queue": engine.depth, "busy": engine.running is not None, "model": model_id,
                  "devices": engine.devices}
        if engine.adapters:
            status["lora"] = {name: adapter.scale for name, adapter in engine.adapters.items()}
        if engine.error is not None:
            status["error"] = str(engine.error)
        return JSONResponse(status, status_code=200 if engine.state == "ready" else 503)

    app.include_router(api)
    return app

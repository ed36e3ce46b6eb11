"""moss-server on 127.0.0.1 (uvicorn in a thread, the tiny checkpoint on the CPU) with real clients: the official
openai package and plain HTTP. A request's PNG equals moss-image's with the same options, byte for byte; image i
of a request takes seed + i; bad requests get 400 in OpenAI's error shape and are never queued; a full queue
answers 429 with Retry-After; a client that leaves has its queued work dropped uncomputed."""

import base64
import contextlib
import io
import json
import socket
import threading

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from cli_util import run
from moss_cli.checkpoint import open_checkpoint
from moss_cli import batch
from moss_cli.errors import CheckpointError, DeviceError
from moss_cli.server.app import MAX_BODY, Kept, create_app
from moss_cli.server.engine import MAX_PROMPT, Engine, Recent
from server_util import WAIT_S, Background, serving, until

SMALL = {"size": "64x48", "num_inference_steps": 2}
TINY = {"size": "32x32", "num_inference_steps": 1}      # the quickest picture, where its bytes are not compared


@pytest.fixture(scope="module")
def engine():
    e = Engine(open_checkpoint(), device="cpu", max_queue=64, warm=False).start()
    until(lambda: e.state == "ready", "the engine to load")
    yield e
    e.close()
    e.join(WAIT_S)


@pytest.fixture(scope="module")
def url(engine):
    with serving(create_app(engine)) as url:
        yield url


def client(url, key="none"):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=WAIT_S)


def post(url, body, path="/v1/images/generations", **kw):
    return httpx.post(f"{url}{path}", json=body, timeout=WAIT_S, **kw)


def png_of(item):
    return base64.b64decode(item["b64_json"])


@pytest.fixture(scope="module")
def fox(tmp_path_factory):
    """moss-image's PNGs of "a red fox" against "blurry", seeds 7 and 8, 64x48, 2 steps, guidance 2.5."""
    folder = tmp_path_factory.mktemp("fox")
    r = run("moss-image", "--prompt", "a red fox", "--negative", "blurry", "--seed", "7-8", "--width", 64,
            "--height", 48, "--steps", 2, "--guidance", 2.5, "--picture", folder / "fox-{seed}.png", "--quiet")
    assert r.code == 0, r.stderr
    return {seed: (folder / f"fox-{seed}.png").read_bytes() for seed in (7, 8)}


@contextlib.contextmanager
def held(engine):
    """The worker waits before each picture's denoising until the gate opens: its request stays in flight."""
    gate, real = threading.Event(), engine.model_for

    def model_for(stage):
        if stage == "denoise":
            gate.wait(WAIT_S)
        return real(stage)

    engine.model_for = model_for
    try:
        yield gate
    finally:
        gate.set()
        engine.model_for = real


def test_the_openai_client_gets_moss_images_pngs_seed_plus_i(url, fox):
    images = client(url).images.generate(
        model="tiny", prompt="a red fox", n=2, size="64x48",
        extra_body={"seed": 7, "num_inference_steps": 2, "guidance_scale": 2.5, "negative_prompt": "blurry"})
    assert len(images.data) == 2 and images.created > 0
    for image, seed in zip(images.data, (7, 8)):
        assert base64.b64decode(image.b64_json) == fox[seed]
        params = image.parameters              # an extra field, as the README reads it
        assert (params["seed"], params["steps"], params["guidance"], params["negative"]) == (seed, 2, 2.5, "blurry")
        assert (params["width"], params["height"], params["prompt"]) == (64, 48, "a red fox")


def test_plain_http_gets_the_same_bytes_and_the_second_picture_alone_is_seed_8(url, fox):
    body = {"prompt": "a red fox", "negative_prompt": "blurry", "guidance_scale": 2.5, **SMALL}
    r = post(url, {**body, "seed": 8})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert [png_of(item) for item in r.json()["data"]] == [fox[8]]


def test_the_native_endpoint_takes_every_moss_image_option_and_returns_its_png(url, tmp_path):
    options = {"negative": "grey", "seed": -3, "steps": 3, "guidance": 2.0, "width": 48, "height": 32, "shift": 3.0,
               "uncond_skip_layers": "21,22", "skip_start": 0.0, "skip_stop": 0.5, "noise": "generic"}
    flags = [a for k, v in options.items() for a in (f"--{k.replace('_', '-')}", v)]
    r = run("moss-image", "--prompt", "une forêt", *flags, "--picture", tmp_path / "p.png", "--quiet")
    assert r.code == 0, r.stderr
    got = post(url, {"prompt": "une forêt", **options}, path="/v1/moss/image")
    assert got.status_code == 200 and got.headers["content-type"] == "image/png"
    assert got.headers["x-moss-seed"] == "-3"
    assert got.content == (tmp_path / "p.png").read_bytes()
    as_list = post(url, {"prompt": "une forêt", **options, "uncond_skip_layers": [21, 22]}, path="/v1/moss/image")
    assert as_list.content == got.content


def test_without_a_seed_the_server_draws_one_returns_it_and_it_remakes_the_picture(url):
    r = post(url, {"prompt": "a fox", "n": 2, "seed": None, "response_format": None, **TINY})   # null: not given
    assert r.status_code == 200
    first, second = (item["parameters"]["seed"] for item in r.json()["data"])
    assert 0 <= first < 2**32 and second == first + 1
    again = post(url, {"prompt": "a fox", "seed": first, "width": 32, "height": 32, "steps": 1}, path="/v1/moss/image")
    assert again.content == png_of(r.json()["data"][0])


def test_response_format_url_serves_each_picture_at_its_link(url, fox):
    r = post(url, {"prompt": "a red fox", "negative_prompt": "blurry", "guidance_scale": 2.5, "seed": 7, "n": 2,
                   "response_format": "url", **SMALL})
    links = [item["url"] for item in r.json()["data"]]
    assert all(link.startswith(f"{url}/v1/images/") for link in links) and len(set(links)) == 2
    for link, seed in zip(links, (7, 8)):
        got = httpx.get(link, timeout=WAIT_S)
        assert got.status_code == 200 and got.headers["content-type"] == "image/png" and got.content == fox[seed]
    gone = httpx.get(f"{url}/v1/images/nothing-here", timeout=WAIT_S)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "not_found"


def test_kept_pictures_are_bounded_in_count_and_time():
    now = [0.0]
    kept = Kept(keep=2, seconds=10, clock=lambda: now[0])
    a, b, c = kept.put(b"a"), kept.put(b"b"), kept.put(b"c")
    assert (kept.get(a), kept.get(b), kept.get(c)) == (None, b"b", b"c")
    now[0] = 10.0
    assert kept.get(b) == b"b"
    now[0] = 10.5
    assert (kept.get(b), kept.get(c)) == (None, None)


BAD = [
    ({"size": "64"}, "size", "WIDTHxHEIGHT"),
    ({"size": "65x64"}, "size", "width 65: must be a positive multiple of 16"),
    ({"size": "64x0"}, "size", "height 0: must be a positive multiple of 16"),
    ({"size": "64x²"}, "size", "WIDTHxHEIGHT"),
    ({"size": "8192x64"}, "size", "width 8192: the server takes at most 4096"),
    ({"num_inference_steps": 1001}, "num_inference_steps", "steps 1001: the server takes at most 1000"),
    ({"n": 0}, "n", "give 1 to 8 pictures"),
    ({"n": 9}, "n", "give 1 to 8 pictures"),
    ({"n": "2"}, "n", "valid integer"),
    ({"num_inference_steps": 0}, "num_inference_steps", "steps 0: must be at least 1"),
    ({"guidance_scale": -1.0}, "guidance_scale", "guidance -1.0: must be finite and >= 0"),
    ({"shift": 0}, "shift", "shift 0.0: must be finite and > 0"),
    ({"response_format": "jpeg"}, "response_format", "'b64_json' or 'url'"),
    ({"prompt": "x" * (MAX_PROMPT + 1)}, "prompt", f"more than the {MAX_PROMPT}"),
    ({"negative_prompt": "x" * (MAX_PROMPT + 1)}, "negative_prompt", f"more than the {MAX_PROMPT}"),
    ({"prompt": "fox " * 4000}, "prompt", "over the encoder's 4096 tokens"),
    ({"negative_prompt": "fox " * 4000}, "negative_prompt", "over the encoder's 4096 tokens"),
    ({"prompt": None}, "prompt", "Field required"),
    ({"prompt": 5}, "prompt", "valid string"),
    ({"seed": 2**64}, "seed", "out of the range"),
    ({"seed": 2**64 - 1, "n": 2}, "seed", "the last picture's seed, 18446744073709551616, is out of the range"),
    ({"skip_start": 0.5, "skip_stop": 0.2}, "skip_start", "0 <= start <= stop <= 1"),
    ({"uncond_skip_layers": "22x"}, "uncond_skip_layers", "give block indices"),
    ({"uncond_skip_layers": [22, "x"]}, "uncond_skip_layers", "valid"),
    ({"steps": 2}, "steps", "Extra inputs are not permitted"),
]


def error_of(r, status=400):
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.mark.parametrize("change,param,says", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_a_bad_request_gets_400_in_openais_shape_and_is_never_queued(engine, url, change, param, says):
    made = engine.made
    body = {"prompt": "a fox", **TINY, **change}
    r = post(url, body)
    error = error_of(r)
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert says in error["message"], error["message"]
    assert engine.made == made and engine.depth == 0
    assert httpx.get(f"{url}/health", timeout=WAIT_S).json()["status"] == "ready"


@pytest.mark.parametrize("field", ["prompt", "negative_prompt"])
def test_a_lone_surrogate_in_a_prompt_is_400_naming_its_field(engine, url, field):
    """JSON may escape a lone surrogate (\\ud800), which is no text the tokenizer takes: 400, not a failed picture."""
    made = engine.made
    body = json.dumps({"prompt": "a fox", **TINY, field: "a\ud800b"})      # ensure_ascii: sent escaped
    r = httpx.post(f"{url}/v1/images/generations", content=body.encode("ascii"), timeout=WAIT_S,
                   headers={"content-type": "application/json"})
    error = error_of(r)
    assert error["param"] == field and "not UTF-8 text" in error["message"] and engine.made == made


@pytest.mark.parametrize("body,status,code", [
    (b"{\"prompt\": \"a fox\",", 400, "invalid_json"),
    (b"[\"a fox\"]", 400, "invalid_json"),
    (b"\xff\xfe", 400, "invalid_json"),
    (b"{\"prompt\": \"" + b"x" * MAX_BODY + b"\"}", 413, "body_too_large"),
])
def test_a_body_that_is_not_a_json_object_or_too_large_is_refused(url, body, status, code):
    r = httpx.post(f"{url}/v1/images/generations", content=body, timeout=WAIT_S)
    assert error_of(r, status)["code"] == code


@pytest.mark.parametrize("path", ["/v1/images/generations", "/v1/images/edits"])
def test_get_on_a_post_endpoint_is_405(url, path):
    r = httpx.get(f"{url}{path}", timeout=WAIT_S)
    assert error_of(r, 405)["code"] == "method_not_allowed"


def test_the_native_endpoint_names_its_own_fields_in_errors(url):
    error = error_of(post(url, {"prompt": "a fox", "width": 24, "height": 32}, path="/v1/moss/image"))
    assert error["param"] == "width" and error["message"].startswith("width 24: must be a positive multiple of 16")
    error = error_of(post(url, {"prompt": "a fox", "noise": "sse"}, path="/v1/moss/image"))
    assert error["param"] == "noise"


def test_the_openai_client_raises_its_bad_request_error_with_the_param(url):
    with pytest.raises(openai.BadRequestError) as bad:
        client(url).images.generate(model="tiny", prompt="a fox", size="65x64", extra_body={"num_inference_steps": 1})
    assert bad.value.status_code == 400 and bad.value.param == "size" and bad.value.code == "invalid_value"


@pytest.mark.parametrize("failure", [DeviceError("the transformer needs 99.0 GB of GPU memory for its weights"),
                                     FloatingPointError("overflow in the 3rd block")])
def test_a_failure_inside_a_picture_fails_that_request_with_500_and_the_server_goes_on(engine, url, failure):
    real = engine.model_for

    def model_for(stage):
        if stage == "denoise":
            raise failure
        return real(stage)

    engine.model_for = model_for
    try:
        r = post(url, {"prompt": "a fox", "seed": 1, **TINY})
    finally:
        engine.model_for = real
    error = error_of(r, 500)
    assert error["type"] == "server_error" and str(failure) in error["message"]
    assert post(url, {"prompt": "a fox", "seed": 1, **TINY}).status_code == 200


def test_a_full_queue_answers_429_with_retry_after(engine, url):
    engine.max_queue = 1
    try:
        with held(engine) as gate:
            first = Background(lambda: post(url, {"prompt": "a fox", "seed": 1, **TINY}))
            until(lambda: engine.running is not None, "the first request to start")
            second = Background(lambda: post(url, {"prompt": "a fox", "seed": 2, **TINY}))
            until(lambda: engine.depth == 1, "the second request to wait")
            r = post(url, {"prompt": "a fox", "seed": 3, **TINY})
            error = error_of(r, 429)
            assert error["code"] == "rate_limit_exceeded" and int(r.headers["retry-after"]) >= 1
            with pytest.raises(openai.RateLimitError):
                client(url).images.generate(model="tiny", prompt="a fox", size="32x32")
            gate.set()
            assert [x.result().status_code for x in (first, second)] == [200, 200]
    finally:
        engine.max_queue = 64
    assert post(url, {"prompt": "a fox", "seed": 3, **TINY}).status_code == 200


def _send(url, body):
    """A raw HTTP request on its own socket, left unread: closing the socket is the client leaving."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=WAIT_S)
    sock.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return sock


def test_a_client_that_leaves_has_its_queued_request_dropped_uncomputed(engine, url):
    made, dropped = engine.made, engine.dropped
    with held(engine) as gate:
        first = Background(lambda: post(url, {"prompt": "a fox", "seed": 1, **TINY}))
        until(lambda: engine.running is not None, "the first request to start")
        leaving = _send(url, {"prompt": "a fox", "seed": 2, "n": 4, **TINY})
        until(lambda: engine.depth == 1, "the second request to wait")
        leaving.close()
        until(lambda: engine.dropped == dropped + 1, "the second request to be dropped")
        assert engine.depth == 0
        gate.set()
        assert first.result().status_code == 200
    assert engine.made == made + 1


def test_a_client_that_leaves_mid_request_gets_no_more_pictures_made(engine, url):
    made = engine.made
    with held(engine) as gate:
        leaving = _send(url, {"prompt": "a fox", "seed": 2, "n": 4, **TINY})
        until(lambda: engine.running is not None, "the request to start")
        job = engine.running
        leaving.close()
        until(lambda: job.withdrawn, "the request to be withdrawn")
        gate.set()
        until(lambda: engine.running is None, "the request to end")
    assert engine.made == made + 1           # the picture in flight, none of the three after it


def test_eight_clients_with_four_requests_each_are_all_answered_in_full(engine, url):
    def client_run(_):
        with httpx.Client(timeout=WAIT_S) as http:
            return [http.post(f"{url}/v1/images/generations", json={"prompt": "a fox", "seed": j, **TINY})
                    for j in range(4)]

    clients = [Background(lambda i=i: client_run(i)) for i in range(8)]
    answers = [r for c in clients for r in c.result()]
    assert len(answers) == 32 and {r.status_code for r in answers} == {200}
    pictures = {}
    for r in answers:
        (item,) = r.json()["data"]
        pictures.setdefault(item["parameters"]["seed"], set()).add(png_of(item))
    assert sorted(pictures) == [0, 1, 2, 3] and all(len(p) == 1 for p in pictures.values())
    for (png,) in pictures.values():
        assert Image.open(io.BytesIO(png)).size == (32, 32)
    assert engine.depth == 0 and engine.running is None


def test_models_and_health(engine, url):
    assert [m.id for m in client(url).models.list().data] == ["tiny"]
    health = httpx.get(f"{url}/health", timeout=WAIT_S)
    assert health.status_code == 200
    assert health.json() == {"status": "ready", "queue": 0, "busy": False, "model": "tiny",
                             "devices": {"encode": "cpu", "denoise": "cpu", "decode": "cpu"}}
    error = error_of(httpx.get(f"{url}/v1/nothing", timeout=WAIT_S), 404)
    assert error["code"] == "not_found"
    error = error_of(httpx.post(f"{url}/v1/models", timeout=WAIT_S), 405)
    assert error["code"] == "method_not_allowed"


def test_an_api_key_is_required_as_a_bearer_token_when_given(engine, fox):
    with serving(create_app(engine, api_key="s3cret")) as url:
        body = {"prompt": "a red fox", "negative_prompt": "blurry", "guidance_scale": 2.5, "seed": 7, **SMALL}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            error = error_of(post(url, body, headers=headers), 401)
            assert error["code"] == "invalid_api_key"
        assert httpx.get(f"{url}/health", timeout=WAIT_S).status_code == 200
        with pytest.raises(openai.AuthenticationError):
            client(url, "wrong").models.list()
        r = post(url, body, headers={"Authorization": "Bearer s3cret"})
        assert png_of(r.json()["data"][0]) == fox[7]
        images = client(url, "s3cret").images.generate(
            model="tiny", prompt="a red fox", size="64x48",
            extra_body={"seed": 8, "num_inference_steps": 2, "guidance_scale": 2.5, "negative_prompt": "blurry"})
        assert base64.b64decode(images.data[0].b64_json) == fox[8]


def test_a_model_that_fails_to_load_answers_503_and_health_says_why(monkeypatch):
    def broken(*args, **kwargs):
        raise CheckpointError("transformer: a shard is unreadable")

    monkeypatch.setattr(batch, "open_models", broken)
    failed = Engine(open_checkpoint(), device="cpu").start()
    assert failed.loaded.wait(WAIT_S) and failed.state == "failed"
    with serving(create_app(failed)) as url:
        health = httpx.get(f"{url}/health", timeout=WAIT_S)
        assert health.status_code == 503
        assert (health.json()["status"], health.json()["error"]) == ("failed", "transformer: a shard is unreadable")
        error = error_of(post(url, {"prompt": "a fox", **TINY}), 503)
        assert error["message"] == "the model failed to load: transformer: a shard is unreadable"


def test_prompts_and_negatives_are_encoded_once_across_requests(engine, url):
    model = engine.model_for("encode")
    real, calls = model.encoder, []

    def counting(ids):
        calls.append(len(ids))
        return real(ids)

    model.__dict__["encoder"] = counting         # the cached component, counted
    try:
        counts = []
        for prompt in ("a cat", "a cat", "a dog"):
            before = len(calls)
            assert post(url, {"prompt": prompt, "negative_prompt": "dusty", **TINY}).status_code == 200
            counts.append(len(calls) - before)
    finally:
        model.__dict__["encoder"] = real
    assert counts == [2, 0, 1]


def test_recent_keeps_the_entries_last_set_or_read():
    recent = Recent(2)
    recent["a"], recent["b"] = 1, 2
    assert recent.get("a") == 1
    recent["c"] = 3
    assert list(recent) == ["a", "c"] and recent.get("b") is None


def test_the_next_waiting_requests_noise_is_drawn_while_the_picture_before_it_denoises(engine, url, monkeypatch):
    from moss_cli import stages
    taken, real = [], stages.Model.noise

    def spy(self, shape, seed, kernel):
        taken.append((seed, self._ahead[0][1] if self._ahead else None))
        return real(self, shape, seed, kernel)

    monkeypatch.setattr(stages.Model, "noise", spy)
    with held(engine) as gate:
        first = Background(lambda: post(url, {"prompt": "a fox", "seed": 5, "n": 2, **TINY}))
        until(lambda: engine.running is not None, "the first request to start")
        second = Background(lambda: post(url, {"prompt": "a fox", "seed": 9, **TINY}))
        until(lambda: engine.depth == 1, "the second request to wait")
        gate.set()
        assert [x.result().status_code for x in (first, second)] == [200, 200]
    assert taken == [(5, None), (6, 6), (9, 9)]


def test_an_adapter_named_at_start_serves_moss_image_lora_pictures(tmp_path):
    """moss-server --lora: every request's PNG equals moss-image's with the same --lora (a kohya adapter on block 0's
    q projection), and differs from the base model's."""
    from safetensors.numpy import save_file
    from moss_cli import lora
    rng = np.random.default_rng(0)
    q = open_checkpoint().component("transformer").tensors["layers.0.proj.q.weight"]
    adapter = tmp_path / "style.safetensors"
    save_file({"lora_unet_layers_0_proj_q.lora_down.weight": rng.standard_normal((4, q.shape[1])).astype(np.float32),
               "lora_unet_layers_0_proj_q.lora_up.weight": rng.standard_normal((q.shape[0], 4)).astype(np.float32),
               "lora_unet_layers_0_proj_q.alpha": np.array(4.0, np.float32)}, adapter)
    options = ["--seed", 7, "--width", 64, "--height", 48, "--steps", 2, "--quiet"]
    made = {}
    for name, extra in (("base", []), ("lora", ["--lora", f"{adapter}:0.5"])):
        r = run("moss-image", "--prompt", "a red fox", *options, *extra, "--picture", tmp_path / f"{name}.png")
        assert r.code == 0, r.stderr
        made[name] = (tmp_path / f"{name}.png").read_bytes()
    engine = Engine(open_checkpoint(lora=[lora.parse_spec(f"{adapter}:0.5")]), device="cpu", warm=False).start()
    try:
        until(lambda: engine.state == "ready", "the engine to load")
        with serving(create_app(engine)) as url:
            served = post(url, {"prompt": "a red fox", "size": "64x48", "seed": 7, "num_inference_steps": 2})
            assert served.status_code == 200, served.text
            png = png_of(served.json()["data"][0])
    finally:
        engine.close()
        engine.join(WAIT_S)
    assert png == made["lora"] and png != made["base"]


def test_a_size_past_the_gpu_memory_plan_is_400_before_any_work(engine, url, monkeypatch):
    """A GPU server plans its memory for the default size and keeps its weights where the plan put them: a request
    for a size whose pool would not fit beside them is refused with 400 (param size), uncomputed, and a smaller one
    still served. The plan is the tiny checkpoint's, made for 64x64 under a budget 1 KB above its need."""
    from moss_cli import stages
    from moss_cli.memory import plan as mp
    ckpt = open_checkpoint()
    weights = {stages.PLAN_COMPONENTS[s]: mp.component_weights(ckpt.component(stages.PLAN_COMPONENTS[s]))
               for s in batch.STAGES}
    need = mp.make(weights, batch.STAGES, 1 << 40, width=64, height=64, reserve=0, held=True).peak
    plan = mp.make(weights, batch.STAGES, need + 1000, width=64, height=64, reserve=0, held=True)
    assert plan.need_at(64, 64) == need and plan.need_at(32, 32) == need and plan.need_at(64, 96) > need + 1000
    made = engine.made
    monkeypatch.setattr(engine, "plan", plan)
    r = post(url, {"prompt": "a fox", **SMALL, "size": "64x96"})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "size" and "64x96" in error["message"] \
        and "--gpu-memory" in error["message"]
    assert post(url, {"prompt": "a fox", **TINY}).status_code == 200 and engine.made == made + 1
    # planted: without the plan the same request is made
    monkeypatch.setattr(engine, "plan", None)
    assert post(url, {"prompt": "a fox", **TINY, "size": "64x96"}).status_code == 200


def test_the_native_endpoint_starts_from_a_picture_as_moss_image_init_image_does(url, fox, tmp_path):
    """init_image (and mask) in base64 with a strength: the PNG equals moss-image --init-image (--mask) byte for
    byte; the size is the picture's unless given."""
    (tmp_path / "in.png").write_bytes(fox[7])
    mask = np.zeros((48, 64, 3), np.uint8)
    mask[:, 32:] = 255
    Image.fromarray(mask).save(tmp_path / "mask.png")
    for extra, args in (({"strength": 0.5}, ["--strength", "0.5"]),
                        ({"mask": base64.b64encode((tmp_path / "mask.png").read_bytes()).decode()},
                         ["--mask", tmp_path / "mask.png"])):
        out = tmp_path / "want.png"
        r = run("moss-image", "--prompt", "a fox in the snow", "--seed", 3, "--steps", 4, "--init-image",
                tmp_path / "in.png", *args, "--picture", out, "--quiet")
        assert r.code == 0, r.stderr
        got = post(url, {"prompt": "a fox in the snow", "seed": 3, "steps": 4,
                         "init_image": base64.b64encode(fox[7]).decode(), **extra}, path="/v1/moss/image")
        assert got.status_code == 200, got.text
        assert got.content == out.read_bytes()
        params = json.loads(Image.open(io.BytesIO(got.content)).text["parameters"])
        assert (params["width"], params["height"]) == (64, 48) and params["picture_sha256"]


@pytest.mark.parametrize("change,param,says", [
    ({"mask": "aGVsbG8="}, "mask", "needs a picture to keep: give init_image"),
    ({"strength": 0.5}, "strength", "needs a picture to start from: give init_image"),
    ({"init_image": "FOX", "strength": 1.5}, "strength", "must be in (0, 1]"),
    ({"init_image": "not base64!"}, "init_image", "not base64"),
    ({"init_image": base64.b64encode(b"hello").decode()}, "init_image", "not a PNG, JPEG or WebP"),
    ({"init_image": "FOX", "mask": "SMALL"}, "mask", "give a mask of the picture's size"),
])
def test_a_bad_picture_to_start_from_gets_400_naming_its_field(engine, url, fox, change, param, says):
    small = io.BytesIO()
    Image.new("L", (32, 32)).save(small, format="PNG")
    files = {"FOX": base64.b64encode(fox[7]).decode(), "SMALL": base64.b64encode(small.getvalue()).decode()}
    made = engine.made
    r = post(url, {"prompt": "a fox", "steps": 1, **{k: files.get(v, v) for k, v in change.items()}},
             path="/v1/moss/image")
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param and says in error["message"], error
    assert engine.made == made


def test_the_openai_clients_image_edit_is_moss_image_init_image_and_mask(url, fox, tmp_path):
    """client.images.edit: the picture as moss-image --init-image takes it, byte for byte; OpenAI's mask (its
    transparent pixels repainted) as the black-and-white mask moss-image --mask takes, the same pixels."""
    (tmp_path / "in.png").write_bytes(fox[7])
    rgba = np.full((48, 64, 4), 255, np.uint8)
    rgba[:, 32:, 3] = 0                                   # the right half transparent: repainted
    Image.fromarray(rgba, "RGBA").save(tmp_path / "openai_mask.png")
    white = np.zeros((48, 64), np.uint8)
    white[:, 32:] = 255
    Image.fromarray(white, "L").save(tmp_path / "mask.png")
    want = {}
    for name, args in (("strength", ["--strength", "0.5"]), ("mask", ["--mask", tmp_path / "mask.png"])):
        r = run("moss-image", "--prompt", "a fox in the snow", "--seed", 3, "--steps", 4, "--init-image",
                tmp_path / "in.png", *args, "--picture", tmp_path / f"{name}-made.png", "--quiet")
        assert r.code == 0, r.stderr
        want[name] = (tmp_path / f"{name}-made.png").read_bytes()
    with open(tmp_path / "in.png", "rb") as image:
        result = client(url).images.edit(model="tiny", image=image, prompt="a fox in the snow", n=2, extra_body={
            "seed": 3, "num_inference_steps": 4, "strength": 0.5})
    assert png_of(result.data[0].model_dump()) == want["strength"]
    assert [item.parameters["seed"] for item in result.data] == [3, 4]
    with open(tmp_path / "in.png", "rb") as image, open(tmp_path / "openai_mask.png", "rb") as mask:
        result = client(url).images.edit(model="tiny", image=image, mask=mask, prompt="a fox in the snow",
                                         extra_body={"seed": 3, "num_inference_steps": 4})
    got = png_of(result.data[0].model_dump())
    assert np.array_equal(np.array(Image.open(io.BytesIO(got))), np.array(Image.open(io.BytesIO(want["mask"]))))
    # planted: the alpha mask read as moss-image reads a mask (no transparency rule) repaints another region
    r = run("moss-image", "--prompt", "a fox in the snow", "--seed", 3, "--steps", 4, "--init-image",
            tmp_path / "in.png", "--mask", tmp_path / "openai_mask.png", "--picture", tmp_path / "literal.png",
            "--quiet")
    assert r.code == 0 and not np.array_equal(np.array(Image.open(tmp_path / "literal.png")),
                                              np.array(Image.open(io.BytesIO(got))))


def test_an_edit_without_a_picture_or_with_a_bad_field_gets_400(url, fox):
    r = httpx.post(f"{url}/v1/images/edits", data={"prompt": "a fox"}, files={"mask": ("m.png", fox[7])},
                   timeout=WAIT_S)
    assert r.status_code == 400 and r.json()["error"]["param"] == "image"
    r = httpx.post(f"{url}/v1/images/edits", data={"prompt": "a fox", "n": "two"}, files={"image": ("i.png", fox[7])},
                   timeout=WAIT_S)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    r = httpx.post(f"{url}/v1/images/edits", data={"prompt": "a fox", "strength": "1.5"},
                   files={"image": ("i.png", fox[7])}, timeout=WAIT_S)
    assert r.status_code == 400 and r.json()["error"]["param"] == "strength"
    r = httpx.post(f"{url}/v1/images/edits", json={"prompt": "a fox"}, timeout=WAIT_S)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_form"

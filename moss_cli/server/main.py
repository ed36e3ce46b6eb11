"""moss-server: the engine behind uvicorn. Loads once, warms, serves; SIGTERM or SIGINT stops taking requests,
finishes the picture being made, and exits 0. A model that fails to load stops the server with its one line."""

import importlib.util
import signal
import socket
import threading

import click

from .. import cli
from ..errors import UsageError
from ..progress import Progress

DEFAULT_PORT = 8000


def _loopback(address):
    import ipaddress
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def _listen(host, port):
    """A socket bound to HOST:PORT, before the model loads: a port in use is one line at once."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        raise UsageError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None
    return sock


def _serve(engine, app, sock, quiet):
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            # as uvicorn's, without noting the signal: uvicorn raises noted signals again after its shutdown,
            # which would end the process with the signal's status instead of 0
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True

        async def shutdown(self, sockets=None):
            engine.close()          # waiting requests answered 503 at once; the one being made finishes
            await super().shutdown(sockets)

    config = uvicorn.Config(app, log_level="warning" if quiet else "info",
                            access_log=not quiet, timeout_graceful_shutdown=None)
    server = Server(config)

    def stop_on_failed_load():
        engine.loaded.wait()
        if engine.state == "failed":
            server.should_exit = True

    threading.Thread(target=stop_on_failed_load, name="load-watch", daemon=True).start()
    server.run(sockets=[sock])
    if engine.state == "failed":
        raise engine.error
    if not server.force_exit:
        engine.join()


@click.command(help="Serve moss-image over HTTP: OpenAI's POST /v1/images/generations, POST /v1/moss/image "
                    "(moss-image's options, returns the PNG), GET /v1/models and GET /health. Each PNG equals "
                    "moss-image's with the same options, byte for byte.")
@cli.model_option
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0 for every interface; then give an --api-key).")
@click.option("--port", type=click.IntRange(0, 65535), default=DEFAULT_PORT, show_default=True)
@cli.device_option
@click.option("--gpu-memory", type=click.FloatRange(min=0, min_open=True), default=None, metavar="GB",
              help="GPU memory budget in GB [the GPU's free memory; $MOSS_GPU_MEMORY]: the components stay "
                   "loaded, and the layers that do not fit stream from host memory (the same pictures).")
@click.option("--max-queue", type=click.IntRange(min=1), default=16, show_default=True,
              help="Requests that may wait; one more is answered 429 with Retry-After.")
@click.option("--api-key", envvar="MOSS_API_KEY", default=None,
              help="Require Authorization: Bearer KEY (default: $MOSS_API_KEY; none: no key).")
@click.option("--lora", multiple=True, metavar="[NAME=]FILE[:SCALE]",
              help="A LoRA or LoKr adapter, read once and named NAME (default: the file's stem); repeatable. A request "
                   "picks any of them with scales (its lora field); one that picks none gets these at their SCALE "
                   "(default 1; 0: loaded, not applied).")
@cli.quiet_option
@cli.version_option
def _server(model_dir, host, port, device, gpu_memory, max_queue, api_key, lora, quiet):
    if any(importlib.util.find_spec(m) is None for m in ("fastapi", "uvicorn")):
        raise UsageError("the server needs the server extra: pip install 'moss-cli[server]'")
    from .app import create_app
    from .engine import Engine
    progress = Progress(quiet, "moss-server")
    checkpoint, adapters = _adapters(model_dir, lora)
    api_key = api_key or None        # an empty $MOSS_API_KEY is no key
    engine = Engine(checkpoint, device=device, gpu_memory=gpu_memory, max_queue=max_queue, progress=progress,
                    adapters=adapters)
    sock = _listen(host, port)
    chosen = engine.devices
    on = (next(iter(chosen.values())) if len(set(chosen.values())) == 1
          else ", ".join(f"{dev} for {stage}" for stage, dev in chosen.items()))
    progress.note(f"model {checkpoint.root} ({checkpoint.fingerprint[:12]}), device {on}; "
                  f"http://{host}:{sock.getsockname()[1]}" + (", API key required" if api_key else ""))
    for name, adapter in adapters.items():
        progress.note(f"LoRA {name}: {adapter.describe()}")
    if api_key is None and not _loopback(sock.getsockname()[0]):
        progress.warn(f"--host {host} without --api-key: anyone who reaches this port can use the GPU")
    engine.start()
    _serve(engine, create_app(engine, api_key=api_key), sock, quiet)


def _adapters(model_dir, lora):
    """(the checkpoint with the --lora adapters as its own set, {name: lora.Adapter}): each read and checked once."""
    from .. import lora as lora_io
    specs = [lora_io.parse_named(text) for text in lora]
    names = [name for name, _, _ in specs]
    for name in names:
        if names.count(name) > 1:
            raise UsageError(f"--lora: the name {name!r} is given twice; name them NAME=FILE")
    checkpoint = cli._checkpoint(model_dir)
    read = checkpoint.read_adapters([(path, scale) for _, path, scale in specs])
    return checkpoint.with_adapters(read), dict(zip(names, read))


def server_command():
    cli._run(_server, "moss-server")

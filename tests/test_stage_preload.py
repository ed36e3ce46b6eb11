"""The single-stage commands start like moss-image (cli._open): the driver opens, the memory plan is made and the
stage's encoder or transformer weights start for the GPU (stages.preload_gpu_weights) before the device resolves,
which imports the kernel library; --plan preloads nothing; weights sent for a stage that auto then puts on the CPU
are dropped. That a preloaded weight equals a late one, bit for bit, is checked on a GPU
(tests/gpu/test_preload_gpu.py; tests/gpu/test_cli_gpu.py holds the chain to moss-image)."""

import types

import pytest

from moss_cli import cli, stages
from moss_cli.memory import preload


@pytest.fixture
def calls(monkeypatch):
    seen = []
    plan = types.SimpleNamespace(line=lambda: "memory plan: planted", resident=True)

    def preload_gpu_weights(checkpoint, device, stage_list, planner=None):
        seen.append(("preload", list(stage_list)))
        return (0, None) if seen_state["no_gpu"] else (1, plan)

    def resolve(device, stage):
        seen.append(("resolve", stage))
        return seen_state["chosen"]

    seen_state = {"chosen": "cuda", "no_gpu": False}
    monkeypatch.setattr(stages, "preload_gpu_weights", preload_gpu_weights)
    monkeypatch.setattr(cli, "resolve", resolve)
    monkeypatch.setattr(cli, "_memory_plan", lambda *a: seen.append(("memory_plan", a[1])) or
                        (None if a[1] == "cpu" else "late plan"))
    monkeypatch.setattr(preload, "discard", lambda: seen.append(("discard",)))
    monkeypatch.setattr(stages, "Model", lambda checkpoint, device, progress, plan: (device, plan))
    return seen, seen_state, plan


def _open(stage, show_plan=False):
    progress = types.SimpleNamespace(note=lambda line: None, warn=lambda line: None)
    return cli._open(None, "auto", stage, progress, show_plan=show_plan, size=(256, 256))


@pytest.mark.parametrize("stage,sent", [("encode", ["encode"]), ("denoise", ["denoise"]), ("decode", []),
                                        ("encode-image", [])])
def test_the_weights_start_before_the_device_resolves_and_the_plan_is_the_preloads(calls, stage, sent):
    seen, _, plan = calls
    assert _open(stage) == ("cuda", plan)
    assert seen == [("preload", sent), ("resolve", stage)]


def test_plan_preloads_nothing(calls):
    seen, _, _ = calls
    _open("encode", show_plan=True)
    assert seen == [("resolve", "encode"), ("memory_plan", "cuda")]


def test_weights_sent_for_a_stage_auto_puts_on_the_cpu_are_dropped(calls):
    seen, state, _ = calls
    state["chosen"] = "cpu"
    assert _open("denoise") == ("cpu", None)
    assert seen == [("preload", ["denoise"]), ("resolve", "denoise"), ("discard",), ("memory_plan", "cpu")]


def test_without_a_driver_the_plan_is_made_as_before(calls):
    seen, state, _ = calls
    state["no_gpu"] = True
    assert _open("encode") == ("cuda", "late plan")
    assert seen == [("preload", ["encode"]), ("resolve", "encode"), ("memory_plan", "cuda")]

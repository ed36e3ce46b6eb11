"""Where compiled kernels are kept (cuda_kernels.core._cache_dir): any edit of a kernel source names a new
folder, NUMBA_CACHE_DIR overrides it and MOSS_KERNEL_CACHE=0 turns the cache off. (That a second process
loads its kernels from the folder runs on a GPU: tests/gpu/test_kernel_cache.py.)"""

import shutil
from pathlib import Path

from cuda_kernels import core

SOURCES = Path(core.__file__).parent


def test_the_folder_is_named_by_the_sources_and_changes_with_any_edit(tmp_path, monkeypatch):
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.delenv("MOSS_KERNEL_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    copy = tmp_path / "kernels"
    shutil.copytree(SOURCES, copy, ignore=shutil.ignore_patterns("__pycache__"))
    first = core._cache_dir(copy)
    assert Path(first).parent == tmp_path / "cache" / "moss-cli" / "kernels" and len(Path(first).name) == 16
    assert core._cache_dir(copy) == first == core._cache_dir(SOURCES)
    (copy / "core.py").write_text((copy / "core.py").read_text() + "\n# an edit of a device function's module\n")
    assert core._cache_dir(copy) != first


def test_numba_cache_dir_overrides_and_the_switch_turns_it_off(tmp_path, monkeypatch):
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.delenv("MOSS_KERNEL_CACHE", raising=False)
    assert core._cache_dir() == str(tmp_path / "mine")
    monkeypatch.setenv("MOSS_KERNEL_CACHE", "0")
    assert core._cache_dir() is None


def test_an_unwritable_folder_leaves_the_kernels_uncached(tmp_path, monkeypatch):
    """Not numba's fallback beside the sources (keyed by time stamps) and not a failure: no cache."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setattr(core, "CACHE_DIR", str(blocker / "kernels"))
    monkeypatch.setattr(core, "_CACHE_WRITABLE", [])

    class Dispatcher:
        targetoptions = {}

        def enable_caching(self):
            raise AssertionError("caching enabled in an unwritable folder")
    kernel = Dispatcher()
    assert core._cached(kernel) is kernel and core._CACHE_WRITABLE == [False]


_CLOSURE = """
import hashlib
from cuda_kernels import core, flash
print(*(hashlib.sha256(core._closure_bytes(flash._make_flash(128, 1, 64, causal, False).py_func)).hexdigest()
        for causal in (True, False)))
"""


def test_a_factory_kernels_cache_key_is_the_same_in_every_process_and_tells_its_constants_apart():
    """The flash kernel closes over device functions made by its factory; numba's own key pickles them, and
    the pickles differ between processes (a cache miss each time). _closure_bytes keys them by their code
    and constants: two processes agree, and another factory argument (causal) gives another key."""
    import subprocess
    import sys
    runs = [subprocess.run([sys.executable, "-c", _CLOSURE], capture_output=True, text=True, check=True,
                           cwd=SOURCES.parent).stdout.split() for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 2
    assert runs[0][0] != runs[0][1]
